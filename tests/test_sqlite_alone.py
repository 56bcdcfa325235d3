"""A SQLite thread store under a local coordinator is served by one process: its runtime holds
the file from its start (an advisory lock on `<file>.lock`, given back at its close or when the
process ends), and a runtime of another process on the same file fails to start, saying why.
Before, only `copilot-runtime serve` checked: the same app under `uvicorn --workers 2`,
gunicorn or two hosts of one disk ran a thread's runs at once, and each start closed the
other's streaming runs as interrupted.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from copilot_runtime import ConfigurationError, CopilotRuntime, thread_store

pytestmark = pytest.mark.timeout(60)

_HOLDER = textwrap.dedent("""
    import asyncio, sys
    from copilot_runtime import CopilotRuntime, thread_store

    async def main() -> None:
        runtime = CopilotRuntime(agents={}, thread_store=thread_store("sqlite:///" + sys.argv[1]))
        await runtime.start()
        print("holding", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


def _holder(path: Path) -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "holding"
    return process


def _end(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGKILL)  # however it ends, the system lets go
    process.wait(10)
    if process.stdout is not None:
        process.stdout.close()


async def test_a_second_process_on_the_file_cannot_start_until_the_first_is_gone(
        tmp_path: Path) -> None:
    path = tmp_path / "threads.db"
    holder = _holder(path)
    try:
        runtime = CopilotRuntime(agents={}, thread_store=thread_store(f"sqlite:///{path}"))
        with pytest.raises(ConfigurationError, match=r"another process serves .*threads.db "
                           r"with a local coordinator.*a file of its own, or a shared "
                           r"coordinator"):
            await runtime.start()
        assert not runtime.started
    finally:
        _end(holder)
    await runtime.start()
    await runtime.aclose()


async def test_runtimes_of_one_process_share_the_hold_and_give_it_back(
        tmp_path: Path) -> None:
    path = tmp_path / "threads.db"
    first = CopilotRuntime(agents={}, thread_store=thread_store(f"sqlite:///{path}"))
    second = CopilotRuntime(agents={}, thread_store=thread_store(f"sqlite:///{path}"))
    await first.start()
    await second.start()
    await first.aclose()
    # Still held by the second: another process cannot have it.
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([sys.executable, "-c", _HOLDER, str(path)],  # noqa: ASYNC221
                       check=True, timeout=30, capture_output=True)
    await second.aclose()
    _end(_holder(path))  # given back at the last close
