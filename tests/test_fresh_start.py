"""The install paths a newcomer takes, from nothing.

* Each extra of `pyproject.toml` (and none) in a fresh virtual environment holding only the
  package and that extra: no test dependency can hide a missing requirement.
* The README's first command, as written, from a fresh `git clone` of HEAD.

The extras' environments are made by `uv` (resolving from the same index, to the same
newest releases pip would pick): a few seconds for all of them, where pip took over a minute.
The fresh clone installs itself with pip, exactly as the README says.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx2
import orjson
import pytest

from tests.conftest import free_port, parse_sse

ROOT = Path(__file__).resolve().parent.parent
CHECK = Path(__file__).resolve().parent / "fresh_start" / "check_extra.py"
INSTALL_TIMEOUT = 420
pytestmark = pytest.mark.timeout(INSTALL_TIMEOUT + 120)


def extras() -> list[str]:
    """Every extra a user may install ("" for none); `test` is the suite's own."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    return ["", *sorted(name for name in declared if name != "test")]


def _run(args: list[str], *, cwd: Path | None = None, timeout: float = INSTALL_TIMEOUT,
         env: dict[str, str] | None = None) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                    f"{done.stderr[-3000:]}", pytrace=False)
    return done.stdout


def _clean_env() -> dict[str, str]:
    """The environment of a newcomer's shell: no key, no virtual environment of ours."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OPENAI_", "ANTHROPIC_", "GOOGLE_", "GEMINI_", "VIRTUAL_ENV",
                                "COPILOT_RUNTIME_", "PYTHON"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if ".venv" not in p)
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package as pip would get it from an index, built once."""
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy: a build in the checkout would leave build/ behind in it.
    source = tmp_path_factory.mktemp("source") / "copilot-runtime"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".*", "build", "*.egg-info", "node_modules", "tests", "bench", "docs", "web"))
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out),
          str(source)], env=_clean_env())
    (built,) = out.glob("copilot_runtime-*.whl")
    return built


@pytest.fixture(scope="module")
def environments(wheel: Path, tmp_path_factory: pytest.TempPathFactory,
                 fresh_clone: Serving) -> Iterator[dict[str, Future[tuple[Path, str]]]]:
    """One fresh virtual environment per extra, installed and checked two at a time (while
    the fresh clone installs itself): each, and what its check printed."""
    base = tmp_path_factory.mktemp("venvs")

    uv = Path(sys.executable).parent / "uv"

    def install_and_check(extra: str) -> tuple[Path, str]:
        venv = base / (extra or "base")
        _run([str(uv), "venv", "--quiet", "--python", sys.executable, str(venv)],
             env=_clean_env())
        requirement = f"{wheel}[{extra}]" if extra else str(wheel)
        _run([str(uv), "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"),
              requirement], env=_clean_env())
        return venv, _run([str(venv / "bin" / "python"), str(CHECK), extra], cwd=venv,
                          timeout=120, env=_clean_env())

    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {extra: pool.submit(install_and_check, extra) for extra in extras()}


def test_every_extra_has_a_check() -> None:
    source = CHECK.read_text()
    checked = set(re.findall(r'^    "(\w*)": check_\w+,$', source, re.MULTILINE))
    assert checked == set(extras()), "add a check to tests/fresh_start/check_extra.py"


@pytest.mark.parametrize("extra", extras())
def test_extra_installs_and_works_alone(extra: str,
                                        environments: dict[str, Future[tuple[Path, str]]]
                                        ) -> None:
    _, out = environments[extra].result(timeout=INSTALL_TIMEOUT + 120)
    assert out.strip().endswith(f"ok {extra or 'base'}")


@dataclass
class Serving:
    """A command that serves the runtime on `port`, started in the background."""

    args: list[str]
    process: subprocess.Popen[bytes]
    log: Path
    port: int

    def wait(self, timeout: float) -> list[str]:
        """The lines it printed, once `/info` answers."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                pytest.fail(f"{' '.join(self.args)} exited with {self.process.returncode}:\n"
                            f"{self.log.read_text()[-4000:]}", pytrace=False)
            if time.monotonic() > deadline:
                pytest.fail(f"{' '.join(self.args)} did not serve within {timeout:.0f} s:\n"
                            f"{self.log.read_text()[-4000:]}", pytrace=False)
            with contextlib.suppress(httpx2.TransportError):
                if httpx2.get(f"http://127.0.0.1:{self.port}/copilotkit/info",
                              timeout=2).status_code == 200:
                    return self.log.read_text().splitlines()
            time.sleep(0.5)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=5)


@contextlib.contextmanager
def _serving(args: list[str], cwd: Path) -> Iterator[Serving]:
    port = free_port()
    log = cwd / f"serve-{port}.log"
    with log.open("w") as out:
        process = subprocess.Popen([*args, "--port", str(port)], cwd=cwd, stdout=out,
                                   stderr=subprocess.STDOUT, env=_clean_env(),
                                   start_new_session=True)
    serving = Serving(args, process, log, port)
    try:
        yield serving
    finally:
        serving.stop()


@pytest.fixture(scope="module")
def fresh_clone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    """The README's first command, started from a fresh clone as soon as the module needs
    it (it installs while the extras' environments do)."""
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"```bash\n(\S+)", readme)
    assert first is not None
    command = first.group(1)
    assert command == "./scripts/demo.sh"
    clone = tmp_path_factory.mktemp("fresh") / "clone"
    _run(["git", "clone", "--quiet", str(ROOT), str(clone)], timeout=120, env=_clean_env())
    with _serving([command], clone) as serving:
        yield serving


def test_demo_without_extras_says_which_extra_adds_the_workflows(
        environments: dict[str, Future[tuple[Path, str]]]) -> None:
    venv, _ = environments[""].result(timeout=INSTALL_TIMEOUT + 120)
    with _serving([str(venv / "bin" / "copilot-runtime"), "demo", "--db", ":memory:"],
                  venv) as serving:
        printed = serving.wait(60)
        info = httpx2.get(f"http://127.0.0.1:{serving.port}/copilotkit/info",
                          timeout=5).json()
    assert set(info["agents"]) == {"default"}
    assert not any("Traceback" in line for line in printed), printed
    notices = [line for line in printed if "extra" in line]
    assert notices == ["the review_loop and account_review workflows need the langgraph "
                       "extra: pip install 'copilot-runtime[langgraph]' (missing: "
                       "ag_ui_langgraph)"], printed


def test_readme_first_command_from_a_fresh_clone(fresh_clone: Serving) -> None:
    printed = fresh_clone.wait(INSTALL_TIMEOUT)
    base = f"http://127.0.0.1:{fresh_clone.port}/copilotkit"
    info = httpx2.get(f"{base}/info", timeout=5).json()
    assert {"default", "review_loop", "account_review"} <= set(info["agents"])
    body = {"threadId": "fresh-1", "runId": "r1", "state": {}, "tools": [],
            "context": [], "forwardedProps": {},
            "messages": [{"id": "m1", "role": "user",
                          "content": "What is the weather in Paris?"}]}
    answer = httpx2.post(f"{base}/agent/default/run", json=body, timeout=60,
                         headers={"Accept": "text/event-stream"})
    assert answer.status_code == 200, answer.text
    events = parse_sse(answer.content)
    kinds = [event["type"] for event in events]
    assert kinds[-1] == "RUN_FINISHED", kinds
    result_at = kinds.index("TOOL_CALL_RESULT")
    assert "TEXT_MESSAGE_CONTENT" in kinds[result_at:], kinds
    query = {"query": "query { availableAgents { agents { name id description } } }"}
    graphql = httpx2.post(base, json=query, timeout=10)
    assert graphql.status_code == 200, graphql.text
    names = {a["name"] for a in orjson.loads(graphql.content)["data"]["availableAgents"][
        "agents"]}
    assert {"review_loop", "account_review"} <= names
    assert not any("Traceback" in line for line in printed), printed
