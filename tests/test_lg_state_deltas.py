"""How an agent's state changes reach the client (`StateDeltaEncoder`, `state_patch`).

Before, the deltas came from jsonpatch's `make_patch`: quadratic in a list's length (an item
put in front of 12,000 small ones held the event loop for 7-11 s), blind to a change between
1 and true (Python's `True == 1`: no event at all), and sometimes a `move` that
fast-json-patch, as `@ag-ui/client` calls it, refuses: the client kept its old state and
sent it back on its next run, undoing the graph's write.
"""

from __future__ import annotations

import random
import time
import types
from typing import Any

import orjson
import pytest

from copilot_runtime.agents import _wire
from copilot_runtime.agents._wire import StateDeltaEncoder
from tests.test_real_clients import run_client_script

pytestmark = pytest.mark.timeout(120)

Json = dict[str, Any]


def sent(before: Json, after: Json) -> Json | None:
    """The event that tells a client holding `before` that the state is now `after`."""
    encoder = StateDeltaEncoder()
    encoder.encode(orjson.loads(orjson.dumps(before)))
    return encoder.encode(orjson.loads(orjson.dumps(after)))


def as_json(value: Any) -> bytes:
    """`value` as JSON sees it (True is not 1; an object's keys have no order)."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def client_states(cases: list[tuple[Json, Json | None]]) -> list[Any]:
    """The state `@ag-ui/client` holds after each (state, event); a patch it refuses leaves
    the state as it was (it logs "Failed to apply state patch")."""
    applied = run_client_script("apply_events.mjs", [
        {"events": [e for e in (event,) if e is not None], "state": state}
        for state, event in cases])
    return [held["state"] for held in applied]


def test_a_list_changed_throughout_costs_about_a_snapshot() -> None:
    """An item put in front of 24,000 and every other one changed (the hunter's case)."""
    rows = [{"i": i, "v": "x"} for i in range(24_000)]
    after = {"rows": [{"i": -1, "v": "new"}, *({"i": i, "v": "y" if i % 2 else "x"}
                                              for i in range(24_000))]}
    started = time.monotonic()
    event = sent({"rows": rows}, after)
    assert time.monotonic() - started < 5  # 30 s before; 0.05 s here unloaded
    assert event == {"type": "STATE_SNAPSHOT", "snapshot": after}  # (no delta is smaller)


def test_an_item_put_in_front_of_a_long_list_is_one_operation() -> None:
    rows = [{"i": i, "v": "x"} for i in range(24_000)]
    event = sent({"rows": rows, "n": 1}, {"rows": [{"i": -1}, *rows], "n": 2})
    assert event == {"type": "STATE_DELTA", "delta": [
        {"op": "add", "path": "/rows/0", "value": {"i": -1}},
        {"op": "replace", "path": "/n", "value": 2}]}


def test_a_small_change_of_a_large_state_is_still_a_small_delta() -> None:
    rows = [{"id": i, "done": False} for i in range(5_000)]
    after = {"rows": [*rows[:10], {"id": 10, "done": True}, *rows[11:], {"id": 5000}],
             "note": "b"}
    event = sent({"rows": rows, "note": "a"}, after)
    assert event is not None
    assert event["delta"] == [{"op": "replace", "path": "/rows/10/done", "value": True},
                              {"op": "add", "path": "/rows/5000", "value": {"id": 5000}},
                              {"op": "replace", "path": "/note", "value": "b"}]


def test_a_change_between_a_number_and_a_boolean_is_sent() -> None:
    cases = [({"flag": 0, "big": "x" * 200}, {"flag": False, "big": "x" * 200}),
             ({"items": [1, 0, 1], "big": "x" * 200},
              {"items": [True, False, 1], "big": "x" * 200}),
             ({"n": {"a": 1.0}}, {"n": {"a": True}})]
    events = [sent(before, after) for before, after in cases]
    assert all(event is not None for event in events)  # none at all before
    held = client_states([(before, event) for (before, _), event in zip(cases, events,
                                                                          strict=True)])
    assert [as_json(h) for h in held] == [as_json(after) for _, after in cases]


def test_with_deltas_off_no_state_is_encoded_for_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each state goes whole: before, every one was also encoded for a comparison never
    made (~7 ms per event for a 7 MB state)."""
    encoded: list[Any] = []

    def dumps(value: Any, **options: Any) -> bytes:
        encoded.append(value)
        return orjson.dumps(value, **options)

    monkeypatch.setattr(_wire, "orjson", types.SimpleNamespace(
        dumps=dumps, OPT_NON_STR_KEYS=orjson.OPT_NON_STR_KEYS))
    encoder = StateDeltaEncoder(deltas=False)
    states: list[Json] = [{"rows": [1, 2]}, {"rows": [1, 2]}, {"rows": [3]}]
    assert [encoder.encode(state) for state in states] == [
        {"type": "STATE_SNAPSHOT", "snapshot": state} for state in states]
    assert encoded == []


def _value(depth: int) -> Any:
    roll = random.random()
    if depth > 2 or roll < 0.4:
        return random.choice([0, 1, 2, "a", "b", None, True, False, 1.5, "", []])
    if roll < 0.7:
        return [_value(depth + 1) for _ in range(random.randint(0, 4))]
    return {random.choice("abcd/~"): _value(depth + 1) for _ in range(random.randint(0, 4))}


def _changed(value: Any) -> Any:
    """`value` with a few random edits: items inserted, dropped, moved, changed."""
    if isinstance(value, list):
        out = [_changed(item) if random.random() < 0.3 else item for item in value]
        for _ in range(random.randint(0, 2)):
            edit = random.random()
            if edit < 0.35:
                out.insert(random.randint(0, len(out)), _value(1))
            elif edit < 0.7 and out:
                out.pop(random.randrange(len(out)))
            elif out:
                out.insert(random.randint(0, len(out)), out.pop(random.randrange(len(out))))
        return out
    if isinstance(value, dict):
        out = {k: _changed(v) if random.random() < 0.3 else v for k, v in value.items()}
        if out and random.random() < 0.3:
            out.pop(random.choice(list(out)))
        if random.random() < 0.3:
            out[random.choice("abcde")] = _value(1)
        return out
    return _value(2) if random.random() < 0.5 else value


def test_the_client_applies_every_delta() -> None:
    random.seed(11)
    cases: list[tuple[Json, Json]] = [
        # a `move` fast-json-patch refused ("groups/0" into "groups/1/pending")
        ({"groups": [[], ["alice"], {"name": "ops", "members": ["bob"]}], "notes": "x" * 200},
         {"groups": [["alice"], {"name": "ops", "members": ["bob"], "pending": []}],
          "notes": "x" * 200}),
        ({"__proto__": {"a": 1}, "b": "x" * 100}, {"__proto__": {"a": 2}, "b": "x" * 100}),
    ]
    while len(cases) < 3_000:
        before = {"s": _value(0), "pad": "x" * random.choice([0, 50, 400])}
        cases.append((before, {**before, "s": _changed(_changed(before["s"]))}))
    events = [sent(before, after) for before, after in cases]
    assert sum(e is not None and e["type"] == "STATE_DELTA" for e in events) > 1_000
    held = client_states([(before, event) for (before, _), event in zip(cases, events,
                                                                          strict=True)])
    for (before, after), event, state in zip(cases, events, held, strict=True):
        assert as_json(state) == as_json(after), (before, event)
