"""The command line: serving targets, one-line errors, and the offline demo."""

from __future__ import annotations

import concurrent.futures
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import orjson
import pytest
from ag_ui.core import AssistantMessage, FunctionCall, ToolCall, ToolMessage, UserMessage

from copilot_runtime import ActionError, CopilotRuntime, DemoAdapter, __version__
from copilot_runtime.adapters.base import ChatRequest, TextDelta, ToolCallDelta, ToolSpec
from copilot_runtime.demo import build_demo_runtime, get_weather, roll_dice
from copilot_runtime.testing import verify_events
from tests.conftest import ServeRuntime, free_port, parse_sse, run_input, text_of

CLI = [sys.executable, "-m", "copilot_runtime"]


def _fails_with(args: list[str], message: str) -> None:
    result = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result
    assert result.stderr.strip() == f"copilot-runtime: error: {message}"


def test_bad_targets() -> None:
    _fails_with(["serve", "nocolon"], "TARGET must look like 'module:attribute', got 'nocolon'")
    _fails_with(["serve", "no_such_module:app"], "cannot import module 'no_such_module'")
    _fails_with(["serve", "copilot_runtime:nothing"],
                "module 'copilot_runtime' has no attribute 'nothing'")
    _fails_with(["serve", "copilot_runtime:__version__"],
                "str is neither a CopilotRuntime nor an ASGI app")


def test_port_in_use() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        _fails_with(["demo", "--port", str(port), "--db", ":memory:"],
                    f"port {port} on 127.0.0.1 is already in use")


@pytest.fixture(scope="module")
def demo_server() -> Iterator[str]:
    # One demo for the tests that only ask it (each of its runs on a thread of its own):
    # starting one takes seconds.
    port = free_port()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": "."}
    process = subprocess.Popen([*CLI, "demo", "--port", str(port), "--db", ":memory:"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}/copilotkit"
    try:
        deadline = time.monotonic() + 60  # a loaded machine imports the demo slowly
        while True:
            try:
                httpx2.get(url + "/info", timeout=1)
                break
            except httpx2.TransportError:
                assert process.poll() is None, process.communicate(timeout=10)
                assert time.monotonic() < deadline, "the demo did not start"
                time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        out, err = process.communicate(timeout=10)
        assert b"Traceback" not in err, err
        assert b"offline demo model" in out


def test_demo_runs_offline(demo_server: str) -> None:
    info = httpx2.get(demo_server + "/info").json()
    assert info["agents"]["default"]["className"] == "BuiltInAgent"
    response = httpx2.post(demo_server + "/agent/default/run",
                           json=run_input("What is the weather in Paris?"), timeout=30)
    events = parse_sse(response.content)
    verify_events(events)
    result = next(e for e in events if e["type"] == "TOOL_CALL_RESULT")
    assert orjson.loads(result["content"])["city"] == "Paris"
    assert "get_weather returned" in text_of(events)
    hello = parse_sse(httpx2.post(demo_server + "/agent/default/run",
                                  json=run_input("hello", thread="t2"), timeout=30).content)
    assert "offline demo model" in text_of(hello)


def test_demo_is_same_origin_and_loopback_only(demo_server: str) -> None:
    # It answered every Origin with `*` and served any Host: any page the user opened could
    # read its threads and run its agents, directly or by DNS rebinding.
    evil = {"origin": "https://evil.example"}
    threads = httpx2.get(demo_server + "/threads", headers=evil)
    assert threads.status_code == 200
    assert "access-control-allow-origin" not in threads.headers
    preflight = httpx2.options(demo_server + "/agent/default/run", headers={
        **evil, "access-control-request-method": "POST"})
    assert not any(name.startswith("access-control-") for name in preflight.headers)
    port = demo_server.split(":")[2].split("/")[0]
    rebound = httpx2.get(demo_server + "/threads", headers={"host": f"rebind.evil.example:{port}"})
    assert rebound.status_code == 421
    assert "localhost" in rebound.text
    for host in (f"localhost:{port}", "127.0.0.1", f"[::1]:{port}"):
        assert httpx2.get(demo_server + "/threads", headers={"host": host}).status_code == 200


async def test_demo_runtime_dice_and_frontend_tools(serve_runtime: ServeRuntime) -> None:
    runtime, description = build_demo_runtime()
    assert "offline" in description
    assert isinstance(runtime.agents["default"], object)
    runtime.agents["default"].adapter = DemoAdapter(delay=0)  # type: ignore[attr-defined]
    async with serve_runtime(runtime) as served:
        dice = await served.run(run_input("Roll a die please"))
        verify_events(dice)
        rolled = orjson.loads(next(e for e in dice if e["type"] == "TOOL_CALL_RESULT")["content"])
        assert 1 <= rolled["total"] <= 6
        tool = {"name": "changeTheme", "description": "Change the colour theme",
                "parameters": {"type": "object", "properties": {"color": {"type": "string"}},
                               "required": ["color"]}}
        frontend = await served.run(run_input("please changeTheme", thread="t-f",
                                              tools=[tool]))
        verify_events(frontend)
        assert [e["type"] for e in frontend][-2:] == ["TOOL_CALL_END", "RUN_FINISHED"]


async def test_demo_actions() -> None:
    weather = orjson.loads(await get_weather.execute('{"city":"Oslo"}'))
    assert weather == orjson.loads(await get_weather.execute('{"city":"Oslo"}'))
    rolls = orjson.loads(await roll_dice.execute('{"sides": 20, "count": 3}'))
    assert len(rolls["rolls"]) == 3
    assert all(1 <= r <= 20 for r in rolls["rolls"])
    with pytest.raises(ActionError, match="sides: Input should be greater than or equal to 2"):
        await roll_dice.execute('{"sides": 1}')
    with pytest.raises(ActionError, match="count: Input should be less than or equal to 100"):
        await roll_dice.execute('{"count": 101}')


async def test_mount_into_fastapi() -> None:
    from fastapi import FastAPI

    from copilot_runtime import mount_runtime
    from tests.conftest import serve

    app = FastAPI()

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"ok": "yes"}

    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0))
    mount_runtime(app, runtime, "/api/copilotkit")
    async with serve(app) as url, httpx2.AsyncClient() as client:
        assert (await client.get(url + "/health")).json() == {"ok": "yes"}
        info = await client.get(url + "/api/copilotkit/info")
        assert info.json()["agents"]["default"]["name"] == "default"
        single = await client.post(url + "/api/copilotkit", json={"method": "info"})
        assert "singleRoute" in single.json()
        run = await client.post(url + "/api/copilotkit/agent/default/run",
                                json=run_input("hi"))
        assert "offline demo model" in text_of(parse_sse(run.content))
    await runtime.aclose()


def test_serve_with_workers_runs_several_processes_on_one_port() -> None:
    port = free_port()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ".", "LLM_BASE_URL": "http://127.0.0.1:9/v1"}
    process = subprocess.Popen([*CLI, "serve", "tests.realclient_app:runtime", "--port", str(port),
                                "--workers", "2"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}/copilotkit"
    try:
        deadline = time.monotonic() + 60
        while True:
            children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text()
            try:
                if len(children.split()) >= 2 and \
                        httpx2.get(url + "/info", timeout=1).status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            assert process.poll() is None, process.communicate(timeout=10)
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.1)
        # Each worker built its own runtime from TARGET, and answers on the shared port.
        for _ in range(4):
            assert httpx2.get(url + "/info", timeout=5).json()["agents"]["default"]
    finally:
        process.terminate()
        _out, err = process.communicate(timeout=30)
    assert b"Traceback" not in err, err
    # That runtime keeps its runs and threads to each process: the operator is told so.
    assert b"warning: --workers 2 with a local coordinator" in err, err
    assert b"threads kept in memory are each worker's own" in err, err


def test_workers_of_a_shared_runtime_are_not_warned_about(
        capsys: pytest.CaptureFixture[str]) -> None:
    from copilot_runtime.cli import _warn_unshared
    from copilot_runtime.coordination import LocalCoordinator
    from copilot_runtime.threads.sqlite import SQLiteThreadStore

    class Shared(LocalCoordinator):
        shared = True  # what a PostgreSQL or Redis coordinator says

    store = SQLiteThreadStore(":memory:")
    _warn_unshared(CopilotRuntime(service_adapter=DemoAdapter(delay=0), thread_store=store,
                                  coordinator=Shared()), 3)
    assert capsys.readouterr().err == ""
    # A durable store on one machine with a local coordinator: only the coordinator is named.
    _warn_unshared(CopilotRuntime(service_adapter=DemoAdapter(delay=0), thread_store=store), 3)
    err = capsys.readouterr().err
    assert "--workers 3 with a local coordinator" in err
    assert "threads kept in memory" not in err
    _warn_unshared(lambda *_: None, 3)  # an ASGI app: nothing to tell about
    assert capsys.readouterr().err == ""


def test_help_shows_defaults_and_environment_names_not_their_values(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The help showed no default, nor the COPILOT_RUNTIME_* variables the demo falls back
    to; `python -m copilot_runtime.testing --help` was `usage: __main__.py`."""
    from copilot_runtime.cli import main
    from copilot_runtime.testing.mock_openai import main as mock_main

    monkeypatch.setenv("COPILOT_RUNTIME_THREADS", "postgresql://app:s3cret@db/app")

    def help_of(run: Any, *argv: str) -> str:
        with pytest.raises(SystemExit) as done:
            run([*argv, "--help"])
        assert done.value.code == 0
        return " ".join(capsys.readouterr().out.split())  # argparse's own line breaks

    demo = help_of(main, "demo")
    for shown in ("(default: 127.0.0.1)", "(default: 8000)", "(default: /copilotkit)",
                  "(default: warning)", "$COPILOT_RUNTIME_DB", "$COPILOT_RUNTIME_THREADS",
                  "$COPILOT_RUNTIME_CHECKPOINTS", "$COPILOT_RUNTIME_COORDINATOR"):
        assert shown in demo, (shown, demo)
    assert "s3cret" not in demo  # a URL from the environment may hold a password
    assert "default: 1)" in help_of(main, "serve")
    result = subprocess.run([sys.executable, "-m", "copilot_runtime.testing", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.startswith("usage: python -m copilot_runtime.testing "), result
    assert help_of(mock_main).startswith("usage: python -m copilot_runtime.testing.mock_openai")


def test_workers_must_be_positive() -> None:
    _fails_with(["serve", "tests.realclient_app:runtime", "--workers", "0"],
                "--workers must be at least 1")


def test_demo_refuses_a_shared_coordinator_over_memory_threads() -> None:
    _fails_with(["demo", "--port", str(free_port()), "--db", ":memory:", "--coordinator",
                 "redis://127.0.0.1:6379/0"],
                "a shared coordinator needs a thread store every worker can read: pass "
                "thread_store=thread_store('postgresql://...') (the in-memory store is this "
                "process's alone)")


def test_demo_on_shared_threads_and_a_coordinator(tmp_path: Path) -> None:
    # The one line of the README, on a SQLite file here (PostgreSQL: tests/test_multi_worker).
    port = free_port()
    threads = f"sqlite:///{tmp_path}/threads.sqlite3"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ".", "COPILOT_RUNTIME_THREADS": threads,
           "COPILOT_RUNTIME_COORDINATOR": "redis://127.0.0.1:6379/0?prefix=cli-demo-test:"}
    process = subprocess.Popen([*CLI, "demo", "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}/copilotkit"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx2.get(url + "/info", timeout=1)
                break
            except httpx2.TransportError:
                assert process.poll() is None, process.communicate(timeout=10)
                assert time.monotonic() < deadline, "the demo did not start"
                time.sleep(0.05)
        run = httpx2.post(url + "/agent/default/run", json=run_input("hi", thread="t-demo"))
        assert parse_sse(run.content)[-1]["type"] == "RUN_FINISHED"
    finally:
        process.terminate()
        _out, err = process.communicate(timeout=30)
    assert b"Traceback" not in err, err
    assert (tmp_path / "threads.sqlite3").exists()


# -- the offline model: arguments from everyday wording, bounded answers ----------------------

#: The demo's tools as the model sees them: its two actions and the pages' accent tool
#: (`ACCENTS` of web/src/shared/demo.jsx).
DEMO_TOOLS = [
    ToolSpec(get_weather.name, get_weather.description, get_weather.parameters),
    ToolSpec(roll_dice.name, roll_dice.description, roll_dice.parameters),
    ToolSpec("set_accent_color", "Change the accent colour of the demo page.", {
        "type": "object", "required": ["color"], "properties": {"color": {
            "type": "string",
            "enum": ["teal", "crimson", "indigo", "orange", "green", "purple"]}}}),
]


class DemoTurn:
    """What the offline model streamed for one message: a tool call or text, and in how many
    pieces."""

    def __init__(self) -> None:
        self.call: tuple[str | None, dict[str, Any]] | None = None
        self.text = ""
        self.pieces = 0


async def _demo_turn(text: str, tools: list[ToolSpec] = DEMO_TOOLS) -> DemoTurn:
    request = ChatRequest(messages=[UserMessage(id="u1", role="user", content=text)],
                          tools=tools)
    turn = DemoTurn()
    async for deltas in DemoAdapter(delay=0).stream(request):
        for delta in deltas:
            if isinstance(delta, ToolCallDelta):
                turn.call = delta.name, orjson.loads(delta.arguments or "{}")
            elif isinstance(delta, TextDelta):
                turn.text += delta.text
                turn.pieces += 1
    return turn


@pytest.mark.parametrize(("text", "city"), [
    ("what's the weather in paris?", "Paris"),
    ("What is the weather in Paris today?", "Paris"),
    ("Weather for London this weekend please", "London"),
    ("how's the weather in new york right now", "New York"),
    ("Weather in Rio de Janeiro, please", "Rio de Janeiro"),  # as typed: kept
])
async def test_the_offline_model_finds_the_city_in_everyday_wording(text: str, city: str) -> None:
    assert (await _demo_turn(text)).call == ("get_weather", {"city": city})


async def test_the_offline_model_asks_for_a_city_instead_of_inventing_one() -> None:
    turn = await _demo_turn("What's the weather like today?")
    assert turn.call is None
    assert "Name a city" in turn.text
    assert "You said" not in turn.text


async def test_the_offline_model_names_the_colours_it_can_set_for_another() -> None:
    turn = await _demo_turn("Set the accent colour to blue")
    assert turn.call is None
    assert "I can set: teal, crimson, indigo, orange, green, purple" in turn.text
    assert (await _demo_turn("Set the accent colour to Purple.")).call == (
        "set_accent_color", {"color": "purple"})


@pytest.mark.parametrize(("text", "arguments"), [
    ("Roll 3 dice with 20 sides", {"count": 3, "sides": 20}),
    ("roll a 12-sided die", {"sides": 12}),
    ("Roll a d20", {"sides": 20}),
    ("roll 2d8 please", {"count": 2, "sides": 8}),
    ("Roll a die", {}),  # the tool's defaults
    ("Roll 500 dice with 5000 sides", {"count": 100, "sides": 1000}),  # the schema's bounds
    ("Roll dice, sides: 20, count of 3", {"count": 3, "sides": 20}),
    ("roll a die: sides = 10", {"sides": 10}),
])
async def test_the_offline_model_takes_numbers_from_the_text(
        text: str, arguments: dict[str, int]) -> None:
    assert (await _demo_turn(text)).call == ("roll_dice", arguments)


@pytest.mark.parametrize("size", [15_000, 370_000])
async def test_the_offline_model_quotes_a_long_paste_briefly_and_quickly(size: int) -> None:
    paste = ("Traceback line with words " * (size // 26 + 1))[:size - 1] + "."
    turn = await _demo_turn(paste, tools=[])
    assert f"... ({size} characters)" in turn.text
    assert len(turn.text) < 800
    assert paste[:150] in turn.text
    # Each piece waits `delay` (20 ms): the answer streams for at most ~3 s.
    assert turn.pieces <= 150


#: A tool named with many words, as a page may declare one.
MANY_WORDS_TOOL = ToolSpec("a_a_a_a_a_a_a_a_zz", "x", {"type": "object", "properties": {}})
#: Seconds the offline model may take for one hostile message below: 0.1 to 2 ms, at worst
#: 30 ms, here (they took 4 to 41 s); and GET /info of a live demo that streams its answer
#: meanwhile: 20 ms idle, 45 to 80 ms (it waited 18 s).
QUICK = 0.3
INFO_QUICK = 1.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("text", "tools", "call"), [
    pytest.param(" ".join(["a"] * 40), [MANY_WORDS_TOOL], None, id="a tool's 9 words"),
    pytest.param("set accent " * 800, DEMO_TOOLS, None, id="the page's tool's words repeated"),
    pytest.param("roll the dice sides" + " " * 16_000 + "x", DEMO_TOOLS, ("roll_dice", {}),
                 id="spaces after a parameter's name"),
    pytest.param("roll a die with side" + "0" * 16_000 + "x", DEMO_TOOLS, ("roll_dice", {}),
                 id="digits in a parameter's word"),
])
async def test_the_offline_model_reads_a_hostile_message_quickly(
        text: str, tools: list[ToolSpec], call: tuple[str, dict[str, Any]] | None) -> None:
    """Before: a tool's words were matched with a backtracking regex (`a.*?b.*?c`), and a
    number after a parameter's name too: a short message took seconds to minutes, all on the
    server's event loop."""
    start = time.perf_counter()
    turn = await _demo_turn(text, tools)
    assert time.perf_counter() - start < QUICK
    assert turn.call == call


@pytest.mark.timeout(120)
async def test_the_offline_model_reads_a_tools_first_parameters_and_values_only() -> None:
    """Before: each parameter and enum value cost searches of the message, and the required
    list was scanned for each: a tool of 20,000 numbers held the server 24 s, an enum of
    20,000 values 5 s. The first 32 parameters and 64 values are read; the rest get
    defaults."""
    numbers = {f"p{i}": {"type": "integer"} for i in range(20_000)}
    tools = [ToolSpec("set_accent_color", "x", {"type": "object", "properties": numbers,
                                                "required": list(numbers)})]
    start = time.perf_counter()
    turn = await _demo_turn("set the accent color p1 7 and p40 9 " + "p2 " * 1_000, tools)
    assert time.perf_counter() - start < QUICK
    assert turn.call is not None
    name, arguments = turn.call
    assert (name, arguments["p1"], arguments["p40"]) == ("set_accent_color", 7, 6)
    assert len(arguments) == 20_000
    values = {"type": "string", "enum": [f"v{i}" for i in range(20_000)]}
    tools = [ToolSpec("set_accent_color", "x", {"type": "object", "properties": {
        "color": values}, "required": ["color"]})]
    start = time.perf_counter()
    turn = await _demo_turn("set the accent color to v3 " + "v2 " * 1_000, tools)
    assert time.perf_counter() - start < QUICK
    assert turn.call == ("set_accent_color", {"color": "v2"})


async def test_the_offline_model_reads_a_messages_first_4000_characters() -> None:
    assert (await _demo_turn("x" * 3_950 + " roll a die")).call == ("roll_dice", {})
    assert (await _demo_turn("x" * 4_000 + " roll a die")).call is None


@pytest.mark.timeout(120)
def test_the_live_demo_answers_while_its_offline_model_reads_a_hostile_message(
        demo_server: str) -> None:
    """Before: the demo page's own tool and "set accent " * 800 (8.8 KB) held the server's
    event loop: GET /info waited 18 s."""
    tool = {"name": "set_accent_color", "description": "Set the page's accent colour",
            "parameters": {"type": "object", "required": ["color"], "properties": {
                "color": {"type": "string", "enum": ["teal", "crimson", "indigo"]}}}}
    body = run_input("set accent " * 800, thread="t-hostile", tools=[tool])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        run = pool.submit(httpx2.post, demo_server + "/agent/default/run", json=body,
                          timeout=60)
        for _ in range(5):  # while the run is read and answered (about 1.5 s)
            time.sleep(0.1)
            assert httpx2.get(demo_server + "/info", timeout=INFO_QUICK).status_code == 200
        events = parse_sse(run.result().content)
    verify_events(events)
    assert events[-1]["type"] == "RUN_FINISHED"
    assert "offline demo model" in text_of(events)


async def test_the_offline_model_streams_a_long_answer_in_bounded_pieces() -> None:
    result = " ".join(f"word{i}" for i in range(20_000))
    request = ChatRequest(messages=[
        UserMessage(id="u1", role="user", content="call get_weather"),
        AssistantMessage(id="a1", role="assistant", tool_calls=[ToolCall(
            id="c1", type="function", function=FunctionCall(name="get_weather",
                                                            arguments="{}"))]),
        ToolMessage(id="t1", role="tool", tool_call_id="c1", content=result),
    ])
    pieces: list[str] = []
    async for deltas in DemoAdapter(delay=0).stream(request):
        pieces += [d.text for d in deltas if isinstance(d, TextDelta)]
    assert result in "".join(pieces)
    assert len(pieces) <= 150


def test_the_serving_banner_gives_urls_that_work(capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `--path "/a b"` printed `curl http://127.0.0.1:8000/a b/info` (two URLs to
    curl), and an ASGI app of the user's was announced with the runtime's URLs and curl
    lines, its `--path` silently ignored."""
    from copilot_runtime.cli import _app_served, _print_next_steps

    _print_next_steps("127.0.0.1", 8000, "/a b", None)
    out = capsys.readouterr().out
    assert "curl http://127.0.0.1:8000/a%20b/info" in out
    assert "/a b" not in out
    assert _app_served("myapp:app", "127.0.0.1", 8000, "/copilotkit") == (
        f"copilot-runtime {__version__} serving myapp:app at http://127.0.0.1:8000/")
    said = _app_served("myapp:app", "::1", 8000, "/api")
    assert "at http://[::1]:8000/" in said
    assert "--path applies to a CopilotRuntime only" in said
    assert "curl" not in said
