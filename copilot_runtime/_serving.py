"""How the command line runs uvicorn, with what uvicorn leaves out:

- a supervisor whose workers could not start exits non-zero (uvicorn exits 0 unless it
  serves in one process), and a worker that cannot build its app stops them all (it was
  started again, and failed again, for ever);
- workers die with their supervisor, even killed (Linux: else they go on holding the port);
- runs end as soon as shutdown begins, each client hearing its RUN_ERROR on a complete
  stream, instead of being cut after the grace period.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import TYPE_CHECKING, Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

if TYPE_CHECKING:
    from copilot_runtime.runtime import CopilotRuntime

__all__ = ["STARTUP_FAILURE", "die_with_supervisor", "serve", "serving"]

#: uvicorn's exit code for a server that could not start: a worker exiting with it stops
#: the supervisor instead of being started again.
STARTUP_FAILURE = 3
#: The supervisor's pid, for a worker to see whether it is still there.
_SUPERVISOR_ENV = "COPILOT_RUNTIME_SUPERVISOR"
#: The runtimes this process serves, whose runs are stopped when shutdown begins.
_served: list[CopilotRuntime] = []


def serving(runtime: CopilotRuntime) -> None:
    """Stop `runtime`'s runs as soon as the server begins to shut down."""
    _served.append(runtime)


class _StopRunsFirst(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's HTTP protocol, which it tells of a shutdown before its grace period: the
    runs end then, so their streams complete (cut by the grace, a client heard no end)."""

    def shutdown(self) -> None:
        super().shutdown()
        while _served:  # once, whatever the number of connections
            _served.pop().runs.stop_all()


def serve(app: Any, workers: int, **options: Any) -> None:
    """Serve `app` (None with several workers: each builds its own) until a signal."""
    options.update(http=_StopRunsFirst, access_log=False, lifespan="on",
                   timeout_graceful_shutdown=5,
                   # the runtime serves no WebSocket, and `websockets` costs each worker ~2 MB
                   ws="none")
    if workers == 1:
        server = uvicorn.Server(uvicorn.Config(app, **options))
        server.run()
        if not server.started:
            sys.exit(STARTUP_FAILURE)
        return
    from uvicorn.supervisors import Multiprocess

    config = uvicorn.Config("copilot_runtime.cli:worker_app", factory=True, workers=workers,
                            **options)
    os.environ[_SUPERVISOR_ENV] = str(os.getpid())
    supervisor = Multiprocess(config, sockets=[config.bind_socket()])
    supervisor.run()
    if any(process.exitcode == STARTUP_FAILURE for process in supervisor.processes):
        sys.exit(STARTUP_FAILURE)


def die_with_supervisor() -> None:
    """Be sent SIGTERM (a graceful shutdown) when the supervisor dies, even by SIGKILL. Linux
    only: elsewhere a worker outlives a killed supervisor."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    supervisor = os.environ.get(_SUPERVISOR_ENV)
    if supervisor and os.getppid() != int(supervisor):  # it died before we asked
        os.kill(os.getpid(), signal.SIGTERM)
