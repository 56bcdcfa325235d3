"""The `copilot-runtime` command: `serve` a runtime, or run the `demo`.

Serving a `CopilotRuntime`, the command also starts its approval service with the server
(the expiry timer, and the answers a crash left unsent) and stops it first at shutdown.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import importlib
import inspect
import json
import math
import os
import socket
import sqlite3
import sys
import threading
import unicodedata
import urllib.parse
from pathlib import Path
from typing import Any

from copilot_runtime._exceptions import ConfigurationError
from copilot_runtime._url_options import redacted_url
from copilot_runtime._version import __version__

__all__ = ["main", "worker_app"]


class CLIError(Exception):
    """A problem to report in one line, without a traceback."""


#: What goes wrong at start-up for a reason to tell in one line, without a traceback: the
#: command line, the configuration, a database file that cannot be opened.
_ONE_LINE_ERRORS = (CLIError, ConfigurationError, OSError, sqlite3.Error)
#: The base path `serve` and `demo` give the runtime unless told another.
_DEFAULT_PATH = "/copilotkit"


def _one_line(exc: Exception) -> str:
    if isinstance(exc, ConfigurationError):
        return exc.message
    if isinstance(exc, CLIError):
        return str(exc)
    return f"cannot start: {exc}"


def _load_target(target: str) -> Any:
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise CLIError(f"TARGET must look like 'module:attribute', got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # TARGET's module itself, or a package of its name, is missing; not a module that
        # TARGET's module imports (`myap`, imported by `myapp`, is not `myapp`).
        if exc.name and (module_name + ".").startswith(exc.name + "."):
            raise CLIError(f"cannot import module {module_name!r}") from None
        raise CLIError(f"importing {module_name!r} failed: {exc}") from None
    except BaseException as exc:
        # Its own error (even a BaseException), a SyntaxError, a relative name, a
        # `sys.exit`, ^C: told in one line.
        raise CLIError(_stopped(f"importing {module_name!r}", exc)) from None
    obj: Any = module
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CLIError(f"module {module_name!r} has no attribute {attribute!r}") from None
        except BaseException as exc:  # a property's own, a `sys.exit` in it
            raise CLIError(_stopped(f"reading {attribute!r} of {module_name!r}", exc)) from None
    return obj


def _stopped(doing: str, exc: BaseException) -> str:
    """Why `doing` (importing TARGET, reading it) stopped: `exc`, in a line."""
    if isinstance(exc, SystemExit):
        return f"{doing} exited (code {exc.code})"
    if isinstance(exc, KeyboardInterrupt):  # its own, or ^C: not a clean stop (code 0)
        return f"{doing} was interrupted"
    return f"{doing} failed: {type(exc).__name__}" + (f": {exc}" if str(exc) else "")


def _to_app(obj: Any, path: str, max_body_size: int) -> Any:
    from copilot_runtime.asgi import create_app
    from copilot_runtime.runtime import CopilotRuntime

    if isinstance(obj, CopilotRuntime):
        from copilot_runtime._serving import serving

        serving(obj)
        return create_app(obj, path, max_body_size=max_body_size)
    if callable(obj) and _takes_three_arguments(obj):
        return obj
    raise CLIError(f"{type(obj).__name__} is neither a CopilotRuntime nor an ASGI app")


def _takes_three_arguments(obj: Any) -> bool:
    """Whether `obj(scope, receive, send)` could be called (an ASGI 3 app)."""
    if inspect.isclass(obj):
        return False
    try:
        inspect.signature(obj).bind(None, None, None)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): let the server try it
        return True
    return True


def _check_port(host: str, port: int) -> None:
    # Not 0: the system would pick a port, which the banner's URLs could not name.
    if not 1 <= port <= 65535:
        raise CLIError(f"--port must be 1-65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise CLIError(f"port {port} on {host} is already in use") from None
            raise CLIError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def _tune_gc() -> None:
    """Keep what is loaded at start-up out of the collector's scans, and scan less often.

    Everything imported and built so far lives as long as the process; without this, at
    1,000 concurrent runs the collections scanning it took ~40% of the CPU of a run's start
    (measured: 530-660 µs a start before, ~310 after).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def _check_path(path: str) -> None:
    """Refuse a base path no request reaches: `?` and `#` end a URL's path, `%` is decoded
    before the path is matched, and a control character cannot be sent."""
    if any(char in "?#%" or unicodedata.category(char) == "Cc" for char in path):
        raise CLIError(f"--path {path!r} cannot be reached by a URL: give one without '?', "
                       "'#', '%' or control characters")
    # What a browser (or curl) rewrites before sending: the demo's pages, and the banner's
    # own URLs, would ask for another path.
    if "\\" in path or path.endswith(" ") or any(
            segment in (".", "..") for segment in path.split("/")):
        raise CLIError(f"--path {path!r} is rewritten by browsers before it is sent: give "
                       "one without '.' or '..' segments, '\\' or a trailing space")


def _serve(app: Any, host: str, port: int, log_level: str, workers: int = 1,
           limit_concurrency: int | None = None, *, lifespan: str = "on") -> None:
    """Serve `app`; `lifespan` is uvicorn's: "on" for the runtime's own app, whose start
    must succeed, "auto" for another ASGI app, which may not speak the lifespan protocol."""
    from copilot_runtime._serving import serve

    _check_port(host, port)
    if workers == 1:
        _tune_gc()
    # With several workers, each imports `worker_app`, which builds its own runtime from the
    # target named in the environment; they share one listening socket.
    limits = {} if limit_concurrency is None else {"limit_concurrency": limit_concurrency}
    serve(app, workers, host=host, port=port, log_level=log_level, lifespan=lifespan,
          **limits)


#: How `serve --workers N` tells its worker processes what to serve.
_WORKER_ENV = "COPILOT_RUNTIME_SERVE"


def worker_app() -> Any:
    """The app of one `serve --workers N` process (uvicorn calls it in each worker)."""
    from copilot_runtime._serving import STARTUP_FAILURE, die_with_supervisor

    die_with_supervisor()
    target, path, max_body_size, log_level = json.loads(os.environ[_WORKER_ENV])
    _configure_logging(log_level)
    try:
        app = _to_app(_load_target(target), path, max_body_size)
    except _ONE_LINE_ERRORS as exc:
        # One line, and every worker stops: it would fail the same way each time.
        print(f"copilot-runtime: error: {_one_line(exc)}", file=sys.stderr, flush=True)
        sys.exit(STARTUP_FAILURE)
    _tune_gc()
    return app


def _stderr_kept_if_closed() -> None:
    """With stderr closed (`2>&-`), what goes there goes to /dev/null, on descriptor 2: else
    the first write failed the command without a word, and a socket the server opens could
    take descriptor 2, a worker's or a library's writes to stderr reaching a client."""
    if sys.stderr is not None:
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.fstat(2)
    except OSError:  # closed: /dev/null takes its place (the workers inherit it)
        os.dup2(devnull, 2)
        os.close(devnull)
        devnull = 2
    sys.stderr = open(devnull, "w", errors="backslashreplace")  # noqa: SIM115 - kept open


def _configure_logging(level: str) -> None:
    """The runtime's own logs at `--log-level`, on stderr as uvicorn's are, through the
    redacting set-up: JSON lines, or readable ones on a terminal (structlog's defaults were
    every level, on stdout, unredacted)."""
    import logging

    import structlog

    from copilot_runtime.telemetry import configure_logging

    configure_logging(json=not sys.stderr.isatty(), level=logging.getLevelName(level.upper()))
    structlog.configure(logger_factory=lambda *args: _LineLogger(sys.stderr))


_LINES = threading.Lock()


class _LineLogger:
    """structlog's `PrintLogger`, except that a line stderr cannot take is lost, not raised:
    a terminal gone (SIGHUP), a full pipe or a closed one raised in the code that logged,
    and a run cut at shutdown, logging it, then ended its stream without its last event."""

    def __init__(self, file: Any) -> None:
        self._file = file

    def msg(self, message: str) -> None:
        # (ValueError: the file was closed; the lock keeps threads' lines whole)
        with _LINES, contextlib.suppress(OSError, ValueError):
            print(message, file=self._file, flush=True)

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


#: What gives back the SQLite files this process holds (see `_serve_alone`): never called.
_held: list[Any] = []


def _serve_alone(target: Any, workers: int, advice: str) -> None:
    """With a local coordinator, a SQLite thread store is served by one process alone: a
    second one (another demo on the same file, or a worker) would run a thread's runs at
    once, their events stored over each other. Held through an advisory lock on
    `<file>.lock`, which the system gives back when the process ends, however it ends."""
    from copilot_runtime.runtime import CopilotRuntime
    from copilot_runtime.threads.sqlite import SQLiteThreadStore

    if not isinstance(target, CopilotRuntime) or target.coordinator.shared or \
            not isinstance(target.store, SQLiteThreadStore) or target.store.path == ":memory:":
        return
    path = target.store.path
    shared = f"give the runtime a shared coordinator ({advice}; README: Many workers, " \
             "several machines)"
    if workers > 1:
        raise CLIError(f"--workers {workers} with a SQLite thread store and a local "
                       f"coordinator would run a thread's runs at once: serve one worker, or "
                       f"{shared}")
    try:
        # Held until the process ends (the runtime's own hold, at its start, shares it).
        _held.append(target.store.serve_alone())
    except ConfigurationError:
        raise CLIError(f"another process serves {path} with a local coordinator, and two "
                       f"would run a thread's runs at once: give this one another file, or "
                       f"{shared}") from None


def _warn_unshared(target: Any, workers: int) -> None:
    """Several workers with a runtime that keeps its runs (or threads) to one process serve,
    but each worker sees only its own: say so before it surprises anyone."""
    from copilot_runtime.runtime import CopilotRuntime
    from copilot_runtime.threads import InMemoryThreadStore

    if not isinstance(target, CopilotRuntime) or target.coordinator.shared:
        return
    lines = [f"copilot-runtime: warning: --workers {workers} with a local coordinator: a "
             "thread's second run is refused, and connect and stop reach a run, only on the "
             "worker that runs it; give the runtime coordinator='postgresql://...' or "
             "'redis://...' (README: Many workers, several machines)"]
    if isinstance(target.store, InMemoryThreadStore):
        lines.append("copilot-runtime: warning: threads kept in memory are each worker's "
                     "own; give the runtime thread_store=thread_store('postgresql://...')")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _warn_exposed(host: str, port: int, what: str, advice: str = "") -> None:
    """Say so when a runtime without authentication listens beyond this machine."""
    import ipaddress

    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host or None, port,
                                                               type=socket.SOCK_STREAM)}
        local = all(ipaddress.ip_address(str(a).partition("%")[0]).is_loopback
                    for a in addresses)
    except (OSError, ValueError):
        local = False
    if host and local:
        return
    print(f"copilot-runtime: warning: {what} has no authentication and listens on "
          f"{_url_host(host)}:{port}, beyond this machine: anyone who reaches it can run its "
          f"agents (and spend their model keys); use --host 127.0.0.1{advice}",
          file=sys.stderr, flush=True)


def _url_host(host: str) -> str:
    """`host` as a URL writes it: an IPv6 address in brackets, all interfaces as 0.0.0.0."""
    if not host:
        return "0.0.0.0"
    return f"[{host}]" if ":" in host else host


def _app_served(target: str, host: str, port: int, path: str) -> str:
    """What `serve` says of an ASGI app of the user's: where it is, not the runtime's routes
    (it serves its own), and that `--path` does not apply to it."""
    said = f"copilot-runtime {__version__} serving {target} at http://{_url_host(host)}:{port}/"
    if path != _DEFAULT_PATH:
        said += "\n--path applies to a CopilotRuntime only: this ASGI app serves its own routes"
    return said


def _print_next_steps(host: str, port: int, path: str, model: str | None,
                      workflows: str | None = None, notice: str | None = None) -> None:
    base = "/" + path.strip("/") if path.strip("/") else ""  # as create_app reads it
    # (percent-encoded: a path with a space made each curl line two URLs)
    url = f"http://{_url_host(host)}:{port}{urllib.parse.quote(base)}"
    lines = [
        f"copilot-runtime {__version__} serving {url}",
    ]
    if model:
        lines.append(f"default agent: {model}")
    if workflows:
        lines.append(workflows)
    if notice:
        lines.append(notice)
    lines += [
        "try:",
        f"  curl {url}/info",
        f"  curl -N -X POST {url}/agent/default/run -H 'Content-Type: application/json' \\",
        "    -d '{\"threadId\":\"t1\",\"runId\":\"r1\",\"messages\":[{\"id\":\"m1\","
        "\"role\":\"user\",\"content\":\"What is the weather in Paris?\"}]}'",
        f"React: <CopilotKit runtimeUrl=\"{url}\"> (any react-core: 1.50+ speak AG-UI, "
        "older ones GraphQL)",
    ]
    if workflows:
        lines += [
            "human in the loop: run agent review_loop or account_review, then",
            f"  curl {url}/approvals",
            f"  curl -X POST {url}/approvals/<id> -H 'Content-Type: application/json' "
            "-d '{\"action\":\"approve\"}'",
        ]
    _say("\n".join(lines))


def _say(text: str) -> None:
    """`text` on stdout; a reader gone (`demo | head -1`) does not stop the server."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # What is left, and what follows, goes nowhere (Python's own advice: else the
        # buffer fails again at exit).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _checkpoints_beside(db: str) -> str:
    """The demo's checkpoint URL: a SQLite file next to its thread database."""
    if db == ":memory:":
        return "memory"
    beside = str(Path(db).with_name(Path(db).stem + ".checkpoints.sqlite3"))
    # The URL's reader decodes %XX and ends the path at "?": quoted, both stay in the name
    # (not urllib.parse.quote: a name that is not UTF-8 would not round-trip).
    return "sqlite:///" + beside.replace("%", "%25").replace("?", "%3F")


def _default_checkpoints(store: Any, threads: str | None) -> str:
    """Where the demo keeps its checkpoints unless told: with its threads (the same
    PostgreSQL database, a SQLite file beside theirs, or memory). Beside the thread store's
    file, not in the working directory: started from another, the demo lost its approvals."""
    from copilot_runtime.threads.sqlite import SQLiteThreadStore

    if threads and threads.lower().startswith(("postgresql:", "postgres:")):
        return threads
    if isinstance(store, SQLiteThreadStore):
        return _checkpoints_beside(store.path)
    return "memory"  # the threads are in memory too


def _thread_store(url: str) -> Any:
    from copilot_runtime.threads import thread_store

    return thread_store(url)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _setting(name: str) -> str | None:
    """An environment variable standing for a flag: an empty or blank one (`NAME=` left in
    a .env or compose file) counts as unset, and spaces around a value are not part of it."""
    value = os.environ.get(name, "").strip()
    return value or None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="copilot-runtime",
                                     description="The CopilotKit runtime, in Python.")
    parser.add_argument("--version", action="version", version=__version__)
    commands = parser.add_subparsers(dest="command", required=True)

    def common(sub: argparse.ArgumentParser, port: int) -> None:
        sub.add_argument("--host", default="127.0.0.1",
                         help="address to listen on (default: %(default)s)")
        sub.add_argument("--port", type=int, default=port,
                         help="port to listen on, 1-65535 (default: %(default)s)")
        sub.add_argument("--path", default=_DEFAULT_PATH,
                         help="base path of the runtime (default: %(default)s)")
        sub.add_argument("--log-level", default="warning",
                         choices=["critical", "error", "warning", "info", "debug"],
                         help="the runtime's and the server's logs, on stderr "
                              "(default: %(default)s)")
        sub.add_argument("--max-body-size", type=int, default=8 * 1024 * 1024,
                         help="largest request body accepted, in bytes (default: %(default)s)")
        sub.add_argument("--limit-concurrency", type=int, default=None, metavar="N",
                         help="most connections (and requests in flight) a worker holds: "
                              "past it, requests are answered 503 and new connections "
                              "closed with a 503 (default: 2048, or three quarters of the "
                              "open-file limit if lower)")

    serve = commands.add_parser("serve", help="serve a CopilotRuntime or an ASGI app")
    serve.add_argument("target", metavar="TARGET",
                       help="module:attribute naming a CopilotRuntime or an ASGI app")
    serve.add_argument("--workers", type=int, default=1,
                       help="worker processes sharing the port, each importing TARGET "
                            "(with more than one, give the runtime a shared thread store "
                            "and coordinator; default: %(default)s)")
    common(serve, 8000)
    demo = commands.add_parser("demo", help="serve the demo runtime")
    common(demo, 8000)
    demo.add_argument("--db",
                      default=_setting("COPILOT_RUNTIME_DB") or "copilot-runtime-demo.sqlite3",
                      help="SQLite file for threads (':memory:' keeps nothing; default: "
                           "$COPILOT_RUNTIME_DB, else copilot-runtime-demo.sqlite3)")
    demo.add_argument("--checkpoints", default=_setting("COPILOT_RUNTIME_CHECKPOINTS"),
                      help="where the workflows keep their graphs and approvals: a "
                           "sqlite:///path, postgresql://... or memory URL (default: "
                           "$COPILOT_RUNTIME_CHECKPOINTS, else with the threads: a SQLite "
                           "file beside theirs, their PostgreSQL database, or memory)")
    demo.add_argument("--threads", default=_setting("COPILOT_RUNTIME_THREADS"),
                      help="where threads live, as a thread store URL (sqlite:///path, "
                           "postgresql://...?schema=NAME, memory://); overrides --db "
                           "(default: $COPILOT_RUNTIME_THREADS)")
    demo.add_argument("--coordinator", default=_setting("COPILOT_RUNTIME_COORDINATOR"),
                      help="how workers share runs: local, postgresql://... or "
                           "redis://... (see copilot_runtime.coordination; default: "
                           "$COPILOT_RUNTIME_COORDINATOR, else local)")
    demo.add_argument("--approval-timeout", type=_positive_seconds, default=300.0,
                      help="seconds before an account_review approval times out "
                           "(default: %(default)s)")
    _stderr_kept_if_closed()
    args = parser.parse_args(argv)
    _configure_logging(args.log_level)
    workers = 1
    lifespan = "on"

    try:
        if args.max_body_size < 1:
            raise CLIError(f"--max-body-size must be a positive number of bytes, "
                           f"got {args.max_body_size}")
        if args.limit_concurrency is not None and args.limit_concurrency < 1:
            raise CLIError(f"--limit-concurrency must be at least 1, "
                           f"got {args.limit_concurrency}")
        _check_path(args.path)
        if args.command == "serve":
            workers = args.workers
            if workers < 1:
                raise CLIError("--workers must be at least 1")
            target = _load_target(args.target)
            app = _to_app(target, args.path, args.max_body_size)
            _serve_alone(target, workers, "coordinator='redis://...' or 'postgresql://...'")
            if workers > 1:
                _warn_unshared(target, workers)
                os.environ[_WORKER_ENV] = json.dumps(
                    [args.target, args.path, args.max_body_size, args.log_level])
                app = None  # each worker builds its own
            _check_port(args.host, args.port)
            from copilot_runtime.runtime import CopilotRuntime

            if not isinstance(target, CopilotRuntime):
                lifespan = "auto"  # as uvicorn serves it: its lifespan, if it has one
                _say(_app_served(args.target, args.host, args.port, args.path))
            else:
                if target.auth is None:
                    _warn_exposed(args.host, args.port, "the runtime", ", or give it auth= "
                                  "(README: Many users on one runtime)")
                _print_next_steps(args.host, args.port, args.path, None)
        else:
            from copilot_runtime.demo import (
                WORKFLOWS_NEED_EXTRA,
                build_demo_runtime,
                missing_workflow_dependency,
            )

            _check_port(args.host, args.port)
            _warn_exposed(args.host, args.port, "the demo")
            base = "/" + args.path.strip("/")
            if base == "/" or base.split("/")[1] in ("classic", "assets"):
                raise CLIError(f"--path {args.path!r} would hide the demo's pages: give "
                               "another base path (the default is /copilotkit)")
            if args.db == "" and not args.threads:
                raise CLIError("--db must name a file, or ':memory:'")
            store = None
            if args.threads:
                store = _thread_store(args.threads)
            elif args.db != ":memory:":
                from copilot_runtime.threads.sqlite import SQLiteThreadStore

                store = SQLiteThreadStore(args.db)
            checkpoints = args.checkpoints or _default_checkpoints(store, args.threads)
            runtime, model = build_demo_runtime(store, checkpoints=checkpoints,
                                                approval_timeout=args.approval_timeout,
                                                coordinator=args.coordinator)
            _serve_alone(runtime, 1, "--coordinator redis://... or postgresql://...")
            from copilot_runtime.demo_pages import DemoPages, binds_loopback, pages_note
            from copilot_runtime.protocols.http import CORSPolicy

            runtime_app = _to_app(runtime, args.path, args.max_body_size)
            # Its pages are same-origin: no CORS, so no other site's page may call it.
            runtime_app.cors = CORSPolicy(origins=())
            app = DemoPages(runtime_app, args.path,
                            loopback_hosts_only=binds_loopback(args.host))
            workflows = sorted(set(runtime.agents) - {"default"})
            missing = None if workflows else missing_workflow_dependency()
            _print_next_steps(args.host, args.port, args.path, model,
                              f"workflows: {', '.join(workflows)} (checkpoints: "
                              f"{redacted_url(checkpoints)})" if workflows else None,
                              f"{WORKFLOWS_NEED_EXTRA} (missing: {missing})" if missing
                              else None)
            _say(pages_note(app, _url_host(args.host), args.port))
        _serve(app, args.host, args.port, args.log_level, workers, args.limit_concurrency,
               lifespan=lifespan)
    except _ONE_LINE_ERRORS as exc:
        print(f"copilot-runtime: error: {_one_line(exc)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        pass
