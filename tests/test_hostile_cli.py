"""Hostile input to the command line, the demo's pages, the lifespan and the checkpointers.

Each case ends in one line and a 4xx/5xx the client can act on, never a traceback or a 500.
The CLI runs in-process with `_serve` replaced, so a command that was wrongly accepted fails
the test instead of serving.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
import structlog.testing
from starlette.responses import PlainTextResponse

from copilot_runtime import CopilotRuntime, create_app
from copilot_runtime import cli as cli_module
from copilot_runtime._exceptions import ServiceUnavailableError
from copilot_runtime.checkpointers import checkpointer
from copilot_runtime.demo_pages import DemoPages
from copilot_runtime.workflows.accounts import account_review
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(60)

ASSET = "/assets/app-Abc123.js"


# -- the demo's pages -------------------------------------------------------------------------

async def _runtime(scope: Any, receive: Any, send: Any) -> None:
    await PlainTextResponse("runtime " + scope["path"])(scope, receive, send)


@pytest.fixture
def pages(tmp_path: Path) -> Path:
    """A stand-in for the web build: both pages and one hashed asset."""
    (tmp_path / "classic").mkdir()
    (tmp_path / "assets").mkdir()
    (tmp_path / "index.html").write_text("<html><head></head><body>current</body></html>")
    (tmp_path / "classic" / "index.html").write_text("<html><head></head><body>1.10.6</body>")
    (tmp_path / ASSET.lstrip("/")).write_text("console.log(1)")
    return tmp_path


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://demo")


async def test_an_asset_name_too_long_for_the_file_system_is_404(pages: Path) -> None:
    async with _client(DemoPages(_runtime, "/copilotkit", pages)) as client:
        assert (await client.get(ASSET)).status_code == 200
        response = await client.get("/assets/" + "a" * 300)
        assert response.status_code == 404
        assert response.headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize(("method", "path"), [
    ("POST", ASSET), ("OPTIONS", ASSET), ("PUT", ASSET),
    ("DELETE", "/"), ("POST", "/"), ("POST", "/classic/"),
])
async def test_other_methods_on_pages_and_assets_are_405(pages: Path, method: str,
                                                         path: str) -> None:
    async with _client(DemoPages(_runtime, "/copilotkit", pages)) as client:
        response = await client.request(method, path)
        assert response.status_code == 405, response.text
        assert response.headers["allow"] == "GET, HEAD"
        assert response.text == "Method Not Allowed"
        # GET and HEAD still serve it; the runtime still gets every method.
        assert (await client.head(path)).status_code == 200
        assert (await client.get(path)).status_code == 200
        assert (await client.post("/copilotkit/info")).text == "runtime /copilotkit/info"


async def test_not_found_is_plain_text(pages: Path, tmp_path: Path) -> None:
    unbuilt = tmp_path / "unbuilt"
    for app in (DemoPages(_runtime, "/copilotkit", pages),
                DemoPages(_runtime, "/copilotkit", unbuilt)):
        async with _client(app) as client:
            response = await client.get("/nope")
            assert response.status_code == 404
            assert response.headers["content-type"] == "text/plain; charset=utf-8"
            assert response.text == "Not Found"


# -- the command line -------------------------------------------------------------------------

@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """`main` in `tmp_path` (where TARGET modules are imported from), never serving."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the command was accepted and would serve")

    monkeypatch.setattr(cli_module, "_serve", refuse)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    held: list[Any] = []  # what gives back the SQLite files it would serve
    monkeypatch.setattr(cli_module, "_held", held)
    logging = structlog.get_config()  # `main` sets the runtime's logging up
    yield
    structlog.configure(**logging)
    for give_back in held:
        give_back()


def _fails_with(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    """The one-line error `main(args)` exits with (code 2)."""
    with pytest.raises(SystemExit) as exited:
        cli_module.main(args)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(("source", "target", "expected"), [
    ('raise RuntimeError("boom at import")\n', "hostile_raises:app",
     "copilot-runtime: error: importing 'hostile_raises' failed: RuntimeError: boom at import"),
    ("def x(:\n", "hostile_syntax:app",
     "copilot-runtime: error: importing 'hostile_syntax' failed: SyntaxError: "),
    ("", ".hostile_relative:app",
     "copilot-runtime: error: importing '.hostile_relative' failed: TypeError: "),
], ids=["raises-at-import", "syntax-error", "relative-name"])
def test_serve_a_module_that_fails_to_import(cli: None, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str], source: str,
                                             target: str, expected: str) -> None:
    (tmp_path / (target.lstrip(".").partition(":")[0] + ".py")).write_text(source)
    line = _fails_with(capsys, ["serve", target, "--port", str(free_port())])
    assert line.startswith(expected), line


@pytest.mark.parametrize(("target", "kind"), [
    ("copilot_runtime:CopilotRuntime", "type"),  # a class: calling it builds one, not a reply
    ("os.path:basename", "function"),  # one argument: not app(scope, receive, send)
])
def test_serve_refuses_what_is_not_an_asgi_app(cli: None, capsys: pytest.CaptureFixture[str],
                                               target: str, kind: str) -> None:
    # The port is taken, so code that accepted the target stops at the port check.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _fails_with(capsys, ["serve", target, "--port", str(port)])
    assert line == f"copilot-runtime: error: {kind} is neither a CopilotRuntime nor an ASGI app"


@pytest.mark.parametrize("port", ["70000", "-5", "65536", "0"])
def test_a_port_out_of_range_is_one_line(cli: None, capsys: pytest.CaptureFixture[str],
                                         port: str) -> None:
    """Before: 0 was taken, and every URL the banner printed named port 0, the port the
    system picked never told."""
    line = _fails_with(capsys, ["demo", "--port", port, "--db", ":memory:"])
    assert line == f"copilot-runtime: error: --port must be 1-65535, got {port}"


def test_serve_refuses_port_zero(cli: None, capsys: pytest.CaptureFixture[str],
                                 tmp_path: Path) -> None:
    """Before: served on a port the system picked, its banner saying :0 everywhere."""
    (tmp_path / "bare_zero.py").write_text("async def app(scope, receive, send): pass\n")
    line = _fails_with(capsys, ["serve", "bare_zero:app", "--port", "0"])
    assert line == "copilot-runtime: error: --port must be 1-65535, got 0"


@pytest.mark.parametrize("option", ["--db", "--threads"])
def test_demo_db_in_a_missing_directory_is_one_line_naming_it(
        cli: None, capsys: pytest.CaptureFixture[str], option: str) -> None:
    path = "/nonexistent/dir/x.sqlite3"
    value = path if option == "--db" else "sqlite:///" + path
    line = _fails_with(capsys, ["demo", "--port", str(free_port()), option, value])
    # Before: "unable to open database file", without the file (other errors name it).
    assert line == f"copilot-runtime: error: cannot start: unable to open database file ({path})"


def test_demo_db_empty_is_refused(cli: None, capsys: pytest.CaptureFixture[str]) -> None:
    line = _fails_with(capsys, ["demo", "--port", str(free_port()), "--db", ""])
    assert line == "copilot-runtime: error: --db must name a file, or ':memory:'"


@pytest.mark.parametrize("path", ["/", "", "/classic", "classic/", "/assets", "/assets/x"])
def test_demo_path_that_hides_the_pages_is_refused(cli: None,
                                                   capsys: pytest.CaptureFixture[str],
                                                   path: str) -> None:
    line = _fails_with(capsys, ["demo", "--port", str(free_port()), "--db", ":memory:",
                                "--checkpoints", "memory", "--path", path])
    assert line == (f"copilot-runtime: error: --path {path!r} would hide the demo's pages: "
                    "give another base path (the default is /copilotkit)")


@pytest.mark.parametrize("timeout", ["nan", "0", "-1", "inf", "-inf"])
def test_demo_approval_timeout_must_be_positive_and_finite(
        cli: None, capsys: pytest.CaptureFixture[str], timeout: str) -> None:
    with pytest.raises(SystemExit) as exited:
        cli_module.main(["demo", "--port", str(free_port()), "--db", ":memory:",
                         "--checkpoints", "memory", f"--approval-timeout={timeout}"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert (f"argument --approval-timeout: must be a positive number of seconds, "
            f"got {timeout!r}") in err


# -- the lifespan -----------------------------------------------------------------------------

async def test_a_runtime_that_cannot_start_fails_the_lifespan_in_one_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = CopilotRuntime()

    async def refused() -> None:
        raise ConnectionRefusedError("[Errno 111] Connection refused")

    monkeypatch.setattr(runtime, "start", refused)
    app = create_app(runtime)
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
    assert sent == [{"type": "lifespan.startup.failed",
                     "message": "copilot-runtime: error: cannot start: "
                                "ConnectionRefusedError: [Errno 111] Connection refused"}]
    await runtime.aclose()


async def test_a_lifespan_the_server_gives_up_on_without_a_shutdown_ends_quietly() -> None:
    runtime = CopilotRuntime()
    started = asyncio.Event()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if not sent:
            return {"type": "lifespan.startup"}
        await asyncio.Event().wait()  # no shutdown message comes
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        started.set()

    lifespan = asyncio.create_task(
        create_app(runtime)({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send))
    await asyncio.wait_for(started.wait(), 10)
    await asyncio.sleep(0)
    # What uvicorn's loop does to what is left when a second ^C forces its exit: before, the
    # CancelledError came out of the app, and uvicorn logged it as the app's error, with a
    # stack ("Exception in 'lifespan' protocol").
    lifespan.cancel()
    await asyncio.wait_for(asyncio.wait([lifespan]), 10)
    assert not lifespan.cancelled()
    assert lifespan.exception() is None
    assert sent == [{"type": "lifespan.startup.complete"}]
    await runtime.aclose()


# -- a checkpoint store that cannot be opened -------------------------------------------------

@pytest.mark.parametrize("url", ["sqlite:////proc/nope/c.db", "postgresql://127.0.0.1:1/db"])
async def test_an_unusable_checkpoint_store_is_503(url: str) -> None:
    saver = checkpointer(url)
    with pytest.raises(ServiceUnavailableError):
        await saver._backend.saver()
    runtime = CopilotRuntime(agents={"accounts": account_review(timeout_seconds=60).agent(
        name="accounts", checkpointer=checkpointer(url))})
    try:
        async with _client(create_app(runtime, "/copilotkit")) as client:
            response = await client.get("/copilotkit/approvals")
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"]
        assert response.json()["code"] == "SERVICE_UNAVAILABLE"
    finally:
        await runtime.aclose()


@pytest.mark.parametrize(("option", "url", "expected"), [
    ("--threads", "postgresql://u@127.0.0.1/db?schema=x&bogus=1",
     'not a PostgreSQL connection URL: invalid URI query parameter: "bogus"'),
    ("--coordinator", "postgresql://u@127.0.0.1/db?bogus=1",
     'not a PostgreSQL connection URL: invalid URI query parameter: "bogus"'),
    ("--checkpoints", "postgresql://u@127.0.0.1/db?bogus=1",
     'not a PostgreSQL connection URL: invalid URI query parameter: "bogus"'),
    ("--threads", "postgresql://[bad/db", "cannot read the URL: Invalid IPv6 URL"),
    ("--coordinator", "redis://[bad/11", "cannot read the URL: Invalid IPv6 URL"),
    ("--threads", "postgresql://u@127.0.0.1:99999/db?schema=x",
     "PostgreSQL port must be 1-65535, got '99999'"),
    ("--threads", "postgresql://u@127.0.0.1/db?schema=x&connect_timeout=abc",
     "connect_timeout must be a whole number of seconds, got 'abc'"),
    ("--coordinator", "redis://127.0.0.1:6379/abc",
     "a Redis URL's path is its database number, got 'abc'"),
    # Before: served, and answered 503 for ever.
    ("--threads", "postgresql://u@127.0.0.1/db?schema=x&sslmode=bogus",
     "sslmode must be one of disable, allow, prefer, require, verify-ca, verify-full, "
     "got 'bogus'"),
    # Before: built, then exit code 3 at start-up with `cannot start: TypeError: ...`.
    ("--coordinator", "redis://127.0.0.1:6379/0?bogus=1",
     "'bogus' is not an option of a Redis URL"),
    ("--coordinator", "redis://127.0.0.1:6379/0?socket_timeout=abc",
     "cannot read the Redis URL: Invalid value for 'socket_timeout' in connection URL."),
    ("--coordinator", "redis://127.0.0.1:99999/0",
     "a Redis URL's port must be 1-65535, got '99999'"),
    # Digits to str.isdigit that int() refuses. Before: a traceback; a database "²" served.
    ("--threads", "postgresql://u@127.0.0.1:%C2%B2/db?schema=x",
     "PostgreSQL port must be 1-65535, got '²'"),
    ("--coordinator", "redis://127.0.0.1:6379/%C2%B2",
     "a Redis URL's path is its database number, got '²'"),
    # Before: redis-py dropped a number int() refuses and used database 0 without a word.
    ("--coordinator", "redis://127.0.0.1:6379/" + "1" * 5_000,
     f"a Redis URL's path is its database number, got '{'1' * 5_000}'"),
], ids=["threads-param", "coordinator-param", "checkpoints-param", "threads-bracket",
        "redis-bracket", "pg-port", "pg-timeout", "redis-db", "pg-value", "redis-param",
        "redis-value", "redis-port", "pg-port-superscript", "redis-db-superscript",
        "redis-db-digits"])
def test_a_store_url_no_server_could_accept_is_one_line(
        cli: None, capsys: pytest.CaptureFixture[str], tmp_path: Path, option: str, url: str,
        expected: str) -> None:
    # A configuration mistake, not an outage: refused at start, not a 503 ever after.
    line = _fails_with(capsys, ["demo", "--port", str(free_port()),
                                "--db", str(tmp_path / "d.sqlite3"), option, url])
    assert line == f"copilot-runtime: error: {expected}"



def test_the_runtimes_logs_follow_the_log_level_to_stderr_redacted(
        cli: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    (tmp_path / "bare_target.py").write_text("async def app(scope, receive, send): pass\n")
    secret = "sk-" + "s3cr3t" * 4  # an API key's look: redacted

    def serve(*args: Any, **kwargs: Any) -> None:  # what the runtime logs while it serves
        log = structlog.get_logger("copilot_runtime.test")
        log.warning("below the level")
        log.error("at the level", detail=f"key {secret}")

    monkeypatch.setattr(cli_module, "_serve", serve)
    cli_module.main(["serve", "bare_target:app", "--log-level", "error",
                     "--port", str(free_port())])
    out, err = capsys.readouterr()
    # Before: every level, on stdout with the banner, through structlog's default set-up.
    assert "at the level" not in out
    assert "below the level" not in err
    (line,) = [line for line in err.splitlines() if "at the level" in line]
    assert secret not in line



async def test_an_unusable_checkpoint_store_is_not_a_traceback_a_second(
        monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = CopilotRuntime(agents={"accounts": account_review(timeout_seconds=60).agent(
        name="accounts", checkpointer=checkpointer("sqlite:////proc/nope/c.db"))})
    monkeypatch.setattr(runtime.approvals, "retry_interval", 0.002)
    with structlog.testing.capture_logs() as logs:
        await runtime.start()
        await asyncio.sleep(0.3)  # the timer tries again some 100 times
        await runtime.aclose()
    failed = [entry for entry in logs if entry["event"] == "approval timer failed"]
    # Before: one each time, each with its stack.
    assert 1 <= len(failed) <= 8, len(failed)
    assert not any(entry.get("exc_info") for entry in failed)
    assert failed[0]["error"] == ("ServiceUnavailableError: The checkpoint store cannot be "
                                  "reached")
    opened = [entry for entry in logs if entry["event"] == "the checkpoint store cannot be opened"]
    assert 1 <= len(opened) <= 9, len(opened)


async def test_the_classic_redirect_keeps_the_pages_address(pages: Path) -> None:
    async with _client(DemoPages(_runtime, "/copilotkit", pages)) as client:
        response = await client.get("/classic?agent=review_loop&thread=abc")
    assert response.status_code == 307
    # Before: /classic/, and the page opened a new thread.
    assert response.headers["location"] == "/classic/?agent=review_loop&thread=abc"


def _banner(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
            args: list[str]) -> tuple[str, str]:
    """What `main(args)` prints before it would serve."""
    monkeypatch.setattr(cli_module, "_serve", lambda *args, **kwargs: None)
    cli_module.main(args)
    out, err = capsys.readouterr()
    return out, err


def test_printed_urls_are_urls(cli: None, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    out, _ = _banner(monkeypatch, capsys, ["demo", "--port", str(port), "--host", "::1",
                                           "--path", "copilotkit", "--db", ":memory:",
                                           "--checkpoints", "memory"])
    # Before: http://::1:PORTcopilotkit
    assert f"serving http://[::1]:{port}/copilotkit\n" in out
    assert f"  curl http://[::1]:{port}/copilotkit/info\n" in out
    assert f"http://[::1]:{port}/ " in out  # the pages


@pytest.mark.parametrize("host", ["0.0.0.0", "", "::"])
def test_the_demo_beyond_loopback_is_warned_about(
        cli: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        host: str) -> None:
    args = ["demo", "--port", str(free_port()), "--db", ":memory:", "--checkpoints", "memory"]
    _, err = _banner(monkeypatch, capsys, [*args, "--host", host])
    (line,) = err.splitlines()  # before: nothing
    assert line.startswith("copilot-runtime: warning: the demo has no authentication and "
                           "listens on "), line
    _, err = _banner(monkeypatch, capsys, [*args, "--host", "localhost"])
    assert err == ""


def test_a_runtime_without_auth_beyond_loopback_is_warned_about(
        cli: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    (tmp_path / "open_target.py").write_text(
        "from copilot_runtime import CopilotRuntime\nruntime = CopilotRuntime()\n"
        "async def app(scope, receive, send): pass\n")
    args = ["--host", "0.0.0.0", "--port", str(free_port())]
    _, err = _banner(monkeypatch, capsys, ["serve", "open_target:runtime", *args])
    assert "warning: the runtime has no authentication" in err
    _, err = _banner(monkeypatch, capsys, ["serve", "open_target:app", *args])
    assert err == ""  # an ASGI app: its own business


@pytest.mark.parametrize("size", ["0", "-1"])
def test_a_max_body_size_below_one_byte_is_one_line(
        cli: None, capsys: pytest.CaptureFixture[str], size: str) -> None:
    line = _fails_with(capsys, ["demo", "--port", str(free_port()), "--db", ":memory:",
                                "--max-body-size", size])
    assert line == f"copilot-runtime: error: --max-body-size must be a positive number of " \
                   f"bytes, got {size}"


@pytest.mark.parametrize(("threads", "expected"), [
    ("sqlite:///{tmp}/data/threads.sqlite3", "sqlite:///{tmp}/data/threads.checkpoints.sqlite3"),
    ("memory://", "memory"),
])
def test_the_demos_checkpoints_go_with_its_threads(
        cli: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path, threads: str, expected: str) -> None:
    (tmp_path / "data").mkdir()
    out, _ = _banner(monkeypatch, capsys, ["demo", "--port", str(free_port()),
                                           "--threads", threads.format(tmp=tmp_path)])
    # Before: a file in the working directory, so a demo started from another lost its
    # pending approvals.
    assert f"(checkpoints: {expected.format(tmp=tmp_path)})" in out


@pytest.mark.parametrize("name", ["team?a", "team?b", "pct%2Fx", "50%25off", "q#1 x"])
def test_the_demos_checkpoints_are_exactly_beside_a_thread_file_of_any_name(
        cli: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path, name: str) -> None:
    """Before: the file's name went into the URL as it is, and the URL's reader decodes %XX
    and ends the path at "?": `team?a.sqlite3` and `team?b.sqlite3` shared the checkpoints
    of a file `team`, `pct%2Fx.sqlite3` kept them in a folder `pct/`."""
    out, _ = _banner(monkeypatch, capsys, ["demo", "--port", str(free_port()),
                                           "--db", str(tmp_path / f"{name}.sqlite3")])
    (url,) = (line.split("(checkpoints: ", 1)[1].rstrip(")") for line in out.splitlines()
              if "(checkpoints: " in line)
    saver = checkpointer(url)

    async def open_and_close() -> None:
        await saver.aget_tuple({"configurable": {"thread_id": "t"}})  # creates the file
        await saver.aclose()

    asyncio.run(open_and_close())
    assert (tmp_path / f"{name}.checkpoints.sqlite3").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if "checkpoints" in p.name
                  or not p.name.startswith(name)) == [f"{name}.checkpoints.sqlite3"]


def test_the_demos_banner_hides_a_password_given_as_a_query_option(
        cli: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: only `user:password@` was blanked: a libpq `?password=` (or `sslpassword=`)
    was printed in clear in the workflows' line, which the logs redacted."""
    out, _ = _banner(monkeypatch, capsys, [
        "demo", "--port", str(free_port()), "--db", ":memory:", "--checkpoints",
        "postgresql://app:Hunter2Secret@db.invalid/x?schema=s&password=Hunter2Secret"
        "&sslpassword=Hunter2Secret&sslmode=disable"])
    assert "Hunter2Secret" not in out
    assert ("(checkpoints: postgresql://app:***@db.invalid/x?schema=s&password=***"
            "&sslpassword=***&sslmode=disable)") in out


def test_an_unknown_coordinator_url_is_one_line_without_its_password(
        cli: None, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `Unknown coordinator URL 'postgressql://app:Hunter2Secret@...'`."""
    line = _fails_with(capsys, ["demo", "--port", str(free_port()), "--db", ":memory:",
                                "--coordinator",
                                "postgressql://app:Hunter2Secret@db.internal/app"])
    assert line.startswith("copilot-runtime: error: Unknown coordinator URL "
                           "'postgressql://app:***@db.internal/app'"), line

def test_a_second_process_on_a_sqlite_file_with_a_local_coordinator_is_refused(
        cli: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    args = ["demo", "--db", str(tmp_path / "one.sqlite3"), "--checkpoints", "memory"]
    # Another process serves the file (as a demo holds it). Before: both served, two runs
    # at once on one thread.
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; lock = open(sys.argv[1] + '.lock', 'a'); "
        "fcntl.flock(lock, fcntl.LOCK_EX); print('holding', flush=True); time.sleep(3600)"),
        str(tmp_path / "one.sqlite3")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "holding\n"
        line = _fails_with(capsys, [*args, "--port", str(free_port())])
    finally:
        holder.kill()
        holder.wait(10)
        if holder.stdout is not None:
            holder.stdout.close()
    assert line == (f"copilot-runtime: error: another process serves "
                    f"{tmp_path / 'one.sqlite3'} with a local coordinator, and two would "
                    "run a thread's runs at once: give this one another file, or give the "
                    "runtime a shared coordinator (--coordinator redis://... or "
                    "postgresql://...; README: Many workers, several machines)")
    # Another file is another store.
    _banner(monkeypatch, capsys, ["demo", "--db", str(tmp_path / "two.sqlite3"),
                                  "--checkpoints", "memory", "--port", str(free_port())])


def test_workers_on_a_sqlite_file_with_a_local_coordinator_are_refused(
        cli: None, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "sqlite_target.py").write_text(
        "from copilot_runtime import CopilotRuntime, thread_store\n"
        f"runtime = CopilotRuntime(thread_store=thread_store('sqlite:///{tmp_path}/w.db'))\n")
    # Before: a warning, then workers running a thread's runs at once.
    line = _fails_with(capsys, ["serve", "sqlite_target:runtime", "--workers", "2",
                                "--port", str(free_port())])
    assert line.startswith("copilot-runtime: error: --workers 2 with a SQLite thread store "
                           "and a local coordinator would run a thread's runs at once"), line


async def test_an_unreachable_postgresql_coordinator_fails_the_start_at_once_in_one_line(
        tmp_path: Path) -> None:
    from copilot_runtime import coordinator
    from copilot_runtime.threads.sqlite import SQLiteThreadStore

    runtime = CopilotRuntime(thread_store=SQLiteThreadStore(tmp_path / "t.sqlite3"),
                             coordinator=coordinator("postgresql://postgres@127.0.0.1:1/db"))
    incoming = [{"type": "lifespan.startup"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    started = asyncio.get_running_loop().time()
    await create_app(runtime)({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
    # Before: 15 s of the pool trying again, then a PoolTimeout; psycopg's reason is two lines.
    assert asyncio.get_running_loop().time() - started < 5
    (failed,) = sent
    assert failed["message"].startswith("copilot-runtime: error: cannot start: "
                                        "OperationalError: connection failed: "), failed
    assert "\n" not in failed["message"]
    await runtime.aclose()


@pytest.mark.parametrize(("source", "expected"), [
    ("raise KeyboardInterrupt\n", "importing 'hostile_stop' was interrupted"),
    ("import sys\nsys.exit(3)\n", "importing 'hostile_stop' exited (code 3)"),
    # Before: a traceback, exit code 1.
    ("class Boom(BaseException):\n    pass\nraise Boom('at import')\n",
     "importing 'hostile_stop' failed: Boom: at import"),
    ("import asyncio\nraise asyncio.CancelledError()\n",
     "importing 'hostile_stop' failed: CancelledError"),
], ids=["keyboard-interrupt", "sys-exit", "base-exception", "cancelled"])
def test_a_target_that_stops_at_import_is_one_line(
        cli: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str,
        expected: str) -> None:
    (tmp_path / "hostile_stop.py").write_text(source)
    # Before: exit code 0 without a word, or 3 without one.
    line = _fails_with(capsys, ["serve", "hostile_stop:app", "--port", str(free_port())])
    assert line == f"copilot-runtime: error: {expected}"


@pytest.mark.parametrize(("module", "raised", "expected"), [
    # Before: exit code 5 without a word.
    ("hostile_attr_exit", "SystemExit(5)", "exited (code 5)"),
    ("hostile_attr_int", "KeyboardInterrupt()", "was interrupted"),
    # Before: a traceback, exit code 1.
    ("hostile_attr_base", "Boom('in a property')", "failed: Boom: in a property"),
], ids=["sys-exit", "keyboard-interrupt", "base-exception"])
def test_a_target_attribute_that_stops_when_read_is_one_line(
        cli: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], module: str,
        raised: str, expected: str) -> None:
    (tmp_path / f"{module}.py").write_text(
        "class Boom(BaseException):\n    pass\n\n"
        f"class M:\n    @property\n    def app(self):\n        raise {raised}\n\nm = M()\n")
    line = _fails_with(capsys, ["serve", f"{module}:m.app", "--port", str(free_port())])
    assert line == f"copilot-runtime: error: reading 'm.app' of {module!r} {expected}"


@pytest.mark.parametrize(("files", "target", "expected"), [
    # Before: "cannot import module 'hostile_dep'", which exists.
    ({"hostile_dep.py": "import hostile_de\n"}, "hostile_dep:app",
     "importing 'hostile_dep' failed: No module named 'hostile_de'"),
    ({"hostile_pkg/__init__.py": "", "hostile_pkg/server.py": "import hostile_pkg.other\n"},
     "hostile_pkg.server:app",
     "importing 'hostile_pkg.server' failed: No module named 'hostile_pkg.other'"),
    ({}, "hostile_none:app", "cannot import module 'hostile_none'"),
    ({}, "hostile_none.server:app", "cannot import module 'hostile_none.server'"),
    ({"hostile_bare_pkg/__init__.py": ""}, "hostile_bare_pkg.server:app",
     "cannot import module 'hostile_bare_pkg.server'"),
], ids=["missing-dependency", "missing-sibling", "missing", "missing-package",
        "missing-submodule"])
def test_a_missing_module_is_told_from_a_target_missing_a_dependency(
        cli: None, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        files: dict[str, str], target: str, expected: str) -> None:
    for name, source in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(source)
    line = _fails_with(capsys, ["serve", target, "--port", str(free_port())])
    assert line == f"copilot-runtime: error: {expected}"


@pytest.mark.parametrize("path", ["/a?b", "/copilot#kit", "/a%20b", "/a\tb", "/a\x7fb",
                                  "/a\nb"])
@pytest.mark.parametrize("command", ["serve", "demo"])
def test_a_path_no_url_could_reach_is_refused(
        cli: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str,
        path: str) -> None:
    """Before: served, and the banner's own URLs were 404 (`?` and `#` end a URL's path,
    `%` is decoded, control characters cannot be sent)."""
    (tmp_path / "path_app.py").write_text("async def app(scope, receive, send): pass\n")
    args = ["serve", "path_app:app"] if command == "serve" else \
        ["demo", "--db", ":memory:", "--checkpoints", "memory"]
    line = _fails_with(capsys, [*args, "--port", str(free_port()), "--path", path])
    assert line == (f"copilot-runtime: error: --path {path!r} cannot be reached by a URL: "
                    "give one without '?', '#', '%' or control characters")


@pytest.mark.parametrize("path", ["/x/../api", "/x/./api", "/api/..", "/my\\api",
                                  "/copilotkit "])
@pytest.mark.parametrize("command", ["serve", "demo"])
def test_a_path_browsers_rewrite_is_refused(
        cli: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str,
        path: str) -> None:
    """Before: served, and the demo's pages asked for another path (a browser resolves dot
    segments, turns a backslash into a slash, drops a trailing space from the bare runtime
    URL /classic posts to): 404s, 405s, or a message that vanished without a word."""
    (tmp_path / "path_app.py").write_text("async def app(scope, receive, send): pass\n")
    args = ["serve", "path_app:app"] if command == "serve" else \
        ["demo", "--db", ":memory:", "--checkpoints", "memory"]
    line = _fails_with(capsys, [*args, "--port", str(free_port()), "--path", path])
    assert line == (f"copilot-runtime: error: --path {path!r} is rewritten by browsers "
                    "before it is sent: give one without '.' or '..' segments, '\\' or a "
                    "trailing space")


@pytest.mark.parametrize("path", ["/co pilot", "/copilotkit/ü", "/a:b@c", "/a.b/..c"])
def test_a_path_a_url_can_reach_is_served(cli: None, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str],
                                          path: str) -> None:
    (tmp_path / "path_app.py").write_text(
        "from copilot_runtime import CopilotRuntime, DemoAdapter\n"
        "runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0))\n")
    out, _ = _banner(monkeypatch, capsys, ["serve", "path_app:runtime", "--port",
                                           str(free_port()), "--path", path])
    # (percent-encoded: the banner's URLs are to be copied whole)
    assert f"{urllib.parse.quote(path)}/info" in out


@pytest.mark.parametrize("value", ["", "  ", "local ", " local"])
def test_the_coordinator_variable_empty_is_unset_and_is_read_without_spaces(
        cli: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        value: str) -> None:
    """Before: refused as an unknown coordinator URL, where COPILOT_RUNTIME_THREADS and
    COPILOT_RUNTIME_CHECKPOINTS empty are unset."""
    monkeypatch.setenv("COPILOT_RUNTIME_COORDINATOR", value)
    out, err = _banner(monkeypatch, capsys, ["demo", "--port", str(free_port()),
                                             "--db", ":memory:", "--checkpoints", "memory"])
    assert "serving http://" in out
    assert "error" not in err


def test_a_coordinator_url_is_read_without_surrounding_spaces() -> None:
    from copilot_runtime.coordination import LocalCoordinator, coordinator

    assert isinstance(coordinator(""), LocalCoordinator)
    assert isinstance(coordinator(" local\n"), LocalCoordinator)
    shared = coordinator(" redis://127.0.0.1:6379/0?prefix=cli_strip: ")
    assert shared.shared


@pytest.mark.parametrize("option", ["--threads", "--coordinator", "--checkpoints"])
def test_an_empty_schema_is_refused(cli: None, capsys: pytest.CaptureFixture[str],
                                    option: str) -> None:
    """Before: taken as the default schema (`public`, `copilot_runtime`, the search path),
    silently: an unset shell variable (`?schema=$SCHEMA`) shared another deployment's."""
    url = "postgresql://postgres@127.0.0.1:5432/test?schema="
    line = _fails_with(capsys, ["demo", "--port", str(free_port()), "--db", ":memory:",
                                "--threads", "postgresql://postgres@127.0.0.1:5432/test?"
                                "schema=cli_empty", option, url])
    assert line == ("copilot-runtime: error: ?schema= is empty: give it a schema name, or "
                    "leave it out for the default")


def test_an_empty_schema_is_refused_by_each_builder() -> None:
    from copilot_runtime._exceptions import ConfigurationError
    from copilot_runtime.coordination import coordinator
    from copilot_runtime.threads import thread_store

    url = "postgresql://postgres@127.0.0.1:5432/test?pool_size=2&schema="
    for build in (thread_store, coordinator, checkpointer):
        with pytest.raises(ConfigurationError, match=r"\?schema= is empty"):
            build(url)


def test_a_thread_file_that_is_not_a_database_is_named(
        cli: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "notes.sqlite3"
    db.write_bytes(b"not a database, " * 100)
    line = _fails_with(capsys, ["demo", "--port", str(free_port()), "--db", str(db)])
    # Before: "file is not a database", the thread store's or the checkpoints'?
    assert line == f"copilot-runtime: error: cannot start: file is not a database ({db})"


async def test_a_postgresql_thread_store_on_a_reserved_schema_name_fails_the_start_in_one_line(
        ) -> None:
    from copilot_runtime.threads import thread_store

    runtime = CopilotRuntime(thread_store=thread_store(
        "postgresql://postgres@127.0.0.1:5432/test?schema=pg_fc_reserved"))
    incoming = [{"type": "lifespan.startup"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await create_app(runtime)({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
    # Before: it started (logged as a store that could not be opened, to try again), and
    # every request was a 500 with a traceback: PostgreSQL refuses the name each time.
    (failed,) = sent
    assert failed == {
        "type": "lifespan.startup.failed",
        "message": "copilot-runtime: error: cannot start: ConfigurationError: the thread "
                   "store cannot use schema 'pg_fc_reserved': unacceptable schema name "
                   "\"pg_fc_reserved\" (give ?schema= a name not beginning with pg_)"}
    await runtime.aclose()


@pytest.mark.parametrize("value", ["", "  "])
@pytest.mark.parametrize("variable", ["COPILOT_RUNTIME_DB", "COPILOT_RUNTIME_THREADS",
                                      "COPILOT_RUNTIME_CHECKPOINTS"])
def test_a_demo_variable_empty_or_blank_is_unset(
        cli: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], variable: str, value: str) -> None:
    """Before: COPILOT_RUNTIME_DB= (a .env line left empty) stopped the demo with "--db
    must name a file", and a blank COPILOT_RUNTIME_CHECKPOINTS made a checkpoint file
    named by its spaces; the README says an empty one counts as unset."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(variable, value)
    out, err = _banner(monkeypatch, capsys, ["demo", "--port", str(free_port())])
    assert "serving http://" in out
    assert "error" not in err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.strip() != p.name) == []
    assert (tmp_path / "copilot-runtime-demo.sqlite3").exists()
