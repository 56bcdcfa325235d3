"""Server-side actions: schemas, validation, sync and async handlers, failures."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import inspect
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import orjson
import pydantic
import pytest
from structlog.testing import capture_logs

from copilot_runtime import Action, ActionError, ConfigurationError, action
from copilot_runtime.actions import MAX_ACTION_RESULT_BYTES

pytestmark = pytest.mark.timeout(60)


def test_action_derives_schema_from_type_hints() -> None:
    @action
    def book(city: str, nights: int = 1, kind: Literal["hotel", "hostel"] = "hotel") -> str:
        """Book a room."""
        return f"{city}:{nights}:{kind}"

    assert book.name == "book"
    assert book.description == "Book a room."
    schema = book.parameters
    assert schema["required"] == ["city"]
    assert schema["properties"]["nights"]["type"] == "integer"
    assert schema["properties"]["kind"]["enum"] == ["hotel", "hostel"]
    assert schema["additionalProperties"] is False


def test_decorator_with_options() -> None:
    @action(name="lookup-user", description="Find a user")
    async def find(user_id: int) -> dict[str, int]:
        return {"id": user_id}

    assert (find.name, find.description) == ("lookup-user", "Find a user")


class Address(pydantic.BaseModel):
    street: str
    zip: str


async def test_pydantic_arguments_and_results() -> None:
    @action
    async def ship(to: Address, items: list[str]) -> Address:
        return to

    result = await ship.execute('{"to": {"street": "Main", "zip": "1"}, "items": ["a"]}')
    assert orjson.loads(result) == {"street": "Main", "zip": "1"}


async def test_sync_handlers_run_off_the_event_loop() -> None:
    seen: list[str] = []

    @action
    def where() -> str:
        seen.append(threading.current_thread().name)
        return "ok"

    assert await where.execute("{}") == '"ok"'
    assert seen
    assert seen[0] != threading.main_thread().name


async def test_a_sync_generator_handler_is_consumed_off_the_event_loop() -> None:
    # Before, only the generator was made in the thread: the encoder ran its body on the loop.
    seen: list[str] = []

    def rows() -> Iterator[dict[str, int]]:
        for row in range(2):
            seen.append(threading.current_thread().name)
            yield {"row": row}

    assert await Action("rows", rows).execute("{}") == '[{"row":0},{"row":1}]'
    assert seen
    assert threading.main_thread().name not in seen


async def test_a_failing_generator_reads_like_any_failing_handler() -> None:
    def rows() -> Iterator[int]:
        yield 1
        raise ConnectionError("database went away")

    async def async_rows() -> AsyncIterator[int]:
        yield 1
        raise ConnectionError("database went away")

    for handler in (rows, async_rows):
        with pytest.raises(ActionError) as info:
            await Action("rows", handler).execute("{}")
        assert info.value.message == "ConnectionError: database went away"


async def test_a_generator_in_a_result_runs_where_its_handler_ran() -> None:
    # Before, only a generator returned whole was run in the handler's thread: one in a dict
    # was run by the encoder on the event loop, and its failure read "not JSON serializable".
    seen: list[str] = []

    def rows() -> Iterator[int]:
        for row in range(2):
            seen.append(threading.current_thread().name)
            yield row

    def failing_rows() -> Iterator[int]:
        yield 1
        raise ConnectionError("database went away")

    assert await Action("rows", lambda: {"rows": rows()}).execute("{}") == '{"rows":[0,1]}'
    assert seen
    assert threading.main_thread().name not in seen

    async def async_failing() -> dict[str, Any]:
        return {"rows": [failing_rows()]}

    for handler in (lambda: {"rows": failing_rows()}, async_failing):
        with pytest.raises(ActionError) as info:
            await Action("rows", handler).execute("{}")
        assert info.value.message == "ConnectionError: database went away"


async def test_a_coroutine_returned_after_its_run_stopped_is_closed() -> None:
    # Before, a sync handler still in its thread when the run stopped had the coroutine it
    # then returned dropped unawaited ("coroutine ... was never awaited").
    returning = threading.Event()
    returned: list[Any] = []

    async def later() -> int:
        return 1

    def slow() -> Any:
        returning.wait(5)
        returned.append(later())
        return returned[0]

    run = asyncio.ensure_future(Action("slow", slow).execute("{}"))
    await asyncio.sleep(0.05)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    returning.set()
    for _ in range(200):
        if returned and inspect.getcoroutinestate(returned[0]) == inspect.CORO_CLOSED:
            break
        await asyncio.sleep(0.01)
    assert inspect.getcoroutinestate(returned[0]) == inspect.CORO_CLOSED


async def test_an_async_generator_handler_answers_its_items() -> None:
    async def rows() -> AsyncIterator[int]:
        for row in range(3):
            await asyncio.sleep(0)
            yield row

    async def returns_rows() -> AsyncIterator[int]:
        return rows()

    assert await Action("rows", rows).execute("{}") == "[0,1,2]"
    assert await Action("rows", returns_rows).execute("{}") == "[0,1,2]"


async def _fetch(city: str) -> dict[str, str]:
    await asyncio.sleep(0)
    return {"city": city}


class _Weather:
    async def __call__(self, city: str) -> dict[str, str]:
        return await _fetch(city)


def _logged(handler: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(**kwargs: Any) -> Any:  # a sync decorator around an async function
        return handler(**kwargs)
    return wrapper


@pytest.mark.parametrize("handler", [
    _Weather(), lambda **kwargs: _fetch(**kwargs), _logged(_fetch),
    functools.partial(_fetch)], ids=["async-call", "lambda", "sync-decorator", "partial"])
async def test_a_handler_returning_an_awaitable_has_it_awaited(
        handler: Callable[..., Any]) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    weather = Action("weather", handler, parameters=schema)
    assert await weather.execute('{"city": "Oslo"}') == '{"city":"Oslo"}'


@pytest.mark.parametrize(("arguments", "message"), [
    ("{oops", "arguments are not valid JSON"),
    ("[1]", "arguments must be a JSON object"),
    ("{}", "city: Field required"),
    ('{"city": 3}', "city: Input should be a valid string"),
    ('{"city": "x", "extra": 1}', "extra: Extra inputs are not permitted"),
])
async def test_bad_arguments(arguments: str, message: str) -> None:
    @action
    def weather(city: str) -> str:
        return city

    with pytest.raises(ActionError, match=message):
        await weather.execute(arguments)


async def test_json_schema_action_validates() -> None:
    calls: list[dict[str, object]] = []

    async def handler(**kwargs: object) -> dict[str, object]:
        calls.append(kwargs)
        return {"ok": True}

    explicit = Action("add", handler, description="Add numbers", parameters={
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"]})
    assert await explicit.execute('{"a": 1, "b": 2}') == '{"ok":true}'
    assert calls == [{"a": 1, "b": 2}]
    with pytest.raises(ActionError, match="'b' is a required property"):
        await explicit.execute('{"a": 1}')
    with pytest.raises(ActionError, match="a: 'x' is not of type 'number'"):
        await explicit.execute('{"a": "x", "b": 1}')


async def test_handler_exception_becomes_action_error_without_internals() -> None:
    @action
    async def explode() -> None:
        await asyncio.sleep(0)
        raise ValueError("bad input value")

    with pytest.raises(ActionError) as info:
        await explode.execute("{}")
    assert info.value.message == "ValueError: bad input value"
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__


async def test_unserialisable_result() -> None:
    @action
    def weird() -> object:
        return object()

    with pytest.raises(ActionError, match="could not be encoded as JSON"):
        await weird.execute("{}")


def test_configuration_errors() -> None:
    with pytest.raises(ConfigurationError, match="must be 1-64"):
        Action("has space", lambda: None)
    with pytest.raises(ConfigurationError, match="invalid parameters schema"):
        Action("x", lambda: None, parameters={"type": "nonsense"})


def nested_not(levels: int) -> dict[str, object]:
    """An object schema whose one property nests `not` `levels` deep."""
    schema: dict[str, object] = {"type": "string"}
    for _ in range(levels):
        schema = {"not": schema}
    return {"type": "object", "properties": {"q": schema}}


def test_a_schema_jsonschema_cannot_check_is_a_configuration_error() -> None:
    """Before: jsonschema's check of a schema nesting 150 deep raised RecursionError, and
    of a `$schema` that is a list TypeError, out of `Action()` (an MCP server listing such a
    tool stopped an app's start, a run, a reconnect)."""
    with pytest.raises(ConfigurationError, match="nested too deeply to check"):
        Action("deep", lambda **_: None, parameters=nested_not(150))
    with pytest.raises(ConfigurationError, match=r"its \$schema is not a string"):
        Action("odd", lambda **_: None, parameters={"type": "object", "$schema": ["x"]})
    assert Action("fine", lambda **_: None, parameters=nested_not(20)).name == "fine"


@contextlib.contextmanager
def recording_server() -> Iterator[tuple[str, list[str]]]:
    """A local HTTP server answering every GET with a schema; yields its URL and the paths
    it was asked for."""
    asked: list[str] = []

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"type": "string", "enum": ["INTERNAL-ONLY-7731"]}')

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def with_ref(ref: str, **more: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"x": {"$ref": ref}}, **more}


def test_a_schema_ref_is_never_fetched_and_one_that_cannot_be_resolved_is_refused(
        tmp_path: Path) -> None:
    """Before: jsonschema fetched a `$ref` to a URL (urlopen, no timeout, in the event loop)
    or read a `file:` one when the arguments were checked, and the document's contents came
    back in the tool error; a dangling local one raised out of the run."""
    secret = tmp_path / "secret.json"
    secret.write_text('{"type": "string", "enum": ["FILE-ONLY-7731"]}')
    with recording_server() as (url, asked):
        for ref in (f"{url}/internal/meta.json", secret.as_uri(), "#/$defs/Missing"):
            with pytest.raises(ConfigurationError, match="cannot be resolved") as caught:
                Action("t", lambda **_: None, parameters=with_ref(ref))
            assert "7731" not in str(caught.value)
    assert asked == []


async def test_refs_the_schema_holds_itself_still_resolve() -> None:
    """Local pointers, `$id`s within the schema and the bundled meta-schemas need nothing
    fetched."""
    with recording_server() as (url, asked):
        local = Action("a", lambda **kw: kw, parameters=with_ref(
            "#/$defs/City", **{"$defs": {"City": {"type": "string"}}}))
        embedded = Action("b", lambda **kw: kw, parameters=with_ref(f"{url}/n.json", **{
            "$defs": {"n": {"$id": f"{url}/n.json", "type": "integer"}}}))
        draft7 = Action("c", lambda **kw: kw, parameters=with_ref("#/definitions/N", **{
            "$schema": "http://json-schema.org/draft-07/schema#",
            "definitions": {"N": {"type": "integer"}}}))
        meta = Action("d", lambda **kw: kw, parameters=with_ref(
            "https://json-schema.org/draft/2020-12/schema"))
        assert await local.execute('{"x": "Paris"}') == '{"x":"Paris"}'
        for integer_only in (embedded, draft7):
            with pytest.raises(ActionError, match="is not of type 'integer'"):
                await integer_only.execute('{"x": "a"}')
        with pytest.raises(ActionError, match="x/type: 5 is not valid under any of the given"):
            await meta.execute('{"x": {"type": 5}}')
    assert asked == []


async def test_a_ref_that_fails_while_arguments_are_checked_is_a_tool_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reference the up-front check let through (were there one) costs that call, not the
    run: before, `_WrappedReferencingError` left `execute`."""
    import copilot_runtime.actions as actions

    monkeypatch.setattr(actions, "_unresolvable_ref", lambda *_: None)
    with recording_server() as (url, asked):
        for ref in (f"{url}/internal/meta.json", "#/$defs/Missing"):
            dangling = Action("t", lambda **_: None, parameters=with_ref(ref))
            with pytest.raises(ActionError, match="cannot be resolved") as caught:
                await dangling.execute('{"x": "a"}')
            assert "7731" not in str(caught.value)
    assert asked == []


async def test_parameters_pydantic_would_take_for_its_own_are_the_model_s() -> None:
    # A leading underscore made the parameter private (left out of the schema) and a name
    # like a model attribute was a raw pydantic error at decoration.
    @action
    def lookup(_id: int, model_dump: str = "no", json: bool = False) -> list[Any]:
        return [_id, model_dump, json]

    assert lookup.parameters["required"] == ["_id"]
    assert list(lookup.parameters["properties"]) == ["_id", "model_dump", "json"]
    assert await lookup.execute('{"_id": 7, "json": true}') == '[7,"no",true]'
    with pytest.raises(ActionError, match="_id: Field required"):
        await lookup.execute("{}")


async def test_an_alias_the_handler_gives_is_the_name_the_model_sees() -> None:
    @action
    def weather(city: str = pydantic.Field("Oslo", alias="town")) -> str:
        return city

    assert list(weather.parameters["properties"]) == ["town"]
    assert await weather.execute('{"town": "Rome"}') == '"Rome"'


async def test_positional_only_parameters_are_passed_by_position() -> None:
    @action
    def area(width: float, height: float = 1.0, /, *, unit: str = "m") -> str:
        return f"{width * height}{unit}2"

    assert area.parameters["required"] == ["width"]
    assert await area.execute('{"width": 2, "height": 3}') == '"6.0m2"'
    assert await area.execute('{"width": 2, "unit": "cm"}') == '"2.0cm2"'


def test_a_parameter_pydantic_has_no_schema_for_is_a_configuration_error() -> None:
    # Before, the model's schema was made outside the check: a raw pydantic error.
    def cb(fn: Callable[[], int]) -> int:
        return fn()

    with pytest.raises(ConfigurationError, match="Cannot derive a schema for action 'cb': "):
        action(cb)


def _past_the_bound(listed: list[int]) -> Iterator[int]:
    """Items without end, as far as the runtime can tell (it stops well past the bound)."""
    for item in itertools.count():
        if item > 2 * MAX_ACTION_RESULT_BYTES:
            raise AssertionError("listed past the bound")
        listed.append(item)
        yield 0


async def test_an_iterator_in_a_result_is_listed_only_up_to_the_bound() -> None:
    # Before, an iterator was listed whole before the result's size was checked: an endless
    # one grew the process's memory until it died.
    listed: list[int] = []

    async def async_handler() -> dict[str, Any]:
        return {"rows": _past_the_bound(listed)}

    async def endless_async() -> AsyncIterator[int]:
        for item in itertools.count():
            if item > 2 * MAX_ACTION_RESULT_BYTES:
                raise AssertionError("listed past the bound")
            listed.append(item)
            yield 0

    for handler in (lambda: {"rows": _past_the_bound(listed)}, async_handler,
                    endless_async, lambda: ([0] for _ in _past_the_bound(listed))):
        listed.clear()
        with pytest.raises(ActionError, match=f"is larger than {MAX_ACTION_RESULT_BYTES} bytes"):
            await Action("rows", handler).execute("{}")
        # (each item is at least two bytes of JSON: past half the bound, it is over it)
        assert len(listed) <= MAX_ACTION_RESULT_BYTES // 2 + 1

    # The bound counts the items of every iterator in the result.
    halves = {"a": iter([0] * (MAX_ACTION_RESULT_BYTES // 4 + 1)),
              "b": iter([0] * (MAX_ACTION_RESULT_BYTES // 4 + 1))}
    with pytest.raises(ActionError, match="is larger than"):
        await Action("rows", lambda: halves).execute("{}")
    rows = list(range(MAX_ACTION_RESULT_BYTES // 16))
    assert orjson.loads(await Action("rows", lambda: {"rows": iter(rows)}).execute("{}")) == {
        "rows": rows}


async def test_a_stopped_run_stops_listing_its_result() -> None:
    # Before, the worker thread went on listing a stopped run's result to its end, so a few
    # stopped runs with endless results held every sync handler's thread for good.
    listed: list[int] = []
    listing, closed = threading.Event(), threading.Event()

    def slow_rows() -> Iterator[int]:
        end = time.monotonic() + 3  # (endless in spirit; ended so a failure frees its thread)
        try:
            while time.monotonic() < end:
                time.sleep(0.001)
                listed.append(0)
                listing.set()
                yield 0
        finally:
            closed.set()

    run = asyncio.ensure_future(Action("rows", lambda: {"rows": slow_rows()}).execute("{}"))
    assert await asyncio.to_thread(listing.wait, 5)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    await asyncio.to_thread(closed.wait, 1)
    assert closed.is_set()  # (closed in its thread, at the next item)
    stopped_at = len(listed)
    await asyncio.sleep(0.1)
    assert len(listed) == stopped_at


class _Rows(pydantic.BaseModel):
    rows: Any


class _Serialised(pydantic.BaseModel):
    x: int

    @pydantic.field_serializer("x")
    def _x(self, x: int) -> int:
        raise ConnectionError("postgres://admin:hunter2@db.internal/prod went away")


async def test_a_failure_while_pydantic_encodes_a_result_is_the_handler_s() -> None:
    # Before, pydantic let what a generator in a model raised through, and the model read
    # "could not be encoded as JSON (Type is not JSON serializable: _Rows)", nothing logged.
    def failing_rows() -> Iterator[int]:
        yield 1
        raise ConnectionError("database went away")

    for handler, message in (
            (lambda: _Rows(rows=failing_rows()), "ConnectionError: database went away"),
            (lambda: _Serialised(x=1),
             "ConnectionError: postgres://[REDACTED]@db.internal/prod went away")):
        with capture_logs() as logs, pytest.raises(ActionError) as info:
            await Action("rows", handler).execute("{}")
        assert info.value.message == message
        assert [log["event"] for log in logs] == ["action failed"]

    assert await Action("rows", lambda: _Rows(rows=iter([1]))).execute("{}") == '{"rows":[1]}'
    with pytest.raises(ActionError, match="could not be encoded as JSON"):
        await Action("rows", lambda: _Rows(rows=object())).execute("{}")


async def test_a_default_json_cannot_hold_is_left_out_of_the_schema() -> None:
    # Before, pydantic's PydanticJsonSchemaWarning escaped `@action`.
    @action
    def key_length(x: int, key: bytes = b"\xff") -> int:
        return x + len(key)

    assert key_length.parameters["properties"]["key"] == {
        "format": "binary", "title": "Key", "type": "string"}
    assert key_length.parameters["required"] == ["x"]
    assert await key_length.execute('{"x": 1}') == "2"
