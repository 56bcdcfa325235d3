"""Actions, MCP tools and a LangGraph Platform deployment that fail in hostile ways cannot end
the server, leak what their failures hold, or leave a run without a precise error.

A server-side action whose handler calls `sys.exit` (directly, or through argparse's
`parser.error`) is a tool error, and the server goes on serving (it ended the process: the
handler runs in a child process here, as the server would). An action's failure reaches the
model and the client without the file paths and URL credentials its message held, without a
stack trace, and cut; a result over 1 MiB of JSON is a tool error naming the bound, not a
stream that carries it whole. An MCP tool's own crash report is withheld (a plain error text
is passed on). A LangGraph Platform deployment's `error` event, and a stream event that is not
a LangChain stream event or not JSON at all, end the run with one RUN_ERROR (UPSTREAM_ERROR)
that says so, and the thread is still readable, the next run still served.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any, Literal

import aiohttp
import orjson
import pydantic
import pytest
from aiohttp import web
from mcp.server.mcpserver import MCPServer as SDKServer
from mcp.server.mcpserver.exceptions import ToolError

import copilot_runtime
from copilot_runtime import ActionError, CopilotRuntime, MCPServer, action
from copilot_runtime._exceptions import failure_text, scrub_secrets
from copilot_runtime.agents.langgraph_platform import LangGraphPlatformAgent, platform_thread_id
from copilot_runtime.testing import ScriptedAdapter, text_turn, tool_turn, verify_events
from copilot_runtime.testing.loopback import LoopbackServer
from tests.conftest import (
    Served,
    ServeRuntime,
    free_port,
    parse_sse,
    run_input,
    serve,
    text_of,
    types,
)

pytestmark = pytest.mark.timeout(60)

Json = dict[str, Any]
MIB = 1024 * 1024  # copilot_runtime.actions.MAX_ACTION_RESULT_BYTES (not in the old code)
# What a crash report shows, and what no client (and no model) may read.
_INTERNALS = ("Traceback", 'File "', ".py")


def tool_results(events: list[Json]) -> dict[str, Json]:
    """The TOOL_CALL_RESULT events of a stream, by tool call id."""
    return {e["toolCallId"]: e for e in events if e["type"] == "TOOL_CALL_RESULT"}


def tool_errors(events: list[Json]) -> dict[str, str]:
    """The tool errors of a stream, as the client reads them, by tool call id (each of its
    tool results must be one)."""
    errors: dict[str, str] = {}
    for call, result in tool_results(events).items():
        content = orjson.loads(result["content"])
        error = content.get("error") if isinstance(content, dict) else None
        assert isinstance(error, str), f"{call} is not a tool error: {result['content'][:200]}"
        errors[call] = error
    return errors


def sent_to_model(model: ScriptedAdapter) -> list[str]:
    """The tool results the model was sent (in its requests after the first)."""
    return [str(message.content) for request in model.requests[1:]
            for message in request.messages if message.role == "tool"]


async def get_json(served: Served, path: str) -> Any:
    response = await served.session.get(served.url + path)
    assert response.status == 200, (path, await response.text())
    return await response.json()


# ---- an action that ends the program (a server in a child process) --------------------------

_CHILD = '''
import argparse, asyncio, socket, sys

import uvicorn

from copilot_runtime import CopilotRuntime, action, create_app
from copilot_runtime.testing import ScriptedAdapter, text_turn, tool_turn


@action
async def quit_now() -> str:
    """Ends the program, as a script does."""
    sys.exit(2)


@action
def parse_flags(flags: str) -> str:
    """Parses command-line flags (a sync handler: runs in a worker thread)."""
    parser = argparse.ArgumentParser(prog="flags")
    parser.add_argument("--n", type=int)
    return str(parser.parse_args(flags.split()))  # a bad flag: parser.error, sys.exit(2)


class ExitsMidAnswer:
    """A model whose first answer ends the program halfway (a library calling sys.exit)."""
    provider = "exits"

    def __init__(self):
        self.answers = 0

    async def aclose(self):
        pass

    async def stream(self, request):
        from copilot_runtime.adapters.base import StreamEnd, TextDelta
        self.answers += 1
        yield [TextDelta("partial ")]
        if self.answers == 1:
            sys.exit(2)
        yield [TextDelta("whole")]
        yield [StreamEnd("stop")]


class ParsesFlags:
    """An existing agent that parses flags it was not given (argparse exits)."""

    async def execute_with_events(self, context):
        yield {"event": "agent_started", "data": {}}
        parse_flags.handler("--n notanumber")
        yield {"event": "agent_completed", "data": {"output": "parsed"}}


async def exits_after_the_run(run):
    sys.exit(3)


def runtime_of(case):
    if case == "model":
        return CopilotRuntime(service_adapter=ExitsMidAnswer())
    if case == "existing agent":
        from langgraph.checkpoint.memory import InMemorySaver
        from copilot_runtime.workflows.existing import existing_agent
        return CopilotRuntime(agents={"default": existing_agent(
            ParsesFlags(), name="flags", checkpointer=InMemorySaver())})
    if case == "hook":
        return CopilotRuntime(service_adapter=ScriptedAdapter(text_turn("done")),
                              on_run_finished=exits_after_the_run)
    calls = {"sys.exit": ("quit_now", "{}"),
             "argparse": ("parse_flags", '{"flags": "--n notanumber"}')}
    model = ScriptedAdapter(tool_turn(calls[case]), text_turn("done"))
    return CopilotRuntime(service_adapter=model, actions=[quit_now, parse_flags])


port, case = int(sys.argv[1]), sys.argv[2]
runtime = runtime_of(case)
server = uvicorn.Server(uvicorn.Config(create_app(runtime, "/api"), log_level="critical",
                                       lifespan="on"))
listener = socket.socket()
listener.bind(("127.0.0.1", port))
listener.listen(16)  # connections wait in the backlog until uvicorn accepts them
print("ready", flush=True)
asyncio.run(server.serve(sockets=[listener]))
'''


# Where the package this test imports lives: the child imports the same one.
_PACKAGE_ROOT = str(Path(copilot_runtime.__file__).resolve().parents[1])


@contextlib.asynccontextmanager
async def child_runtime(case: str, workdir: Path
                        ) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    """A runtime whose scripted model calls the action of `case`, served by uvicorn in a
    child process (the package this test imports), and the URL it is served at."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": _PACKAGE_ROOT, "PYTHONDONTWRITEBYTECODE": "1"}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CHILD, str(port), case, cwd=workdir, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        assert child.stdout is not None
        line = await child.stdout.readline()
        assert line == b"ready\n", line + await child.stdout.read()
        yield f"http://127.0.0.1:{port}/api", child
    finally:
        if child.returncode is None:
            child.terminate()
        await child.communicate()


@pytest.mark.parametrize("case", ["sys.exit", "argparse"])
async def test_action_that_exits_is_a_tool_error_and_the_server_lives_on(
        case: str, tmp_path: Path) -> None:
    """A handler raising SystemExit (`sys.exit(2)`; argparse's `parser.error` on a bad flag)
    escaped `Action.execute` (it catches `Exception`), then the event loop: the run's stream
    broke off and the server process exited with status 2, every user's run with it. Now
    the model reads "SystemExit: 2" as the tool's error, the run finishes, and `/info`
    still answers."""
    async with child_runtime(case, tmp_path) as (url, child), aiohttp.ClientSession() as session:
        try:
            response = await session.post(
                url + "/agent/default/run", data=orjson.dumps(run_input("go", thread=f"t-{case}")),
                headers={"Content-Type": "application/json"})
            assert response.status == 200, await response.text()
            body = await response.read()
        except aiohttp.ClientError as exc:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(child.wait(), 10)
            pytest.fail(f"the run's stream broke off ({type(exc).__name__}); the server's "
                        f"exit status: {child.returncode}")
        info = await session.get(url + "/info")
        assert info.status == 200
        await info.read()
        assert child.returncode is None
    events = parse_sse(body)
    verify_events(events)
    assert types(events)[-1] == "RUN_FINISHED", events[-1]
    (result,) = tool_results(events).values()
    assert orjson.loads(result["content"]) == {"error": "SystemExit: 2"}
    assert text_of(events) == "done"


@pytest.mark.parametrize("case", ["model", "existing agent", "hook"])
async def test_other_code_that_exits_fails_alone_and_the_server_lives_on(
        case: str, tmp_path: Path) -> None:
    """SystemExit from the other code the runtime calls ended the process as an action's did:
    a model (an agent) halfway through its answer cut the stream and stored a run without its
    end (every later replay of the thread broke); an existing agent wrapped as a workflow
    (argparse's `parser.error` in its LangGraph node) and an `on_run_finished` hook (a task of
    its own) stopped the event loop, every user's run with it. Now each is that code's
    failure: the run ends with a RUN_ERROR (or the workflow says the agent failed), the thread
    replays whole, and the server goes on serving."""
    async with child_runtime(case, tmp_path) as (url, child), aiohttp.ClientSession() as session:
        async def run(thread: str, run_id: str) -> list[Json]:
            try:
                response = await session.post(
                    url + "/agent/default/run",
                    data=orjson.dumps(run_input("go", thread=thread, run=run_id)),
                    headers={"Content-Type": "application/json"})
                assert response.status == 200, await response.text()
                return parse_sse(await response.read())
            except aiohttp.ClientError as exc:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(child.wait(), 10)
                pytest.fail(f"the run's stream broke off ({type(exc).__name__}); the server's "
                            f"exit status: {child.returncode}")

        events = await run("t", "r1")
        verify_events(events)
        if case == "model":
            assert types(events)[-1] == "RUN_ERROR", events[-1]
            assert events[-1]["code"] == "AGENT_ERROR"
            assert text_of(events) == "partial "
            again = await run("t", "r2")
            assert text_of(again) == "partial whole"
        elif case == "existing agent":
            assert types(events)[-1] == "RUN_FINISHED", events[-1]
            assert "flags failed (SystemExit)" in text_of(events)
        await asyncio.sleep(0.2)  # a hook runs after the run's end
        connect = await session.post(
            url + "/agent/default/connect", data=orjson.dumps(run_input("", thread="t")),
            headers={"Content-Type": "application/json"})
        replayed = parse_sse(await connect.read())
        verify_events(replayed)
        info = await session.get(url + "/info")
        assert info.status == 200
        await info.read()
        assert child.returncode is None


async def test_keyboard_interrupt_from_a_handler_is_a_tool_error() -> None:
    """KeyboardInterrupt raised by a handler (async, or sync in its worker thread) escaped
    `Action.execute` as SystemExit did; now it is the tool's error."""
    @action
    async def interrupted() -> str:
        """Interrupted."""
        raise KeyboardInterrupt("stop")

    @action
    def interrupted_in_a_thread() -> str:
        """Interrupted in its worker thread."""
        raise KeyboardInterrupt

    said: list[str] = []
    for handler in (interrupted, interrupted_in_a_thread):
        try:
            with pytest.raises(ActionError) as caught:
                await handler.execute("{}")
        except KeyboardInterrupt:
            pytest.fail(f"KeyboardInterrupt escaped the action {handler.name}")
        said.append(str(caught.value))
    assert said == ["KeyboardInterrupt: stop", "KeyboardInterrupt"]


async def test_a_handlers_own_cancellation_or_unprintable_error_is_a_tool_error(
        serve_runtime: ServeRuntime) -> None:
    """A handler that awaited something another task cancelled raised CancelledError, which
    ended the run as if the server shut down it (RUN_INTERRUPTED); one whose exception
    could not be printed (its `__str__` raised) ended it AGENT_ERROR. Each is the tool's
    error now, and the model answers; a stop still stops a handler at work."""
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise TypeError("no words")

    @action
    async def waits_on_a_lookup() -> str:
        """Waits for a lookup another task gives up on."""
        lookup: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(lookup.cancel)
        return await lookup

    @action
    async def unprintable() -> str:
        """Fails with an exception that cannot say what it is."""
        raise Unprintable

    working = asyncio.Event()

    @action
    async def works_long() -> str:
        """Works for a minute."""
        working.set()
        await asyncio.sleep(60)
        return "worked"

    model = ScriptedAdapter(tool_turn(("waits_on_a_lookup", "{}")), text_turn("first done"),
                            tool_turn(("unprintable", "{}")), text_turn("second done"),
                            tool_turn(("works_long", "{}")))
    runtime = CopilotRuntime(service_adapter=model,
                             actions=[waits_on_a_lookup, unprintable, works_long])
    async with serve_runtime(runtime) as served:
        said = []
        for thread in ("cancelled", "unprintable"):
            events = await served.run(run_input("go", thread=thread))
            verify_events(events)
            assert types(events)[-1] == "RUN_FINISHED", events[-1]
            (result,) = tool_results(events).values()
            said.append(orjson.loads(result["content"]))
        running = asyncio.ensure_future(served.run(run_input("go", thread="stopped")))
        async with asyncio.timeout(10):
            await working.wait()
            stop = await served.post("/agent/default/stop/stopped", {})
            assert (await stop.json())["stopped"] is True
            events = await running
    assert said == [{"error": "CancelledError"}, {"error": "Unprintable"}]
    verify_events(events)
    assert types(events)[-1] == "RUN_FINISHED"
    assert not tool_results(events)  # stopped at work, not answered

# ---- what an action's failure says ------------------------------------------------------------

_MISSING = "/nonexistent-copilot-test/app/config/prod-secrets.yaml"


@action
async def connect_db() -> str:
    """Queries the database."""
    raise ConnectionError("could not connect to postgresql://admin:S3cr3t@10.0.0.5:5432/prod "
                          "(settings in /srv/app/config/db.yaml)")


@action
def read_config() -> str:
    """Reads the configuration."""
    return Path(_MISSING).read_text()


@action
async def crash() -> str:
    """Fails with a stack trace in its message."""
    raise RuntimeError('worker crashed:\nTraceback (most recent call last):\n  File '
                       '"/srv/app/worker.py", line 12, in run\n    raise ValueError("boom")\n'
                       "ValueError: boom")


@action
async def verbose() -> str:
    """Fails with a long message."""
    raise ValueError("x" * 5000)


@action
async def huge() -> str:
    """Returns 2 MiB of text."""
    return "z" * (2 * MIB)


def scripted_runtime(*calls: tuple[str, str]) -> tuple[CopilotRuntime, ScriptedAdapter]:
    """A runtime whose model calls `calls` in one turn, then says "done"."""
    model = ScriptedAdapter(tool_turn(*calls), text_turn("done"))
    return CopilotRuntime(service_adapter=model,
                          actions=[connect_db, read_config, crash, verbose, huge]), model


async def test_action_failure_loses_file_paths_and_url_credentials(
        serve_runtime: ServeRuntime) -> None:
    """An action's exception went to the model and, in TOOL_CALL_RESULT, to the client as
    it was: a FileNotFoundError with the file's path, a ConnectionError with the database
    URL's user and password. Now both are blanked, in the stream, in what the model is
    sent and in the thread's stored events; the rest of the message is kept."""
    runtime, model = scripted_runtime(("connect_db", "{}"), ("read_config", "{}"))
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("go", thread="t-leaky"))
        stored = await get_json(served, "/threads/t-leaky/events")
    verify_events(events)
    assert types(events)[-1] == "RUN_FINISHED"
    expected = {
        "call_0": "ConnectionError: could not connect to postgresql://[REDACTED]@"
                  "10.0.0.5:5432/prod (settings in <path>)",
        "call_1": "FileNotFoundError: [Errno 2] No such file or directory: '<path>'"}
    assert tool_errors(events) == expected
    assert sorted(sent_to_model(model)) == sorted(
        orjson.dumps({"error": error}).decode() for error in expected.values())
    for where in (orjson.dumps(events).decode(), orjson.dumps(stored).decode(),
                  "\n".join(sent_to_model(model))):
        for secret in ("S3cr3t", "admin", "/srv/", "prod-secrets", "nonexistent-copilot"):
            assert secret not in where


@action
async def query_db() -> str:
    """Queries the database with a libpq keyword DSN."""
    raise ConnectionError("connection to server failed: host=db.internal user=app "
                          "password=Sup3rS3cretPw dbname=prod")


@action
async def call_api() -> str:
    """Calls an API with a client configured from a dict."""
    raise RuntimeError("bad client config {'base_url': 'https://api.example', "
                       "'api_key': 'c0ffee0123456789abcdef', 'timeout': 30}")


@action
async def fetch() -> str:
    """Fetches a page with a token scheme."""
    raise PermissionError("403 for headers Authorization: Token c0ffee0123456789abcdef")


async def test_action_failure_loses_credentials_given_by_name(
        serve_runtime: ServeRuntime) -> None:
    """A libpq `password=`, a dict repr's `'api_key': '…'` and an `Authorization: Token …`
    went whole to the model and the client, while the log redactor hid the first two: the
    client's scrub now has the log's `name=value` rule (one pattern for both)."""
    model = ScriptedAdapter(tool_turn(("query_db", "{}"), ("call_api", "{}"), ("fetch", "{}")),
                            text_turn("done"))
    runtime = CopilotRuntime(service_adapter=model, actions=[query_db, call_api, fetch])
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("go", thread="t-named"))
        stored = await get_json(served, "/threads/t-named/events")
    assert tool_errors(events) == {
        "call_0": "ConnectionError: connection to server failed: host=db.internal user=app "
                  "[REDACTED] dbname=prod",
        "call_1": "RuntimeError: bad client config {'base_url': 'https://api.example', "
                  "'[REDACTED]', 'timeout': 30}",
        "call_2": "PermissionError: 403 for headers [REDACTED]"}
    for where in (orjson.dumps(events).decode(), orjson.dumps(stored).decode(),
                  "\n".join(sent_to_model(model))):
        for secret in ("Sup3rS3cretPw", "c0ffee0123456789abcdef"):
            assert secret not in where


@pytest.mark.parametrize(("text", "scrubbed"), [
    ("cannot reach redis://:p@ss@cache:6379/0", "cannot reach redis://[REDACTED]@cache:6379/0"),
    ("postgresql://app:w@rd@db.internal:5432/prod failed",
     "postgresql://[REDACTED]@db.internal:5432/prod failed"),
    ("see https://docs.example/a@b and https://u:pw@h/x",
     "see https://docs.example/a@b and https://[REDACTED]@h/x"),
])
def test_a_urls_password_with_an_at_sign_is_blanked_whole(text: str, scrubbed: str) -> None:
    """URL parsers split a URL's credentials at the last `@` before the host: the password
    of `redis://:p@ss@cache` is `p@ss`, whose `ss` a client was told (the blanking stopped
    at the first `@`)."""
    assert scrub_secrets(text) == scrubbed


_PEM_BODY = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7"


@pytest.mark.parametrize(("text", "scrubbed"), [
    (f"-----BEGIN PRIVATE KEY-----\n{_PEM_BODY}\n-----END PRIVATE KEY-----\ndone",
     "[REDACTED]\ndone"),
    (f'{{"type": "service_account", "private_key": "-----BEGIN RSA PRIVATE KEY-----\\n'
     f'{_PEM_BODY}\\n-----END RSA PRIVATE KEY-----\\n", "client_email": "x@y"}}',
     '{"type": "service_account", "[REDACTED]", "client_email": "x@y"}'),
    (f"key file cut: -----BEGIN EC PRIVATE KEY-----\n{_PEM_BODY[:30]}",
     "key file cut: [REDACTED]"),
    ("connection failed: host=db user=app password='correct horse battery' dbname=app",
     "connection failed: host=db user=app [REDACTED] dbname=app"),
    ('{"password": "correct horse battery", "user": "app"}',
     '{"[REDACTED]", "user": "app"}'),
    ("token rejected: github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz",
     "token rejected: [REDACTED]"),
    ("401 for hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345", "401 for [REDACTED]"),
    ("invalid_auth xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx",
     "invalid_auth [REDACTED]"),
])
def test_private_keys_quoted_passwords_and_more_tokens_are_blanked(
        text: str, scrubbed: str) -> None:
    """A PEM private key kept its base64 body (only `-----BEGIN` was blanked, as the value
    of `private_key`); a quoted libpq password lost its first word only (`horse battery'`
    stayed); GitHub fine-grained, Hugging Face and Slack tokens went whole. Now each is
    blanked whole."""
    assert scrub_secrets(text) == scrubbed


@pytest.mark.parametrize(("text", "scrubbed"), [
    ("settings: SECRET_KEY=django-insecure-abc123xyz", "settings: [REDACTED]"),
    ("JWT_SECRET_KEY=abcdefgh12345 DEBUG=1", "[REDACTED] DEBUG=1"),
    ("GET https://b.s3.amazonaws.com/o?X-Amz-Date=20261128&X-Amz-Signature=abcdef012345"
     "&X-Amz-Security-Token=IQoJb3JpZ2luX2Vj", "GET https://b.s3.amazonaws.com/o?"
     "X-Amz-Date=20261128&[REDACTED]&[REDACTED]"),
    ("https://storage.googleapis.com/b/o?X-Goog-Signature=0a1b2c3d4e5f",
     "https://storage.googleapis.com/b/o?[REDACTED]"),
    ('duplicate key value violates unique constraint "sessions_token_key"\n'
     "DETAIL:  Key (token)=(a1b2c3d4e5f6) already exists.",
     'duplicate key value violates unique constraint "sessions_token_key"\n'
     "DETAIL:  Key ([REDACTED]) already exists."),
    ("DETAIL:  Key (user_id, api_key)=(42, k9876543210) already exists.",
     "DETAIL:  Key ([REDACTED]) already exists."),
    # (review: an expression index, a value holding `) `, Rails' name)
    ("DETAIL:  Key (lower(token))=(a1b2c3d4e5f6) already exists.",
     "DETAIL:  Key ([REDACTED]) already exists."),
    ("DETAIL:  Key (token)=(abc) def123) already exists.",
     "DETAIL:  Key ([REDACTED]) already exists."),
    ("DETAIL:  Key (token)=(a1b2c3d4e5f6", "DETAIL:  Key ([REDACTED]"),
    ("SECRET_KEY_BASE=abcdef0123456789", "[REDACTED]"),
])
def test_secret_keys_signed_urls_and_unique_violations_are_blanked(
        text: str, scrubbed: str) -> None:
    """Before: a settings dump's `SECRET_KEY=…` (`secret` then `_KEY`), a signed URL's
    `X-Amz-Signature` and `X-Amz-Security-Token`, and the key PostgreSQL names in a unique
    violation's DETAIL were left in clear."""
    assert scrub_secrets(text) == scrubbed


@pytest.mark.parametrize("text", [
    "DETAIL:  Key (email)=(bob@example.com) already exists.", "?page=2&sort_key=name",
    "the secret key was rotated", 'DETAIL:  Key (token_count)=(5) is not present in table "t".',
    "GET /items?page_token=2&include_signature=true",
])
def test_other_keys_and_parameters_are_kept(text: str) -> None:
    assert scrub_secrets(text) == text


@pytest.mark.parametrize("text", [
    "Key (" + "token " * 43_000, "Key (" + "x" * 256_000, "Key (token)=(" + "a) " * 85_000,
    "Key (" + "token)=(" * 32_000, "?" + "a_" * 128_000 + "token=",
    # (a review: each `Key (` read up to 4000 characters again: 2.8 s for 128 kB)
    "Key (token)=(" * 20_000, "Key (token)=(x) " * 16_000,
    # (a review: a run of blanks was read again from each position: 9 s for 32 kB)
    "Key (token)=(x" + " " * 64_000 + "y", "Key (token)=(x" + "\t" * 64_000 + "y",
    "eyJ-" * 32_000,  # (a review: a JWT without its dot, quadratic before)
])
def test_scrubbing_takes_linear_time(text: str) -> None:
    """Before (a review): a `Key (` without its `)=(` took time quadratic in the text's
    length (4.3 s of CPU for 128 kB; a tool's error message is scrubbed on the event loop)."""
    started = time.process_time()
    scrub_secrets(text)
    assert time.process_time() - started < 2.0


@pytest.mark.parametrize("said", [
    'password: "must contain a digit and a letter"',
    "credentials: 'not configured for this project'",
    "tool said: secret: 'the meeting is at noon' ok",
    "Summary of the token: 'abc def ghi jkl'",
])
def test_quoted_words_after_a_secret_sounding_label_are_kept(said: str) -> None:
    """Before: any quoted text after a label such as `password:` was blanked whole and its
    closing quote left behind (`ValueError: [REDACTED]"`), in the error texts the model and
    the user read. Now a quoted value is taken whole only where it is one for sure (a DSN's
    `password='…'`, a mapping's `"password": "…"`): a label's first word alone, as before."""
    assert scrub_secrets(said) == said
    assert failure_text(ValueError(said)) == f"ValueError: {said}"


@pytest.mark.parametrize(("text", "scrubbed"), [
    ("host=db password='correct horse battery' dbname=app", "host=db [REDACTED] dbname=app"),
    ('connect(password="correct horse battery")', "connect([REDACTED])"),
    ("password = 'correct horse battery staple'", "[REDACTED]"),
    ("{'db': 'x', 'password': 'correct horse battery'}", "{'db': 'x', '[REDACTED]'}"),
    ('{\n  "token": "expired or revoked by the admin"\n}', '{\n  "[REDACTED]"\n}'),
    ("password='correct horse batt", "[REDACTED]"),  # cut before its closing quote
    # A label's quoted text is no mapping: its first word alone, as before.
    ("Field 'password': 'String should have at least 8 characters'",
     "Field '[REDACTED] should have at least 8 characters'"),
])
def test_a_quoted_value_is_blanked_whole_where_it_is_a_value_for_sure(
        text: str, scrubbed: str) -> None:
    """Before: a DSN's quoted password left its closing quote behind (`[REDACTED]' dbname`).
    Now the value goes with both its quotes; a mapping's keeps the one that closes its key's."""
    assert scrub_secrets(text) == scrubbed


@pytest.mark.parametrize(("text", "scrubbed"), [
    (r"connection failed: host=db password='it\'s a long secret' dbname=app",
     "connection failed: host=db [REDACTED] dbname=app"),
    (r"password='Tr0ub4dor\'s horse battery' dbname=app", "[REDACTED] dbname=app"),
    (r"password='a\\b\'c d e f' x", "[REDACTED] x"),
])
def test_a_single_quoted_value_with_escaped_quotes_is_blanked_whole(
        text: str, scrubbed: str) -> None:
    """Before: libpq's `\\'` in a single-quoted password ended the match (the whole value
    in clear, or its tail after the escaped quote). Now escapes are read as libpq reads them."""
    assert scrub_secrets(text) == scrubbed


@pytest.mark.parametrize("text", [
    "Expected format: -----BEGIN PRIVATE KEY-----\nthen base64 then END. Contact support, "
    "please.",
    "-----BEGIN PRIVATE KEY----- header expected, found garbage at line 3: see docs (x)",
    "Expected -----BEGIN PRIVATE KEY----- then the key",
])
def test_a_pem_header_in_prose_keeps_the_prose(text: str) -> None:
    """Before: a PEM header without its END line blanked all the text after it, as if the
    key had been cut there. Now only a base64 body that runs to the text's end is a cut key."""
    assert scrub_secrets(text) == text


@pytest.mark.parametrize("text", [
    "the token expired", "Invalid password for user bob", "password: must be 8 characters",
    "max_tokens=100 is too large", "max_tokens: 5000000", "max_token=100000",
    "prompt_tokens: 12, completion_tokens: 30", "token limit exceeded: 5000 > 4096",
    "authorization failed for this user", "Secret Manager: access denied", "secret=42",
    "auth failed: invalid_auth", "----- BEGIN REPORT -----", "-----BEGIN PUBLIC KEY-----",
    "hf_hub_download failed", "the xoxo token", "password='123456789'", "github_pat_ is a "
    "prefix", "the private key was rotated",
])
def test_ordinary_words_about_secrets_are_kept(text: str) -> None:
    assert scrub_secrets(text) == text


async def test_action_failure_with_a_stack_trace_is_withheld_and_a_long_one_cut(
        serve_runtime: ServeRuntime) -> None:
    """An exception whose message held a Python stack trace (a worker's crash report) was
    passed on whole, source paths and all, and a 5000-character message went whole to the
    model and the client. Now the first is withheld to its type, the second cut to 300
    characters."""
    runtime, model = scripted_runtime(("crash", "{}"), ("verbose", "{}"))
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("go", thread="t-crash"))
    verify_events(events)
    assert types(events)[-1] == "RUN_FINISHED"
    errors = tool_errors(events)
    assert errors["call_0"] == "RuntimeError (its message is withheld: see the server's log)"
    assert errors["call_1"] == "ValueError: " + "x" * 287 + "…"
    for where in (orjson.dumps(events).decode(), "\n".join(sent_to_model(model))):
        assert not [marker for marker in _INTERNALS if marker in where], where
        assert "boom" not in where


async def test_action_result_over_a_mebibyte_is_a_tool_error(
        serve_runtime: ServeRuntime) -> None:
    """A result of any size was streamed whole to the client (a 30 MB result made a 30 MB
    stream) and sent whole to the model in the next request. Now a result over 1 MiB of
    JSON is a tool error that names the bound; one of 1 MiB exactly is kept whole."""
    runtime, model = scripted_runtime(("huge", "{}"))
    async with serve_runtime(runtime) as served:
        response = await served.post("/agent/default/run", run_input("go", thread="t-huge"))
        assert response.status == 200
        body = await response.read()
    assert len(body) < 16 * 1024, f"the stream carried {len(body)} bytes"
    assert sum(len(sent) for sent in sent_to_model(model)) < 1024
    events = parse_sse(body)
    verify_events(events)
    assert types(events)[-1] == "RUN_FINISHED"
    assert tool_errors(events) == {
        "call_0": f"the result ({2 * MIB + 2} bytes of JSON) is larger than {MIB} bytes"}
    assert text_of(events) == "done"

    @action
    async def just_fits() -> str:
        """Returns 1 MiB of JSON exactly."""
        return "y" * (MIB - 2)

    assert len(await just_fits.execute("{}")) == MIB


# ---- an MCP tool's error text ----------------------------------------------------------------

_CRASH_REPORT = ('Traceback (most recent call last):\n  File "/opt/mcp/server.py", line 12, in '
                 'handler\n    token = "sk-live-abcdef123456"\nKeyError: x')


def failing_mcp_server() -> SDKServer:
    """`crash_report` fails with the server's stack trace; `quota`, with a plain message."""
    server = SDKServer("hostile")

    @server.tool()
    def crash_report() -> str:
        """Fails with a crash report."""
        raise ToolError(_CRASH_REPORT)

    @server.tool()
    def quota() -> str:
        """Fails with a plain message."""
        raise ToolError("quota exceeded for today")

    return server


async def test_mcp_tools_crash_report_is_withheld_a_plain_error_passed_on(
        serve_runtime: ServeRuntime) -> None:
    """An MCP tool's error text (`isError`) went to the model and the client whole: the
    server's stack trace, its source path, the token in it. Now text that holds a stack
    trace or a source path is withheld ("the MCP tool ... reported an error"); a plain
    error text is still passed on as the server wrote it."""
    model = ScriptedAdapter(tool_turn(("crash_report", "{}"), ("quota", "{}")),
                            text_turn("done"))
    async with serve(failing_mcp_server().streamable_http_app()) as url:
        runtime = CopilotRuntime(service_adapter=model, mcp_servers=[
            MCPServer(url=url + "/mcp", name="hostile", timeout=10)])
        async with serve_runtime(runtime) as served:
            events = await served.run(run_input("go", thread="t-mcp"))
    verify_events(events)
    assert types(events)[-1] == "RUN_FINISHED"
    assert tool_errors(events) == {
        "call_0": "the MCP tool crash_report reported an error",
        "call_1": "Error executing tool quota: quota exceeded for today"}
    for where in (orjson.dumps(events).decode(), "\n".join(sent_to_model(model))):
        assert not [marker for marker in (*_INTERNALS, "sk-live") if marker in where], where


# ---- a LangGraph Platform deployment's failures and malformed events --------------------------

_ASSISTANT = str(uuid.UUID(int=7))
_SCHEMA: Json = {"type": "object", "properties": {"messages": {}}}


def sse(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def chain_event(kind: str, data: Json | None = None) -> Json:
    return {"event": kind, "name": "LangGraph", "run_id": "r-graph", "tags": [],
            "metadata": {"langgraph_node": "agent"}, "data": data or {}, "parent_ids": []}


_GRAPH_FAILED = "The graph failed on the LangGraph Platform"
_NOT_AN_EVENT = "The LangGraph Platform sent an event that is not a LangChain stream event"
_NOT_JSON = "The LangGraph Platform sent an event that is not JSON"

# name -> (what the platform sends after the run's start, the RUN_ERROR's message)
PLATFORM: dict[str, tuple[bytes, str]] = {
    "error-with-a-path": (sse("error", {"error": "/srv/graph/secret_module.py:12 KeyError",
                                        "message": "Traceback ... token=sk-live-123"}),
                          _GRAPH_FAILED),
    "error-huge": (sse("error", {"error": "E" * 100_000, "message": "m"}),
                   f"{_GRAPH_FAILED} ({'E' * 79}…)"),
    "error-plain": (sse("error", {"error": "RateLimitError", "message": "m"}),
                    f"{_GRAPH_FAILED} (RateLimitError)"),
    "data-a-list": (sse("events", [1, 2, 3]), _NOT_AN_EVENT),
    "data-a-string": (sse("events", "just a string"), _NOT_AN_EVENT),
    "data-without-event": (sse("events", {"name": "x", "data": {}}), _NOT_AN_EVENT),
    "event-not-a-string": (sse("events", {**chain_event("on_chain_stream"), "event": 5}),
                           _NOT_AN_EVENT),
    # Fields of the wrong kind failed the translation: AGENT_ERROR, "failed unexpectedly".
    "metadata-a-list": (sse("events", {**chain_event("on_chain_stream"), "metadata": [1]}),
                        f"{_NOT_AN_EVENT} (its 'metadata' is not an object)"),
    "data-of-a-string": (sse("events", {**chain_event("on_chain_end"), "data": "str"}),
                         f"{_NOT_AN_EVENT} (its 'data' is not an object)"),
    "not-json": (b"event: events\ndata: {not json at all\n\n", _NOT_JSON),
    "error-not-json": (b"event: error\ndata: plain text error with /etc/passwd\n\n", _NOT_JSON),
}


class FakeDeployment(LoopbackServer):
    """A LangGraph Platform deployment of one graph, as far as the runtime calls it. A run
    on a platform thread marked in `modes` sends `PLATFORM[mode]`; any other run answers
    "fine"."""

    def __init__(self) -> None:
        super().__init__()
        self.modes: dict[str, str] = {}

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/assistants/search", self._search)
        app.router.add_get("/assistants/{assistant}/schemas", self._schemas)
        app.router.add_get("/threads/{thread}/state", self._state)
        app.router.add_post("/threads/{thread}/state", self._state)
        app.router.add_post("/threads/{thread}/history", self._history)
        app.router.add_post("/threads", self._thread)
        app.router.add_post("/threads/{thread}/runs/stream", self._stream)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _search(self, request: web.Request) -> web.Response:
        return web.json_response([{"assistant_id": _ASSISTANT, "graph_id": "g", "name": "g"}])

    async def _schemas(self, request: web.Request) -> web.Response:
        return web.json_response({"input_schema": _SCHEMA, "output_schema": _SCHEMA,
                                  "state_schema": _SCHEMA, "config_schema": {}})

    async def _state(self, request: web.Request) -> web.Response:
        return web.json_response({"values": {"messages": []}, "next": [], "tasks": [],
                                  "checkpoint": {"checkpoint_id": "c1", "checkpoint_ns": ""},
                                  "metadata": {}, "created_at": None})

    async def _history(self, request: web.Request) -> web.Response:
        return web.json_response([])

    async def _thread(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"thread_id": body.get("thread_id") or str(uuid.uuid4())})

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sse("metadata", {"run_id": str(uuid.uuid4())}))
        await response.write(sse("events", chain_event("on_chain_start")))
        mode = self.modes.get(request.match_info["thread"])
        if mode is not None:
            await response.write(PLATFORM[mode][0])
        else:
            await response.write(sse("events", chain_event("on_chain_end")))
        await response.write_eof()
        return response


@pytest.fixture
async def deployment() -> AsyncIterator[FakeDeployment]:
    async with FakeDeployment() as server:
        yield server


@pytest.mark.parametrize("name", list(PLATFORM))
async def test_platform_error_or_malformed_event_is_an_upstream_error(
        name: str, deployment: FakeDeployment, serve_runtime: ServeRuntime) -> None:
    """The platform's `error` event became a RUN_ERROR without a code whose message held
    the platform's `error` field whole (a source path; 100 KB); event data that is not a
    LangChain stream event (a list, a string, no string `event`) and a frame that is not
    JSON failed the run as "Agent 'p' failed unexpectedly" (AGENT_ERROR). Now each is one
    RUN_ERROR, UPSTREAM_ERROR, that says what the platform did (its error's kind quoted, cut
    to 80 characters, withheld when it holds a source path); the thread's run replays on
    `connect` and the next run, on another thread, is served."""
    thread = f"t-{name}"
    deployment.modes[platform_thread_id(thread)] = name
    agent = LangGraphPlatformAgent(deployment_url=deployment.url, graph_id="g", timeout=10)
    async with serve_runtime(CopilotRuntime(agents={"p": agent})) as served:
        events = await served.run(run_input("hi", thread=thread), agent="p")
        replayed = await served.run(run_input("", thread=thread, run="connect-1", messages=[]),
                                    path="/agent/p/connect")
        follow_up = await served.run(run_input("hi", thread=f"t-{name}-next", run="r2"),
                                     agent="p")
    verify_events(events)
    terminal = [e for e in events if e["type"] in ("RUN_FINISHED", "RUN_ERROR")]
    assert terminal == [events[-1]], types(events)
    error = events[-1]
    assert (error["type"], error.get("code"), error["message"]) == (
        "RUN_ERROR", "UPSTREAM_ERROR", PLATFORM[name][1])
    blob = orjson.dumps(events).decode()
    assert not [marker for marker in (*_INTERNALS, "sk-live", "/etc/", "/srv/")
                if marker in blob], error
    assert len(blob) < 4096, len(blob)  # (the 100 KB error is not carried)
    assert replayed[-1] == error
    verify_events(follow_up)
    assert types(follow_up)[-1] == "RUN_FINISHED", follow_up[-1]


async def test_sync_handlers_that_hang_do_not_hold_up_host_name_lookups(
        serve_runtime: ServeRuntime) -> None:
    """Sync handlers ran in asyncio's default executor, which also looks up the host name of
    every new connection (`getaddrinfo`): as many handlers hung on a dead service as it has
    threads (six on two cores) stopped every later provider connection of the process, and
    every sync handler. Now they run in threads of their own; here the default executor has
    two threads and three handlers hang."""
    loop = asyncio.get_running_loop()
    entered: list[str] = []
    all_hung = asyncio.Event()
    release = threading.Event()

    def arrived(order: str) -> None:
        entered.append(order)
        if len(entered) == 3:
            all_hung.set()

    @action
    def hangs(order: str) -> str:
        """Asks a service that stopped answering."""
        loop.call_soon_threadsafe(arrived, order)
        release.wait(30)
        return order

    @action
    def answers(order: str) -> str:
        """Answers at once."""
        return f"order {order}"

    executor = ThreadPoolExecutor(2)
    loop.set_default_executor(executor)
    model = ScriptedAdapter(*[tool_turn(("hangs", '{"order": "1"}'))] * 3,
                            tool_turn(("answers", '{"order": "2"}')), text_turn("done"))
    runtime = CopilotRuntime(service_adapter=model, actions=[hangs, answers])
    try:
        async with serve_runtime(runtime) as served:
            hung = [asyncio.create_task(served.run(run_input("go", thread=f"hung-{n}")))
                    for n in range(3)]
            async with asyncio.timeout(10):
                await all_hung.wait()
            async with asyncio.timeout(5):
                await loop.getaddrinfo("localhost", 80)
                events = await served.run(run_input("go", thread="quick"))
            assert types(events)[-1] == "RUN_FINISHED", events[-1]
            (result,) = tool_results(events).values()
            assert result["content"] == '"order 2"'
            release.set()
            for events in await asyncio.gather(*hung):
                verify_events(events)
    finally:
        release.set()
        executor.shutdown(wait=False)


# ---- an action raising what is no Exception ---------------------------------------------------


@action
async def closes_itself() -> str:
    """Raises GeneratorExit, as code closing a generator it is inside may."""
    raise GeneratorExit("closed /srv/app/x.py")


async def test_an_actions_generator_exit_is_a_tool_error_and_its_thread_goes_on(
        serve_runtime: ServeRuntime) -> None:
    """An action raising GeneratorExit escaped `Action.execute` and the run's drive (whose
    close of the stream then raised): the stream was cut without an end, the run never
    stored and its thread busy for good (every later run 409). Now it is the tool's error."""
    model = ScriptedAdapter(tool_turn(("closes_itself", "{}")), text_turn("done"),
                            text_turn("again"))
    runtime = CopilotRuntime(service_adapter=model, actions=[closes_itself])
    async with asyncio.timeout(20), serve_runtime(runtime) as served:
        events = await served.run(run_input("go"))
        verify_events(events)
        assert types(events)[-1] == "RUN_FINISHED", events[-1]
        assert list(tool_errors(events).values()) == ["GeneratorExit: closed <path>"]
        stored = await get_json(served, "/threads/thread-1/events")
        assert stored["events"][-1]["type"] == "RUN_FINISHED"
        events = await served.run(run_input("again", run="run-2"))
        assert types(events)[-1] == "RUN_FINISHED"


class LibTimeout(BaseException):
    """A library's own BaseException, as gevent's Timeout and func_timeout's are."""


async def test_a_librarys_base_exception_from_a_handler_is_a_tool_error() -> None:
    """A BaseException that is no Exception (gevent's Timeout, func_timeout's), raised by a
    handler (async, or sync in its worker thread), escaped `Action.execute` and cut the
    run's stream without its end; now it is the tool's error."""
    @action
    async def times_out() -> str:
        """Times out."""
        raise LibTimeout("timed out talking to 10.0.0.5")

    @action
    def times_out_in_a_thread() -> str:
        """Times out in its worker thread."""
        raise LibTimeout("timed out")

    said: list[str] = []
    for handler in (times_out, times_out_in_a_thread):
        try:
            with pytest.raises(ActionError) as caught:
                await handler.execute("{}")
        except LibTimeout:
            pytest.fail(f"LibTimeout escaped the action {handler.name}")
        said.append(str(caught.value))
    assert said == ["LibTimeout: timed out talking to 10.0.0.5", "LibTimeout: timed out"]


# ---- a validator of an action's arguments that raises -----------------------------------------


class Order(pydantic.BaseModel):
    code: str

    @pydantic.field_validator("code")
    @classmethod
    def known(cls, code: str) -> str:
        if code == "TYPE":
            raise TypeError("codes are read from /srv/app/codes.py")
        if code == "LIB":
            raise LibTimeout("the code service timed out")
        if code == "VALUE":
            raise ValueError("codes are read from /srv/app/codes.py")
        if code == "ASSERT":
            raise AssertionError("token sk-live-0123456789abcdef rejected at /srv/app/codes.py")
        return {"A": "alpha"}[code[0]]  # the application's own lookup: a KeyError


@action
def look_up(order: Order) -> dict[str, str]:
    """Look an order up."""
    return {"found": order.code}


async def test_a_validator_raising_what_pydantic_does_not_catch_is_a_tool_error(
        serve_runtime: ServeRuntime) -> None:
    """A validator of an `@action`'s argument model raising anything but ValueError or
    AssertionError (which pydantic makes a ValidationError) ran outside the action's guard:
    the whole run ended with an agent failure. Now it is the tool's error, as the handler's
    own exception is, and the run goes on."""
    said = []
    for code in ("B2", "TYPE", "LIB"):
        with pytest.raises(ActionError) as caught:
            await look_up.execute(orjson.dumps({"order": {"code": code}}).decode())
        said.append(str(caught.value))
    assert said == ["KeyError: 'B'", "TypeError: codes are read from <path>",
                    "LibTimeout: the code service timed out"]
    assert orjson.loads(await look_up.execute('{"order": {"code": "A1"}}')) == {"found": "alpha"}

    model = ScriptedAdapter(tool_turn(("look_up", '{"order": {"code": "B2"}}')),
                            text_turn("no such order"))
    runtime = CopilotRuntime(service_adapter=model, actions=[look_up])
    async with asyncio.timeout(20), serve_runtime(runtime) as served:
        events = await served.run(run_input("look B2 up"))
        verify_events(events)
        assert types(events)[-1] == "RUN_FINISHED", events[-1]
        assert list(tool_errors(events).values()) == ["KeyError: 'B'"]
        assert text_of(events) == "no such order"


async def test_a_validators_value_or_assertion_error_is_scrubbed_as_other_failures_are() -> None:
    """A validator's ValueError or AssertionError (pydantic's ValidationError then) reached the
    model, and the client through the tool result, with its paths and tokens, where a
    TypeError's went through `failure_text` (`<path>`): now each is scrubbed the same way."""
    said = []
    for code in ("VALUE", "ASSERT"):
        with pytest.raises(ActionError) as caught:
            await look_up.execute(orjson.dumps({"order": {"code": code}}).decode())
        said.append(str(caught.value))
    assert said == ["order/code: Value error, codes are read from <path>",
                    "order/code: Assertion failed, token [REDACTED] rejected at <path>"]


class Route(pydantic.BaseModel):
    path: Literal["/api/v1/users", "/api/v1/orders"]
    slug: Annotated[str, pydantic.StringConstraints(pattern=r"^/docs/[a-z]+$")]


@action
def route_to(route: Route) -> dict[str, str]:
    """Route a request."""
    return {"path": route.path}


async def test_pydantics_own_messages_keep_the_schema_they_quote() -> None:
    """Every message of a failed validation went through `scrubbed`, pydantic's own too: the
    allowed values of a Literal of paths read "Input should be '<path>' or '<path>'", and the
    model could not correct its call. Only a validator's own words (a ValueError or an
    AssertionError) are scrubbed now; what pydantic says of the schema is said whole."""
    with pytest.raises(ActionError) as caught:
        await route_to.execute('{"route": {"path": "/api/v2/users", "slug": "/api"}}')
    assert str(caught.value) == (
        "route/path: Input should be '/api/v1/users' or '/api/v1/orders'; "
        "route/slug: String should match pattern '^/docs/[a-z]+$'")
