"""The demo's web pages: served beside the runtime, and clicked through in a real browser.

The pages are built once per session from `web/` (`scripts/build_web.sh`, skipped when the
lockfile, sources and build script are unchanged). `copilot-runtime demo` runs as a child
process with its SQLite files in a temporary directory; `web/e2e/demo.mjs` drives Debian's
headless chromium with `playwright-core` on both pages (react-core 1.74 over AG-UI at `/`,
react-core + react-ui 1.10.6 over GraphQL at `/classic`). Then the server is restarted on the
same files and the threads must come back. Screenshots land in a temporary directory, or in
`docs/screenshots/` with `UPDATE_SCREENSHOTS=1`.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ag_ui.core import UserMessage
from starlette.responses import PlainTextResponse

from copilot_runtime.adapters.base import ChatRequest, ToolCallDelta, ToolSpec
from copilot_runtime.adapters.demo import DemoAdapter
from copilot_runtime.demo_pages import DemoPages
from tests import background
from tests.agents_support.processes import REPO_ROOT, free_port

CHROMIUM = Path("/usr/bin/chromium")
WEB = REPO_ROOT / "web"
PAGES = REPO_ROOT / "copilot_runtime" / "demo_web"
SCREENSHOTS = ("current", "classic", "current-approval", "classic-approval",
               "current-account-review", "classic-account-review")
# The first test also builds the pages: on a fresh clone `npm ci` and the build take ~2 min.
pytestmark = pytest.mark.timeout(720)


@pytest.fixture(scope="session")
def built_pages() -> Path:
    done = background.result("web", timeout=420)  # started with the session
    if done.returncode != 0:
        pytest.fail(f"building the web pages failed:\n{done.stdout[-2000:]}\n"
                    f"{done.stderr[-3000:]}", pytrace=False)
    return PAGES


class DemoServer:
    """`python -m copilot_runtime demo` on a free port, offline, its files in `directory`."""

    def __init__(self, directory: Path, approval_timeout: float = 600) -> None:
        self.directory = directory
        self.approval_timeout = approval_timeout
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, timeout: float = 60.0) -> None:
        self.starts += 1
        env = {k: v for k, v in os.environ.items()
               if k not in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENAI_MODEL")}
        with (self.directory / f"server-{self.starts}.log").open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "copilot_runtime", "demo", "--port", str(self.port),
                 "--db", str(self.directory / "demo.sqlite3"),
                 "--approval-timeout", str(self.approval_timeout)],
                cwd=self.directory, env={**env, "PYTHONUNBUFFERED": "1"},
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.base + "/copilotkit/info", timeout=1):
                    return
            except (urllib.error.URLError, OSError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the demo did not start:\n{self.log()}", pytrace=False)
                time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def log(self) -> str:
        path = self.directory / f"server-{self.starts}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else "(no log)"


@pytest.fixture(scope="module")
def demo(built_pages: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoServer]:
    server = DemoServer(tmp_path_factory.mktemp("demo-web"))
    server.start()
    try:
        yield server
    finally:
        server.stop()
        assert "Traceback" not in server.log(), server.log()


def drive(demo: DemoServer, phase: str, screenshots: Path,
          threads: dict[str, str] | None = None) -> dict[str, Any]:
    """Runs the browser driver for `phase`; what it saw, as data."""
    if not CHROMIUM.exists():
        pytest.fail("the browser tests need Debian's chromium at /usr/bin/chromium "
                    "(`apt-get install chromium`; ./scripts/test.sh installs it)", pytrace=False)
    options = {"screenshots": str(screenshots), "threads": threads or {},
               "chromium": str(CHROMIUM)}
    done = subprocess.run(
        [shutil.which("node") or "node", str(WEB / "e2e" / "demo.mjs"), demo.base, phase,
         json.dumps(options)],
        cwd=WEB, capture_output=True, text=True, timeout=240, check=False)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if not lines:
        pytest.fail(f"the browser driver printed nothing:\n{done.stderr[-4000:]}", pytrace=False)
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def failures(result: dict[str, Any], page: str | None = None) -> list[dict[str, Any]]:
    return [s for s in result["steps"] if not s["ok"] and (page is None or s["page"] == page)]


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


@pytest.fixture(scope="module")
def main_phase(demo: DemoServer, screenshots: Path) -> dict[str, Any]:
    return drive(demo, "main", screenshots)


MAIN_STEPS = ["chat", "weather card", "frontend tool", "refresh restores the thread",
              "new thread and switching back",
              "Back and Forward go through the threads and agents", "stop mid-answer",
              "a failed run: its message kept, its error gone once a later run answers",
              "review loop: revise twice, then approve",
              "a thread opened under another agent is shown as its agent's",
              "account review: approve",
              "a thread opened while the runtime is away shows once it is back",
              "an answer that failed is asked again",
              "after an outage its banners go once the runtime is back"]


@pytest.mark.parametrize("page", ["current", "classic"])
def test_every_click_works(main_phase: dict[str, Any], page: str) -> None:
    assert failures(main_phase, page) == [], json.dumps(failures(main_phase, page), indent=1)
    done = [s["step"] for s in main_phase["steps"] if s["page"] == page]
    assert done[:len(MAIN_STEPS)] == MAIN_STEPS


def test_no_console_errors_and_no_failed_requests(main_phase: dict[str, Any]) -> None:
    assert failures(main_phase) == []
    assert main_phase["consoleErrors"] == []
    assert main_phase["failedRequests"] == []


def test_screenshots_are_saved(main_phase: dict[str, Any], screenshots: Path) -> None:
    for name in SCREENSHOTS:
        shot = screenshots / f"{name}.png"
        assert shot.is_file(), name
        assert shot.stat().st_size > 10_000, name
        if os.environ.get("UPDATE_SCREENSHOTS") == "1":
            target = REPO_ROOT / "docs" / "screenshots"
            target.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shot, target / shot.name)


def test_a_restart_restores_the_threads(demo: DemoServer, main_phase: dict[str, Any],
                                        screenshots: Path) -> None:
    threads = main_phase["threads"]
    assert set(threads) >= {f"{page}:{thread}" for page in ("current", "classic")
                            for thread in ("chat", "review", "pending")}
    demo.stop()
    demo.start()
    after = drive(demo, "restart", screenshots, threads)
    assert failures(after) == [], json.dumps(failures(after), indent=1)
    assert [s["step"] for s in after["steps"]] == 2 * [
        "restart restores the thread", "restart restores the review loop",
        "a pending approval survives the restart"]
    assert after["consoleErrors"] == []
    assert after["failedRequests"] == []


def test_both_pages_fit_a_phone(demo: DemoServer, screenshots: Path) -> None:
    """At 390x844 the side panel stacks above the chat: the page fits the screen, the chat
    keeps the full width and its send button is on the screen."""
    result = drive(demo, "phone", screenshots)
    assert failures(result) == [], json.dumps(failures(result), indent=1)
    assert [s["step"] for s in result["steps"]] == 2 * ["fits a phone's width"]
    assert result["consoleErrors"] == []
    assert result["failedRequests"] == []


def test_edges(built_pages: Path, tmp_path_factory: pytest.TempPathFactory,
               screenshots: Path) -> None:
    """Planted HTML, a thread on the list's second page, a thread listed mid-run, an expired
    approval, a stale answer: on a server whose approvals time out in 6 s."""
    server = DemoServer(tmp_path_factory.mktemp("demo-edges"), approval_timeout=6)
    server.start()
    try:
        result = drive(server, "edges", screenshots)
    finally:
        server.stop()
    assert failures(result) == [], json.dumps(failures(result), indent=1)
    assert [s["step"] for s in result["steps"]] == 2 * [
        "planted HTML stays text", "older threads are a click away",
        "a refused run shows the runtime's words", "a thread listed mid-run shows its title",
        "a thread opened mid-answer shows the whole answer once it ends",
        "an expired approval shows its outcome", "a stale answer shows the error"]
    # The stale answer's refusal is all that may show up as an error: the current client logs
    # the run's error, the classic page's answer is a 409.
    assert [e for e in result["consoleErrors"] if "no longer asks the question" not in e["text"]
            and "status of 409" not in e["text"]] == []
    assert [r for r in result["failedRequests"]
            if not (r.get("status") == 409 and "/approvals/" in r["url"])] == []
    assert "Traceback" not in server.log(), server.log()


# -- serving, without a browser ---------------------------------------------------------------

async def _runtime(scope: Any, receive: Any, send: Any) -> None:
    await PlainTextResponse("runtime " + scope["path"])(scope, receive, send)


async def test_pages_beside_the_runtime(built_pages: Path) -> None:
    app = DemoPages(_runtime, "/api/kit", built_pages)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://demo") as client:
        page = await client.get("/")
        assert page.status_code == 200
        assert '<meta name="copilot-runtime-url" content="/api/kit" />' in page.text
        assert (await client.get("/api/kit/info")).text == "runtime /api/kit/info"
        assert (await client.get("/api/kitchen")).status_code == 404
        moved = await client.get("/classic")
        assert (moved.status_code, moved.headers["location"]) == (307, "/classic/")
        classic = await client.get("/classic/")
        assert "1.10.6" in classic.text
        assert "/api/kit" in classic.text
        asset = re.search(r'src="(/assets/[^"]+\.js)"', page.text)
        assert asset is not None
        script = await client.get(asset.group(1))
        assert script.status_code == 200
        assert "immutable" in script.headers["cache-control"]
        for missing in ("/assets/nope.js", "/assets/../index.html", "/assets/%2e%2e/index.html",
                        "/favicon.ico", "/classic/nope"):
            assert (await client.get(missing)).status_code == 404, missing


async def test_without_pages_the_api_is_served_and_says_how_to_build(tmp_path: Path) -> None:
    app = DemoPages(_runtime, "/copilotkit", tmp_path)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://demo") as client:
        hint = await client.get("/")
        assert hint.status_code == 404
        assert "npm run build" in hint.text
        assert "Node.js 20+" in hint.text
        assert (await client.get("/copilotkit/info")).text == "runtime /copilotkit/info"
        assert (await client.get("/classic/")).status_code == 404


# -- the offline model calls the page's tool --------------------------------------------------

ACCENT_TOOL = ToolSpec(
    name="set_accent_color", description="Change the accent colour of the demo page.",
    parameters={"type": "object", "required": ["color"], "properties": {
        "color": {"type": "string", "enum": ["teal", "crimson", "indigo"]}}})


async def _first_call(text: str) -> tuple[str | None, str] | None:
    request = ChatRequest(messages=[UserMessage(id="u1", role="user", content=text)],
                          tools=[ACCENT_TOOL])
    async for deltas in DemoAdapter(delay=0).stream(request):
        for delta in deltas:
            if isinstance(delta, ToolCallDelta):
                return delta.name, delta.arguments
    return None


@pytest.mark.parametrize(("text", "color"), [
    ("Set the accent colour to crimson", "crimson"),
    ("please SET the Accent color, indigo!", "indigo"),
    ("call set_accent_color", "teal"),  # no colour named: the first one
])
async def test_the_offline_model_calls_a_tool_named_in_words(text: str, color: str) -> None:
    assert await _first_call(text) == ("set_accent_color", json.dumps({"color": color},
                                                                       separators=(",", ":")))


@pytest.mark.parametrize("text", ["accent colour?", "set the colour", "color the accent set",
                                  "sets the accented colors"])
async def test_the_offline_model_leaves_tools_not_named(text: str) -> None:
    assert await _first_call(text) is None


def test_the_wheel_carries_every_built_file(built_pages: Path) -> None:
    """pyproject's package data names every file of the build (setuptools globs: `*` stays
    within one folder)."""
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["copilot_runtime"]
    files = [p.relative_to(built_pages.parent).as_posix()
             for p in built_pages.rglob("*") if p.is_file()]
    assert len(files) > 10
    missed = [f for f in files if not any(
        fnmatch.fnmatchcase(f, p) and f.count("/") == p.count("/") for p in patterns)]
    assert missed == []


async def test_pages_built_while_serving_are_served(built_pages: Path, tmp_path: Path) -> None:
    app = DemoPages(_runtime, "/copilotkit", tmp_path / "demo_web")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://demo") as client:
        assert (await client.get("/")).status_code == 404
        shutil.copytree(built_pages, tmp_path / "demo_web")
        page = await client.get("/")
        assert page.status_code == 200
        assert "copilot-runtime-url" in page.text
