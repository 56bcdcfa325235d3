"""Applying a `STATE_DELTA` (RFC 6902) to a state, as compaction, GraphQL's agent state and
the built-in agent's state tool do (`_compaction.patched_state`, `apply_state_delta`).

Before, each patch deep-copied the whole state with `copy.deepcopy` and each `add`, `replace`
and `copy` deep-copied its value again: a patch of forty `copy` operations, each copying a
list into itself, held the event loop for minutes and gigabytes; a thousand `move`s of a
large part cost seconds each. Now the state is copied once, through orjson, and what each
operation adds is weighed before it is made.
"""

from __future__ import annotations

import time
from typing import Any

import jsonpatch
import pytest

from copilot_runtime._compaction import (
    COPY_ALLOWANCE_BYTES,
    StateTooLarge,
    apply_state_delta,
    patched_state,
)

pytestmark = pytest.mark.timeout(30)

_DOUBLING = [{"op": "copy", "from": "/a", "path": "/a/-"}] * 40


def test_copies_of_copies_are_refused_quickly_and_leave_the_state_as_it_was() -> None:
    state = {"a": [1]}
    started = time.monotonic()
    with pytest.raises(StateTooLarge):
        patched_state(state, _DOUBLING)
    assert apply_state_delta(state, _DOUBLING) is state
    assert state == {"a": [1]}
    assert time.monotonic() - started < 15  # minutes before; 0.2 s here unloaded


def test_copies_within_the_allowance_apply() -> None:
    state = {"a": [1]}
    assert patched_state(state, _DOUBLING[:3]) == {"a": [1, [1], [1, [1]], [1, [1], [1, [1]]]]}
    large = {"a": ["x" * (COPY_ALLOWANCE_BYTES // 2)]}
    assert len(patched_state(large, _DOUBLING[:1])["a"]) == 2  # as much as the state holds


def test_a_large_part_moved_to_and_fro_costs_no_copy() -> None:
    state = {"a": [list(range(100)) for _ in range(10_000)], "b": {}}
    patch = [{"op": "move", "from": "/a", "path": "/b/a"},
             {"op": "move", "from": "/b/a", "path": "/a"}] * 500
    started = time.monotonic()
    assert len(apply_state_delta(state, patch)["a"]) == 10_000
    assert time.monotonic() - started < 15  # minutes before; 0.2 s here unloaded


def test_a_patch_past_the_largest_state_does_not_apply() -> None:
    state: dict[str, Any] = {}
    patch = [{"op": "add", "path": "/big", "value": "x" * 1000}]
    with pytest.raises(StateTooLarge):
        patched_state(state, patch, max_bytes=500)
    assert patched_state(state, patch, max_bytes=2000) == {"big": "x" * 1000}


def test_the_patchs_own_values_are_not_changed_by_its_later_operations() -> None:
    patch = [{"op": "add", "path": "/k", "value": {"z": 1}},
             {"op": "add", "path": "/k/w", "value": 2}]
    assert patched_state({}, patch) == {"k": {"z": 1, "w": 2}}
    assert patch[0]["value"] == {"z": 1}  # the event, as it was sent and stored


@pytest.mark.parametrize(("state", "patch"), [
    ({"x": [1, 2]}, [{"op": "add", "path": "/x/1", "value": 9}]),
    ({"x": [1, 2]}, [{"op": "add", "path": "/x/2", "value": 9}]),
    ({"x": [1, 2]}, [{"op": "add", "path": "/x/3", "value": 9}]),
    ({"x": [1, 2]}, [{"op": "add", "path": "/x/-1", "value": 9}]),
    ({"x": [1]}, [{"op": "add", "path": "/x/01", "value": 9}]),
    ({"x": [1, 2]}, [{"op": "replace", "path": "/x/1", "value": 9}]),
    ({"x": [1, 2]}, [{"op": "replace", "path": "/x/2", "value": 9}]),
    ({"x": [1, 2]}, [{"op": "replace", "path": "/x/-", "value": 9}]),
    ({"x": {}}, [{"op": "replace", "path": "/x/k", "value": 9}]),
    ({"x": 1}, [{"op": "add", "path": "/x/k", "value": 9}]),
    ({}, [{"op": "add", "path": "", "value": [1]}]),
    ({"a~b/c": 1}, [{"op": "replace", "path": "/a~0b~1c", "value": 2}]),
    ({"x": [1, 2]}, [{"op": "copy", "from": "/x", "path": "/y"},
                     {"op": "add", "path": "/y/-", "value": 3}]),
    ({"x": [1, 2]}, [{"op": "remove", "path": "/x/0"}, {"op": "test", "path": "/x/0",
                                                         "value": 2}]),
    ({"x": [1, 2]}, [{"op": "move", "from": "/x/0", "path": "/x/-"}]),
    ({"x": [1]}, [{"op": "copy", "from": "/nope", "path": "/y"}]),
    ({"x": [1]}, [{"op": "add", "path": 5, "value": 1}]),
])
def test_operations_apply_as_jsonpatch_applies_them(state: Any, patch: Any) -> None:
    try:
        expected = jsonpatch.apply_patch(state, patch, in_place=False)
    except Exception:
        expected = state  # refused: the very same object
    assert apply_state_delta(state, patch) == expected
