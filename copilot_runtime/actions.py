"""Server-side actions: Python functions the model can call during a run.

`Action` takes an explicit JSON schema; `@action` derives one from the handler's type hints
with pydantic. Either way the arguments are validated before the handler runs, and a bad
argument or a failing handler becomes an `ActionError` whose message the model sees as the
tool's result, so a broken tool never crashes the run.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import re
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, overload

import orjson
import pydantic
import structlog
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaWarningKind
from pydantic_core import ErrorDetails, PydanticSerializationError, to_jsonable_python

from copilot_runtime._exceptions import (
    ActionError,
    ConfigurationError,
    failure_text,
    scrubbed,
)
from copilot_runtime._limits import decode_json

if TYPE_CHECKING:
    import jsonschema
    import referencing

__all__ = ["Action", "action"]

_log = structlog.get_logger("copilot_runtime.actions")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what OpenAI accepts for a function name
#: The largest result (as JSON) an action may return: it goes to the model in the next
#: request and to the client in the stream, whole.
MAX_ACTION_RESULT_BYTES = 1024 * 1024
#: The most items listed from the iterators in one result: each is at least two bytes of
#: JSON (itself and a comma or bracket), so a result with more is over the bound anyway.
_MOST_ITEMS = MAX_ACTION_RESULT_BYTES // 2


#: The most sync handlers that run at once; more wait for a thread.
SYNC_HANDLER_THREADS = 32
_threads: ThreadPoolExecutor | None = None


def _sync_handler_threads() -> ThreadPoolExecutor:
    """The threads sync handlers run in, their own: asyncio's default executor (six threads
    on two cores) also looks up the host name of every new connection, so a few handlers
    hung on a dead service stopped every provider connection of the process; here they
    hold back only other sync handlers."""
    global _threads
    if _threads is None:
        _threads = ThreadPoolExecutor(SYNC_HANDLER_THREADS, thread_name_prefix="action")
    return _threads


#: A handler's result (True, its value) or what it raised (False, the exception).
_Outcome = tuple[bool, Any]


class _ResultFailed(Exception):
    """What the handler's own code raised while its result was encoded (an iterator in it, a
    pydantic serializer of it): the handler's failure, running late, not the encoding's."""

    def __init__(self, failure: BaseException) -> None:
        super().__init__(failure)
        self.failure = failure


def _over_bound(action: str, said: str, **measured: int) -> ActionError:
    _log.warning("action result over the bound", action=action, **measured)
    return ActionError(f"the result ({said}) is larger than {MAX_ACTION_RESULT_BYTES} bytes")


class _Listing:
    """The listing of the iterators in one action's result: their items, counted against
    the bound, and whether its run has stopped (set on the event loop, read per item where
    the handler ran: a thread cannot be stopped, but its listing can)."""

    __slots__ = ("action", "items", "stopped")

    def __init__(self, action: str) -> None:
        self.action = action
        self.items = 0
        self.stopped = False

    def _refusal(self) -> ActionError:
        if self.stopped:  # (no one reads it: the run is gone)
            return ActionError("the run stopped while the result was listed")
        return _over_bound(self.action, f"more than {_MOST_ITEMS} items", items=self.items)

    def jsonable(self, value: Any) -> Any:
        """What the encoder writes for a value it has no JSON for: an iterator's (a
        generator's) items, listed, wherever it is in the result; else pydantic's JSON form
        of it."""
        if isinstance(value, Iterator) and not inspect.isawaitable(value):
            return self._listed(value)
        try:
            return to_jsonable_python(value)
        except PydanticSerializationError as exc:
            if exc.__cause__ is None:
                raise  # a value it has no JSON for: the encoding's error
            raise _ResultFailed(exc.__cause__) from None  # (a serializer of the result's)
        except BaseException as exc:  # (an iterator in a model: pydantic lists it itself)
            raise _ResultFailed(exc) from None

    def _listed(self, iterator: Iterator[Any]) -> list[Any]:
        items: list[Any] = []
        room = _MOST_ITEMS - self.items
        try:
            for item in iterator:
                if self.stopped or len(items) == room:
                    if isinstance(iterator, Generator):
                        iterator.close()  # (its cleanup runs here, now)
                    break
                items.append(item)
            else:
                self.items += len(items)
                return items
        except BaseException as exc:
            raise _ResultFailed(exc) from None
        self.items += len(items)
        raise self._refusal()

    async def listed_async(self, iterator: AsyncIterator[Any]) -> list[Any]:
        """An async iterator's items (it runs in the handler's task: a stop cancels it)."""
        items: list[Any] = []
        async for item in iterator:
            if len(items) == _MOST_ITEMS - self.items:
                self.items += len(items)
                aclose = getattr(iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                raise self._refusal()
            items.append(item)
        self.items += len(items)
        return items


def _encoded(result: Any, listing: _Listing) -> _Outcome:
    """`result` as JSON, encoded where its handler ran (its thread or its task): encoding
    runs the code of a generator anywhere in it, which must not run on the event loop, and
    what that code raises is the handler's failure. A value JSON cannot hold is an
    `ActionError` saying so."""
    try:
        return True, orjson.dumps(result, default=listing.jsonable)
    except TypeError as exc:  # (orjson's error; what `jsonable` raised is its cause)
        if isinstance(exc.__cause__, _ResultFailed):
            return False, exc.__cause__.failure
        if isinstance(exc.__cause__, ActionError):
            return False, exc.__cause__
        return False, ActionError(f"the result could not be encoded as JSON ({exc})")


def _is_pending(result: Any) -> bool:
    """Whether a handler's result is still to be awaited on the event loop: an awaitable (a
    sync-looking handler, e.g. a lambda or decorator, that returned a coroutine) or an async
    iterator (an async generator)."""
    return inspect.isawaitable(result) or isinstance(result, AsyncIterator)


def _called(call: Callable[[], Any], listing: _Listing) -> _Outcome:
    """A sync handler's outcome, in its worker thread: its result encoded, unless pending."""
    try:
        result = call()
    except BaseException as exc:  # (in a worker thread: raised again in the run's task)
        return False, exc
    return (True, result) if _is_pending(result) else _encoded(result, listing)


def _close_pending(thread_call: Future[_Outcome]) -> None:
    """Closes what a sync handler returned to a run stopped meanwhile, still to be awaited:
    dropped, a coroutine warns it was never awaited (an async generator not yet started
    holds nothing to close)."""
    if thread_call.cancelled() or thread_call.exception() is not None:
        return
    done, value = thread_call.result()
    if done and inspect.iscoroutine(value):
        value.close()


async def _in_thread(call: Callable[[], Any], listing: _Listing) -> _Outcome:
    """A sync handler's outcome, the handler run in one of the sync handlers' threads. A stop
    of the run does not wait for the thread (it cannot stop the handler, only the listing of
    its result, at the next item); what it returns is closed."""
    thread_call = _sync_handler_threads().submit(
        contextvars.copy_context().run, _called, call, listing)
    try:
        return await asyncio.wrap_future(thread_call)
    except asyncio.CancelledError:
        listing.stopped = True
        thread_call.add_done_callback(_close_pending)
        raise


async def _awaited(call: Callable[[], Any], listing: _Listing) -> _Outcome:
    try:
        result = call()
        if inspect.isawaitable(result):  # (as the TypeScript runtime's `await handler(args)`)
            result = await result
        if isinstance(result, AsyncIterator):
            result = await listing.listed_async(result)
    except BaseException as exc:
        return False, exc
    return _encoded(result, listing)


async def _in_own_task(call: Callable[[], Any], listing: _Listing) -> _Outcome:
    """An async handler's outcome, the handler run in a task of its own.

    A future whose exception is a GeneratorExit (a task that raised one) is not raised into
    the task awaiting it: asyncio throws it in at the task's top, and Python then closes every
    coroutine the task was in, inner first, each handler's answer lost. In the run's task,
    an action awaiting such a task closed the run's drive, and the client's stream was cut
    without its end. At the top of a task of its own, `_awaited` catches it. A stop of the run
    stops the handler too, and waits for it, as when it ran in the run's task."""
    task = asyncio.ensure_future(_awaited(call, listing))
    try:
        await asyncio.wait((task,))
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.wait((task,))
        raise
    return task.result()


def _result(outcome: _Outcome) -> Any:
    done, value = outcome
    if not done:
        raise value  # (a plain raise here, caught by `Action.execute`)
    return value


def _is_async(handler: Callable[..., Any]) -> bool:
    """Whether `handler` is known async before it is called: a coroutine or async generator
    function, or an object whose `__call__` is one. Any other handler returning an awaitable
    has it awaited too, once its call in a worker thread returns it."""
    return (inspect.iscoroutinefunction(handler) or inspect.isasyncgenfunction(handler)
            or inspect.iscoroutinefunction(type(handler).__call__))


class Action:
    """A tool that runs on the server.

    `handler` is called with the validated arguments as keyword arguments; it may be sync
    (run in a worker thread so it cannot block the event loop) or async, and an awaitable it
    returns is awaited. Its return value is sent to the model as JSON, encoded where the
    handler ran: a generator (any iterator) anywhere in it, or an async iterator it is, is
    listed there (up to a bound on its items, and until its run stops).
    """

    def __init__(
        self,
        name: str,
        handler: Callable[..., Any],
        *,
        description: str = "",
        parameters: Mapping[str, Any] | None = None,
    ) -> None:
        if not _NAME.match(name):
            raise ConfigurationError(
                f"Action name {name!r} must be 1-64 letters, digits, '_' or '-'")
        self.name = name
        self.description = description
        self.parameters: dict[str, Any] = dict(
            parameters or {"type": "object", "properties": {}})
        self._validator = self._schema_validator() if self._checks_schema else None
        self.handler = handler
        self._is_async = _is_async(handler)

    #: Whether a run offering more tools than its agent's `max_tools` may leave it out: an
    #: MCP server's tool is (the application's actions and the client's tools never are).
    expendable = False

    #: Whether the schema is checked (and arguments validated) with jsonschema, imported
    #: only then: an `@action`'s schema comes from pydantic, which also validates.
    _checks_schema = True

    def _schema_validator(self) -> Any:
        import jsonschema

        if not isinstance(self.parameters.get("$schema", ""), str):
            raise ConfigurationError(  # (jsonschema looks it up: a list raised TypeError)
                f"Action {self.name!r} has an invalid parameters schema: its $schema is "
                "not a string")
        try:
            validator_class = jsonschema.validators.validator_for(self.parameters)
            validator_class.check_schema(self.parameters)
        except jsonschema.SchemaError as exc:
            raise ConfigurationError(
                f"Action {self.name!r} has an invalid parameters schema: {exc.message}"
            ) from exc
        except RecursionError:
            # (a schema from elsewhere, e.g. an MCP server's, nesting `not` 150 deep: the
            # check recurses per level, and the RecursionError took its caller down)
            raise ConfigurationError(
                f"Action {self.name!r} has a parameters schema nested too deeply to check"
            ) from None
        ref = _unresolvable_ref(self.parameters, validator_class)
        if ref is not None:
            # (a schema from elsewhere, e.g. an MCP server's: refused here, the tool is left
            # out; offered, every call of it would fail, and a provider may refuse it whole)
            raise ConfigurationError(
                f"Action {self.name!r} has a parameters schema whose $ref {ref[:100]!r} "
                "cannot be resolved (references outside the schema are never fetched)")
        return validator_class(self.parameters, registry=_nothing_fetched())

    def __repr__(self) -> str:
        return f"Action(name={self.name!r})"

    def _call(self, kwargs: dict[str, Any]) -> Callable[[], Any]:
        """The handler's call with the validated arguments `kwargs`."""
        return functools.partial(self.handler, **kwargs)

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Check `arguments` against the schema; return the keyword arguments for the handler."""
        if self._validator is None:
            self._validator = self._schema_validator()
        import referencing.exceptions

        try:
            errors = sorted(self._validator.iter_errors(arguments),
                            key=lambda e: list(e.path))
        except RecursionError:
            raise ActionError("the arguments could not be checked: the tool's schema "
                              "refers to itself without end") from None
        except referencing.exceptions.Unresolvable:
            raise ActionError("the arguments could not be checked: the tool's schema has "
                              "a reference that cannot be resolved") from None
        if errors:
            raise ActionError("; ".join(_describe(e) for e in errors[:5]))
        return arguments

    async def execute(self, arguments_json: str) -> str:
        """Run the action on the model's raw argument string; return the result as JSON text.

        Raises `ActionError` with a message meant for the model.
        """
        try:
            # As every JSON a client or model sends is read: an escaped lone surrogate (a
            # string cut inside an emoji) is U+FFFD, not a refusal.
            arguments = decode_json(arguments_json or "{}")
        except orjson.JSONDecodeError as exc:
            raise ActionError(f"arguments are not valid JSON ({exc.msg})") from None
        if not isinstance(arguments, dict):
            raise ActionError("arguments must be a JSON object")
        listing = _Listing(self.name)
        try:
            # Inside: a validator of the arguments' model is the application's code too (a
            # lookup's KeyError there ended the whole run).
            call = self._call(self.validate(arguments))
            if self._is_async:
                outcome = await _in_own_task(call, listing)
            else:
                outcome = await _in_thread(call, listing)
                done, value = outcome
                if done and _is_pending(value):
                    outcome = await _in_own_task(lambda: value, listing)
            encoded: bytes = _result(outcome)
        except ActionError:
            raise
        except BaseException as exc:
            # Anything a handler raises is its failure (a CancelledError only when its run
            # is not being stopped): beyond `FAILURES_OF_CALLED_CODE`, a GeneratorExit or a
            # library's own BaseException (gevent's Timeout, func_timeout's) cut the run's
            # stream without its end, and a GeneratorExit left its thread busy for good.
            if isinstance(exc, asyncio.CancelledError):
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # the run is being stopped (else the handler's own: it awaited
                    # something another task cancelled)
            # The stack goes to the server log; the model (and the client, through the tool
            # result) gets the error's message without paths or credentials.
            _log.warning("action failed", action=self.name, exc_info=True)
            raise ActionError(failure_text(exc)) from None
        if len(encoded) > MAX_ACTION_RESULT_BYTES:
            raise _over_bound(self.name, f"{len(encoded)} bytes of JSON", size=len(encoded))
        return encoded.decode()


def _refuse_retrieval(uri: str) -> referencing.Resource[Any]:
    """No `$ref` is ever fetched: a schema from elsewhere (an MCP server's, a remote
    endpoint's) could make the runtime read its files or its network, blocking the event
    loop, and quote what it read in the tool error."""
    import referencing.exceptions

    raise referencing.exceptions.NoSuchResource(ref=uri)  # type: ignore[call-arg]


@functools.cache
def _nothing_fetched() -> referencing.Registry[Any]:
    """The registry validators resolve in (jsonschema adds its bundled meta-schemas)."""
    import referencing

    return referencing.Registry(retrieve=_refuse_retrieval)  # type: ignore[call-arg]


def _unresolvable_ref(schema: dict[str, Any], validator_class: Any) -> str | None:
    """The first `$ref` of `schema` that resolves neither within it nor to a meta-schema
    jsonschema knows, else None. Walks the schema's subschemas as the validator would."""
    import referencing.exceptions
    import referencing.jsonschema

    specification = referencing.jsonschema.specification_with(
        validator_class.ID_OF(validator_class.META_SCHEMA) or "",
        default=referencing.jsonschema.DRAFT202012)
    registry = referencing.Registry(retrieve=_known_meta_schema)  # type: ignore[call-arg]
    pending = [(schema, registry.resolver_with_root(specification.create_resource(schema)))]
    while pending:
        contents, resolver = pending.pop()
        if not isinstance(contents, dict):
            continue  # a boolean subschema
        ref = contents.get("$ref")
        if isinstance(ref, str):
            try:
                resolver.lookup(ref)
            except (referencing.exceptions.Unresolvable, ValueError):
                return ref
        for subschema in specification.subresources_of(contents):
            pending.append((subschema, resolver.in_subresource(
                specification.create_resource(subschema))))
    return None


def _known_meta_schema(uri: str) -> referencing.Resource[Any]:
    """A meta-schema of a draft jsonschema knows, from memory; any other URI is refused."""
    import jsonschema
    import referencing.jsonschema

    validator_class = jsonschema.validators.validator_for(  # (None: the stubs forbid it)
        {"$schema": uri}, default=None)  # type: ignore[arg-type]
    if validator_class is None:
        _refuse_retrieval(uri)
    return referencing.jsonschema.specification_with(uri).create_resource(
        validator_class.META_SCHEMA)


def _describe(error: jsonschema.ValidationError) -> str:
    where = "/".join(str(p) for p in error.path)
    return f"{where}: {error.message}" if where else error.message


class _ModelAction(Action):
    """An `Action` whose schema and validation come from a pydantic model of the signature."""

    _checks_schema = False

    def __init__(self, name: str, handler: Callable[..., Any], description: str,
                 model: type[pydantic.BaseModel], parameter_names: dict[str, str],
                 schema: dict[str, Any]) -> None:
        super().__init__(name, handler, description=description, parameters=schema)
        self._model = model
        self._parameter_names = parameter_names  # the model's field name -> the handler's
        self._positional = [
            param.name for param in inspect.signature(handler).parameters.values()
            if param.kind is param.POSITIONAL_ONLY]

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        try:
            parsed = self._model.model_validate(arguments)
        except pydantic.ValidationError as exc:
            problems = [f"{'/'.join(str(p) for p in err['loc']) or 'arguments'}: {_said(err)}"
                        for err in exc.errors(include_url=False)[:5]]
            raise ActionError("; ".join(problems)) from None
        return {self._parameter_names[field]: getattr(parsed, field)
                for field in type(parsed).model_fields}

    def _call(self, kwargs: dict[str, Any]) -> Callable[[], Any]:
        positional = [kwargs.pop(name) for name in self._positional]
        return functools.partial(self.handler, *positional, **kwargs)


#: The error types of a validator's ValueError and AssertionError (the application's text).
_VALIDATORS_OWN = frozenset({"value_error", "assertion_error"})


def _said(error: ErrorDetails) -> str:
    """What a failed validation says of `error` to the model and the client."""
    if error["type"] in _VALIDATORS_OWN:
        # A validator's own words: scrubbed as any failure of the application's code is
        # (`failure_text`). Pydantic's own quote the schema the model must follow (a
        # Literal's allowed paths): scrubbed, the model could not correct its call.
        return scrubbed(error["msg"])
    return error["msg"]


def _model_for(handler: Callable[..., Any]) -> tuple[type[pydantic.BaseModel], dict[str, str]]:
    """A model of `handler`'s arguments, and its field names' parameter names.

    Each field is named by its place and aliased to its parameter's name (unless the handler
    gives an alias of its own): pydantic keeps a leading-underscore name private (left out
    of the schema) and refuses names of its own (`model_dump`); the model sees the aliases.
    """
    signature = inspect.signature(handler)
    hints = inspect.get_annotations(handler, eval_str=True)
    fields: dict[str, Any] = {}
    names: dict[str, str] = {}
    for index, param in enumerate(signature.parameters.values()):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        annotation = hints.get(param.name, Any)
        default = ... if param.default is param.empty else param.default
        field = f"argument_{index}"
        fields[field] = (annotation, default)
        names[field] = param.name
    config = pydantic.ConfigDict(extra="forbid", alias_generator=names.__getitem__)
    model: type[pydantic.BaseModel] = pydantic.create_model(
        f"{handler.__name__}_arguments", __config__=config, **fields)
    return model, names


class _SchemaOfArguments(GenerateJsonSchema):
    """pydantic's JSON schema, a default JSON cannot hold (`key: bytes = b"\\xff"`, a sentinel
    object) left out of it silently: the argument is still optional and the default still
    applies, so the action works as written; refusing it would break a plain handler, and
    pydantic's warning told the developer nothing to act on (an error where warnings are)."""

    # (pydantic's documented way; its base declares it an instance attribute, not a ClassVar)
    ignored_warning_kinds: set[JsonSchemaWarningKind] = {  # noqa: RUF012
        *GenerateJsonSchema.ignored_warning_kinds, "non-serializable-default"}


@overload
def action(handler: Callable[..., Any], /) -> Action: ...
@overload
def action(
    *, name: str | None = None, description: str | None = None
) -> Callable[[Callable[..., Any]], Action]: ...


def action(
    handler: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
) -> Action | Callable[[Callable[..., Any]], Action]:
    """Turn a function into an `Action`, its JSON schema derived from its type hints.

    The description defaults to the docstring. Use as `@action` or `@action(name=...)`.
    """

    def build(fn: Callable[..., Any]) -> Action:
        try:
            model, parameter_names = _model_for(fn)
            # (made here: a type pydantic validates but has no JSON schema for, a
            # Callable, raises only now)
            schema = model.model_json_schema(schema_generator=_SchemaOfArguments)
        except (pydantic.PydanticUserError, NameError, TypeError) as exc:
            raise ConfigurationError(
                f"Cannot derive a schema for action {fn.__name__!r}: {exc}") from exc
        schema.pop("title", None)
        doc = inspect.getdoc(fn) or ""
        return _ModelAction(name or fn.__name__, fn, description or doc, model, parameter_names,
                            schema)

    if handler is not None:
        return build(handler)
    return build
