"""`DurableCheckpointer` forwards every `BaseCheckpointSaver` method, checked against langgraph.

The wrapper's methods are written out by hand (typed, readable); these tests enumerate the
installed `BaseCheckpointSaver` so a langgraph release that adds or changes a method fails
here, naming it, instead of silently falling back to the base class's default.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from langgraph.checkpoint.base import BaseCheckpointSaver

from copilot_runtime.checkpointers import DurableCheckpointer, _Backend

pytestmark = pytest.mark.timeout(30)

#: Public members the wrapper inherits on purpose, and why that is right.
INHERITED = {
    "aget": "reads through aget_tuple, which is forwarded",
    "get": "reads through get_tuple, which is forwarded",
    "with_allowlist": "clones the wrapper with a wider serializer, which the wrapper hands "
                      "to the real saver on its next call",
    "config_specs": "describes the config keys, touches no storage",
    "serde": "the wrapper's own serializer, handed to the real saver",
}
#: Public methods the wrapper implements itself instead of forwarding.
OWN = {"get_next_version": "needs no connection, so it works before the database is open"}


def public_members() -> list[str]:
    return sorted(name for name in dir(BaseCheckpointSaver) if not name.startswith("_"))


FORWARDED = [name for name in public_members() if name not in INHERITED and name not in OWN]


def test_every_public_member_is_forwarded_or_inherited_on_purpose() -> None:
    missing = [name for name in FORWARDED if name not in vars(DurableCheckpointer)]
    assert not missing, (
        f"BaseCheckpointSaver has public members DurableCheckpointer neither forwards nor "
        f"lists in INHERITED: {missing}; forward them in copilot_runtime/checkpointers.py")
    stale = [name for name in [*INHERITED, *OWN] if name not in public_members()]
    assert not stale, f"No longer in BaseCheckpointSaver: {stale}; drop them from this test"
    shadowed = [name for name in INHERITED if name in vars(DurableCheckpointer)]
    assert not shadowed, f"Listed as inherited but overridden: {shadowed}"


def _shape(function: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    """Parameter names, kinds and defaults (annotations differ: the base is generic)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("name", [*FORWARDED, *OWN])
def test_signatures_match_the_base_class(name: str) -> None:
    base = getattr(BaseCheckpointSaver, name)
    ours = getattr(DurableCheckpointer, name)
    assert _shape(ours) == _shape(base), (
        f"DurableCheckpointer.{name}{inspect.signature(ours)} differs from "
        f"BaseCheckpointSaver.{name}{inspect.signature(base)}")
    assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(base), name
    assert inspect.isasyncgenfunction(ours) == inspect.isasyncgenfunction(base), name


class _Answer:
    """What the recording saver returns, to check the wrapper passes it back."""


ANSWER = _Answer()


class RecordingSaver(BaseCheckpointSaver[str]):
    """Records each call by name and its arguments bound to the base class's signature."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def record(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        bound = inspect.signature(getattr(BaseCheckpointSaver, name)).bind(self, *args, **kwargs)
        self.calls.append((name, {k: v for k, v in bound.arguments.items() if k != "self"}))


def _recording(name: str) -> Callable[..., Any]:
    base = getattr(BaseCheckpointSaver, name)
    if inspect.isasyncgenfunction(base):
        async def agen(self: RecordingSaver, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            self.record(name, args, kwargs)
            yield ANSWER
        return agen
    if inspect.iscoroutinefunction(base):
        async def coro(self: RecordingSaver, *args: Any, **kwargs: Any) -> Any:
            self.record(name, args, kwargs)
            return ANSWER
        return coro

    def plain(self: RecordingSaver, *args: Any, **kwargs: Any) -> Any:
        self.record(name, args, kwargs)
        return ANSWER
    return plain


for _name in FORWARDED:
    setattr(RecordingSaver, _name, _recording(_name))


class _RecordingBackend(_Backend):
    def __init__(self, saver: RecordingSaver) -> None:
        super().__init__()
        self._saver = saver

    async def saver(self) -> BaseCheckpointSaver[Any]:
        assert self._saver is not None
        return self._saver

    async def _open(self) -> BaseCheckpointSaver[Any]:
        return await self.saver()


def _arguments(name: str) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    """Distinct arguments for every parameter (defaults too): positional, keyword, expected."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    expected: dict[str, Any] = {}
    for parameter in list(inspect.signature(getattr(BaseCheckpointSaver, name))
                          .parameters.values())[1:]:
        value = f"{name}:{parameter.name}"
        expected[parameter.name] = value
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
            kwargs[parameter.name] = value
        else:
            args.append(value)
    return args, kwargs, expected


@pytest.mark.parametrize("name", FORWARDED)
async def test_each_method_reaches_the_real_saver(name: str) -> None:
    saver = RecordingSaver()
    wrapper = DurableCheckpointer(_RecordingBackend(saver), "recording")
    args, kwargs, expected = _arguments(name)
    method = getattr(wrapper, name)
    returns = inspect.signature(getattr(BaseCheckpointSaver, name)).return_annotation
    if inspect.isasyncgenfunction(method):
        assert [item async for item in method(*args, **kwargs)] == [ANSWER]
    else:
        result = method(*args, **kwargs)
        if inspect.iscoroutinefunction(method):
            result = await result
        assert result is (None if returns in (None, "None") else ANSWER), name
    assert saver.calls == [(name, expected)], f"DurableCheckpointer.{name} did not forward"
