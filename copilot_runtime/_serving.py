"""How the command line runs uvicorn, with what uvicorn leaves out:

- a supervisor whose workers could not start exits non-zero (uvicorn exits 0 unless it
  serves in one process), and a worker that cannot build its app stops them all (it was
  started again, and failed again, for ever);
- workers die with their supervisor, even killed (Linux: else they go on holding the port);
- runs end as soon as shutdown begins, each client hearing its RUN_ERROR on a complete
  stream, instead of being cut after the grace period;
- a connection has `HEADERS_SECONDS` to send a request's headers (uvicorn waits for ever
  before the first request, and once a next request's first byte came): idle or trickling
  sockets no longer hold their file descriptors for ever; and `MAX_HEADER_BYTES` for them
  (uvicorn's httptools protocol keeps every header it is sent: a few requests of hundreds of
  megabytes of headers held gigabytes), past which it is answered 431 and closed; a chunked
  body's trailer section (and any framing between its data) has the same bound;
- a connection whose writes have waited `WRITE_STALL_SECONDS` on a client that reads nothing
  is aborted (asyncio's `close` waits for the client to read what is buffered, for ever), as
  is one the app gives up on (`ABORT_EXTENSION`): at once, its buffers freed, no ERROR line;
- an HTTP/1.0 request's answer of no known length (a stream) ends with its connection, as
  RFC 9112 asks: uvicorn's httptools protocol chunked it whatever the version, and a 1.0
  client read the chunk sizes as data;
- at most `limit_concurrency` connections are held (`--limit-concurrency`): one more is
  answered 503 and closed at once, so idle sockets cannot exhaust the process's descriptors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import resource
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.supervisors.multiprocess import Multiprocess, Process

from copilot_runtime.protocols.http import ABORT_EXTENSION

if TYPE_CHECKING:
    from copilot_runtime.runtime import CopilotRuntime

__all__ = ["HEADERS_SECONDS", "MAX_HEADER_BYTES", "STARTUP_FAILURE", "WRITE_STALL_SECONDS",
           "default_connection_limit", "die_with_supervisor", "serve", "serving"]

#: uvicorn's exit code for a server that could not start: a worker exiting with it stops
#: the supervisor instead of being started again.
STARTUP_FAILURE = 3
#: The supervisor's pid, for a worker to see whether it is still there.
_SUPERVISOR_ENV = "COPILOT_RUNTIME_SUPERVISOR"
logger = logging.getLogger("uvicorn.error")
#: The runtimes this process serves, whose runs are stopped when shutdown begins.
_served: list[CopilotRuntime] = []


def serving(runtime: CopilotRuntime) -> None:
    """Stop `runtime`'s runs as soon as the server begins to shut down."""
    _served.append(runtime)


#: The longest a connection may take to send a request's headers, from its opening or from
#: the end of its previous answer (idle between requests, uvicorn's keep-alive timeout of 5 s
#: closes it first). Past it the connection is closed, answered 408 if part of a request came.
HEADERS_SECONDS = 10.0
#: The most bytes a request's line and headers may take (Node's and uvicorn's h11 limit is
#: 16 KiB; big cookies and tokens fit well within this).
MAX_HEADER_BYTES = 64 * 1024
#: The longest a connection's writes may wait on a client that reads nothing (its socket
#: and the transport's buffer full) before the connection is aborted: what
#: `protocols.http.SEND_IDLE_SECONDS` allows a stream, for every answer.
WRITE_STALL_SECONDS = 30.0
#: The most connections a server holds unless told (`--limit-concurrency`), lowered to three
#: quarters of the process's open-file limit: the rest is for upstream and store sockets.
CONNECTION_LIMIT = 2048


try:  # the kernel's unsent bytes of a socket (Linux; elsewhere the transport's buffer alone)
    import fcntl
    import termios

    _OUTQ: int | None = termios.TIOCOUTQ if sys.platform.startswith("linux") else None
except ImportError:  # pragma: no cover - Windows
    _OUTQ = None


def _answer(status: bytes, headers: bytes, error: bytes) -> bytes:
    """A whole HTTP answer that closes the connection, written before any request was read."""
    body = b'{"error":"%b"}' % error
    return (b"HTTP/1.1 %b\r\ncontent-type: application/json\r\n%bconnection: close\r\n"
            b"content-length: %d\r\n\r\n%b" % (status, headers, len(body), body))


_TOO_MANY = _answer(b"503 Service Unavailable", b"retry-after: 1\r\n",
                    b"Too many open connections")
_TOO_SLOW = _answer(b"408 Request Timeout", b"", b"Request headers took too long")
_TOO_LARGE = _answer(b"431 Request Header Fields Too Large", b"",
                     b"Request headers are too large")
#: Whether the protocol is httptools', whose callbacks tell where a body is (uvicorn's h11
#: protocol bounds a request's headers itself).
_PARSER_COUNTED = AutoHTTPProtocol.__name__ == "HttpToolsProtocol"


class _HeadersTooLarge(Exception):
    """A request's headers passed `MAX_HEADER_BYTES` (raised to stop the parser)."""


def default_connection_limit() -> int:
    """`CONNECTION_LIMIT`, or three quarters of the open-file limit if that is lower."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return CONNECTION_LIMIT
    return max(1, min(CONNECTION_LIMIT, soft * 3 // 4))


def _end_by_closing(cycle: Any) -> None:
    """Have uvicorn's `cycle` (an HTTP/1.0 request's: its connection closes after it) send
    an answer without a length as the bytes the connection carries until it closes, where it
    would chunk them: it writes a body as is once it is not chunking, counting it down from
    `expected_content_length`, which is given each piece's length."""
    send = cycle.send
    unframed = False

    async def send_until_closed(message: dict[str, Any]) -> None:
        nonlocal unframed
        if message["type"] == "http.response.start":
            unframed = _chunked_by_uvicorn(cycle.scope["method"], message)
            if unframed:
                cycle.chunked_encoding = False
        elif unframed and message["type"] == "http.response.body":
            cycle.expected_content_length = len(message.get("body", b""))
        await send(message)

    # (uvicorn's task looks `send` up once it runs: created, not started yet)
    cycle.send = send_until_closed


def _chunked_by_uvicorn(method: str, start: dict[str, Any]) -> bool:
    """Whether uvicorn chunks the answer `start` begins: it has a body and no length."""
    return method != "HEAD" and start["status"] not in (204, 304) and not any(
        name.lower() in (b"content-length", b"transfer-encoding")
        for name, _ in start.get("headers", ()))


class _StopRunsFirst(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's HTTP protocol, which it tells of a shutdown before its grace period: the
    runs end then, so their streams complete (cut by the grace, a client heard no end).
    It also bounds what a client that sends or reads nothing can hold (see the module)."""

    _headers_timer: asyncio.TimerHandle | None = None
    _write_timer: asyncio.TimerHandle | None = None
    #: Waiting for a request's headers, since `_since` (loop time).
    _awaiting = False
    _since = 0.0
    #: Bytes of a request whose headers are not complete yet came.
    _heard = False
    #: The bytes of the request's line and headers so far, and whether they were too many.
    _header_bytes = 0
    _headers_too_large = False
    #: The bytes received since the last request's headers came, outside its body (a line
    #: httptools has not finished, which `on_header` does not see yet), or in a body since
    #: its last data (a chunk's size line, the trailer section); whether the parser is in a
    #: body, whether a request ended, and whether body data came, in the bytes being parsed.
    _unparsed_bytes = 0
    _in_body = False
    _message_ended = False
    _body_came = False
    #: What was still to send when `_write_timer` was set.
    _pending = 0

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        limit = self.config.limit_concurrency
        if limit is not None and len(self.connections) > limit:
            transport.write(_TOO_MANY)
            transport.close()
            return
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._headers_too_large:
            return  # answered 431: parsed no further
        cycle = self.cycle
        self._message_ended = self._body_came = False
        super().data_received(data)
        if self.cycle is not cycle and self.cycle is not None:  # a request's headers came
            self.cycle.scope.setdefault("extensions", {})[ABORT_EXTENSION] = self.give_up
            self._awaiting = False
            self._unparsed_bytes = 0
            return
        if self._awaiting:
            self._heard = True
        if not _PARSER_COUNTED or self._message_ended:
            return
        if self._in_body and self._body_came:
            self._unparsed_bytes = 0  # data came: a chunk's framing is counted from there
        else:
            self._count_unparsed(len(data))

    # A request's line and headers, counted as the parser reads them (httptools; uvicorn's
    # h11 protocol bounds them itself): past `MAX_HEADER_BYTES` the parse stops and the
    # request is answered 431 (the body of an earlier request answered early is not counted).
    # httptools hands a header over only once its line ends, joining the line's pieces
    # until then (quadratic: a line of megabytes stalls the loop), so the bytes received
    # while it reads a request's line and headers are counted too. So are, in a chunked
    # body, the bytes that came without data (httptools calls nothing for them): a trailer
    # line is joined the same way, and the trailer section is otherwise unbounded.

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0

    def on_headers_complete(self) -> None:
        self._in_body = True
        super().on_headers_complete()
        if self.scope.get("http_version") == "1.0" and self.cycle is not None:
            _end_by_closing(self.cycle)

    def on_body(self, body: bytes) -> None:
        self._body_came = True
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body, self._message_ended, self._unparsed_bytes = False, True, 0
        super().on_message_complete()

    def _count_unparsed(self, size: int) -> None:
        self._unparsed_bytes += size
        if self._unparsed_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
            self._headers_too_large = True
            self._refuse_headers()

    def on_url(self, url: bytes) -> None:
        self._count_header(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header(len(name) + len(value))
        super().on_header(name, value)

    def _count_header(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > MAX_HEADER_BYTES:
            self._headers_too_large = True
            raise _HeadersTooLarge  # (the parser's error: answered by `send_400_response`)

    def send_400_response(self, msg: str) -> None:
        if not self._headers_too_large:
            super().send_400_response(msg)
            return
        self._refuse_headers()

    def _refuse_headers(self) -> None:
        """Answer 431 and close: aborted instead while an earlier request's answer, or
        this one's (its trailers too large), is being written or is still to come (a 431
        inside it, or before it, would be read as its answer)."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not (
                self._in_body and not cycle.response_started and not self.pipeline):
            self.give_up()
            return
        self._stop_timers()
        self.transport.write(_TOO_LARGE)
        self.transport.close()
        self._watch_writes()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if (self.cycle is None or self.cycle.response_complete) \
                and not self.transport.is_closing():
            self._await_headers()  # the next request's (none pipelined)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._watch_writes()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None and not self.transport.is_closing():
            self._write_timer.cancel()
            self._write_timer = None

    def timeout_keep_alive_handler(self) -> None:
        super().timeout_keep_alive_handler()
        self._watch_writes()  # closed: what it had not read yet must still drain

    def give_up(self) -> None:
        """Abort the connection: its buffers dropped, its request told it is gone."""
        self._stop_timers()
        self.transport.abort()

    def _watch_writes(self) -> None:
        """Give up on the connection if what it has to send stops draining (its writes
        paused, or it is closed with bytes still to send) for `WRITE_STALL_SECONDS`; a
        client that reads, however slowly, is not cut (streams have `SEND_IDLE_SECONDS`)."""
        if self._write_timer is None and self.transport.get_write_buffer_size():
            self._pending = self._unsent()
            self._write_timer = self.loop.call_later(WRITE_STALL_SECONDS, self._writes_late)

    def _writes_late(self) -> None:
        self._write_timer = None
        if not self.transport.get_write_buffer_size():
            return
        if self._unsent() >= self._pending:
            self.give_up()
        else:  # drained some: it reads
            self._watch_writes()

    def _unsent(self) -> int:
        """The bytes not yet acknowledged by the client: the transport's buffer, and the
        kernel's send queue where it tells it (which drains a slow reader's bytes long
        before the transport can write more)."""
        unsent: int = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if sock is not None and _OUTQ is not None:
            with contextlib.suppress(OSError, ValueError):
                unsent += struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0" * 4))[0]
        return unsent

    def _await_headers(self) -> None:
        # One timer a connection, looked at when it fires, rather than one made and cancelled
        # per request (a few microseconds of every keep-alive request).
        self._awaiting, self._heard, self._since = True, False, self.loop.time()
        if self._headers_timer is None:
            self._headers_timer = self.loop.call_later(HEADERS_SECONDS, self._headers_late)

    def _headers_late(self) -> None:
        self._headers_timer = None
        if self.transport.is_closing():
            return
        left = self._since + HEADERS_SECONDS - self.loop.time()
        if not self._awaiting or left > 0 or (
                self.cycle is not None and not self.cycle.response_complete):
            # in a request, or waiting for less long: looked at again later
            self._headers_timer = self.loop.call_later(
                left if self._awaiting and left > 0 else HEADERS_SECONDS, self._headers_late)
            return
        if self._heard:
            self.transport.write(_TOO_SLOW)
        self.transport.close()
        self._watch_writes()

    def _stop_timers(self) -> None:
        for timer in (self._headers_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._headers_timer = self._write_timer = None

    def shutdown(self) -> None:
        super().shutdown()
        _stop_served_runs()


def _stop_served_runs() -> None:
    while _served:  # once, whatever the number of connections
        _served.pop().runs.stop_all()


class _Server(uvicorn.Server):
    """uvicorn's server, shut down gracefully by SIGHUP too (its terminal or SSH session
    closed), as by SIGTERM: uvicorn handles SIGINT and SIGTERM only, and SIGHUP's default
    action killed the process, its streams cut without their end, its runs left open. The
    signal is raised again once shut down (as uvicorn does SIGTERM's), so the process ends
    as SIGHUP asks; one ignored (`nohup`) stays ignored."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # A run that outlives its gone client holds no connection to stop it: stopped here,
        # before uvicorn waits for the requests' tasks (until its grace runs out).
        _stop_served_runs()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            hangup = getattr(signal, "SIGHUP", None)
            if hangup is None or threading.current_thread() is not threading.main_thread() \
                    or signal.getsignal(hangup) is signal.SIG_IGN:
                yield
                return
            previous = signal.signal(hangup, self.handle_exit)
            try:
                yield
            finally:  # restored before uvicorn raises the captured signals again
                signal.signal(hangup, previous)


def serve(app: Any, workers: int, **options: Any) -> None:
    """Serve `app` (None with several workers: each builds its own) until a signal. The
    lifespan is "on" unless told (the runtime's app: its start must succeed)."""
    options.setdefault("limit_concurrency", default_connection_limit())
    options.setdefault("lifespan", "on")
    options.update(http=_StopRunsFirst, access_log=False, timeout_graceful_shutdown=5,
                   # the runtime serves no WebSocket, and `websockets` costs each worker ~2 MB
                   ws="none")
    if workers == 1:
        server = _Server(uvicorn.Config(app, **options))
        server.run()
        if not server.started:
            sys.exit(STARTUP_FAILURE)
        return
    config = uvicorn.Config("copilot_runtime.cli:worker_app", factory=True, workers=workers,
                            **options)
    os.environ[_SUPERVISOR_ENV] = str(os.getpid())
    _start_resource_tracker_past_hangups()
    supervisor = _Supervisor(config, sockets=[config.bind_socket()])
    supervisor.run()
    if supervisor.failed_to_start:
        sys.exit(STARTUP_FAILURE)
    if supervisor.hung_up:  # ends as SIGHUP asks, as one process does
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signal.raise_signal(signal.SIGHUP)


def _has_terminal() -> bool:
    """Whether this process has a controlling terminal: a closed one (its window, its SSH
    session) is taken from every process of its session as it hangs up, before the SIGHUP
    it causes is handled (the supervisor looks at its signals every half second)."""
    try:
        tty = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False
    os.close(tty)
    return True


def _start_resource_tracker_past_hangups() -> None:
    """Start multiprocessing's resource tracker (which each worker's start needs) ignoring
    SIGHUP: in the terminal's process group, it died of a hangup, and was started again
    with a warning at the next worker's start."""
    hangup = getattr(signal, "SIGHUP", None)
    if hangup is None:
        return
    from multiprocessing import resource_tracker

    previous = signal.signal(hangup, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(hangup, previous)


#: How long the supervisor waits before starting again a worker that could not start, after
#: some worker had served: doubled at each failure up to the last, reset once one serves.
RESTART_BACKOFF_SECONDS = 0.5
RESTART_BACKOFF_MAX_SECONDS = 15.0
#: How long a worker that did not answer its health check may take to end by itself.
WORKER_EXIT_GRACE_SECONDS = 2.0
#: How long a new worker may take to answer its first health check: it answers only once it
#: has imported the package and the app, which took over 5 s (uvicorn's health check
#: timeout) on a loaded 2-core machine, where each start was killed as hung, again and again.
WORKER_START_SECONDS = 60.0


class _Worker(Process):
    """uvicorn's worker process, serving with `_Server`: a SIGHUP (its terminal closed: the
    whole process group hears it) shuts it down gracefully, where uvicorn's died of it at
    once, its streams cut without their end and its runs left open."""

    @property
    def server(self) -> uvicorn.Server:
        if self._server is None:
            self._server = _Server(config=self.config)
        return self._server


class _Supervisor(Multiprocess):
    """uvicorn's supervisor, except that:

    - a worker which cannot start, once the server has served, is started again later (with
      backoff) instead of stopping every worker: a replacement of a dead worker met a
      coordinator or store briefly away, and uvicorn stopped the healthy workers and their
      streams, for good. Before any worker served, a startup failure still stops the command
      (the app or its configuration is broken);
    - a SIGHUP once its terminal is gone shuts the server down gracefully: uvicorn restarted
      the workers, for no one, and starting one wrote to the lost terminal (EIO), which
      ended the supervisor with a worker left that multiprocessing's exit waited for, for
      ever, SIGTERM unheard. A SIGHUP with the terminal there, or without one ever (a
      service), still restarts the workers; one ignored (`nohup`) stays ignored, workers too;
    - a SIGINT or SIGTERM stops a restart under way (uvicorn heard it only once the restart
      was done, a worker's startup timeout later for each worker);
    - whatever ends it, no worker it started is left running.
    """

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket]) -> None:
        hangup = getattr(signal, "SIGHUP", None)
        hangups_ignored = hangup is not None and signal.getsignal(hangup) is signal.SIG_IGN
        super().__init__(config, sockets)
        if hangup is not None and hangups_ignored:  # inherited by the workers, as ignored
            signal.signal(hangup, signal.SIG_IGN)
        for stop in (signal.SIGINT, signal.SIGTERM):
            signal.signal(stop, self._queue_stop)
        self.failed_to_start = False
        #: Whether it shut down for a SIGHUP, its terminal gone.
        self.hung_up = False
        self._had_terminal = _has_terminal()
        self._stopping = threading.Event()
        self._started: list[Process] = []
        self._served = False
        #: The workers that could not start, and when to start each again (a SIGHUP's
        #: restart may replace them first); the wait after that, by slot, if it fails again.
        self._restart_at: dict[Process, float] = {}
        self._backoff: dict[int, float] = {}
        #: The workers that have not answered a health check yet, and until when they may
        #: take to; those of them a ping was sent to (one at a time: they answer each).
        self._starting: dict[Process, float] = {}
        self._pinged: set[Process] = set()

    def keep_subprocess_alive(self) -> None:
        if not hasattr(Process, "_healthcheck"):  # a uvicorn this was not written for
            super().keep_subprocess_alive()
            return
        for index, process in enumerate(self.processes):
            if self.should_exit.is_set():
                return
            if process in self._restart_at:
                if time.monotonic() >= self._restart_at[process]:
                    del self._restart_at[process]
                    self._replace(index)
                continue
            alive = process.process.is_alive()
            if alive and process in self._starting:
                started = self._first_answer(process)
                if (started is None and process in self._starting
                        and time.monotonic() < self._starting[process]):
                    continue  # still starting: its next turn looks again
            else:
                started = self._healthcheck(process) if alive else None
            if self._stopping.is_set():
                return  # a worker that did not answer yet is stopped by `run`
            if started is not None:
                if started:
                    self._served = True
                    self._backoff.pop(index, None)
                continue
            self._forget(process)
            # Dead, or hung. One whose startup just failed may still be exiting, too busy to
            # answer (the interpreter's finalization stops the answering thread): killed at
            # once, its failure read as a death and it was started again at once, in a loop.
            process.process.join(WORKER_EXIT_GRACE_SECONDS)
            hung = process.process.is_alive()
            process.kill()
            process.join()
            if process.exitcode != STARTUP_FAILURE:
                # A WARNING, not uvicorn's INFO: at the usual level an operator otherwise
                # never learns a worker died (its runs were cut) or hung.
                if hung:
                    logger.warning("Child process [%s] did not answer its health check in "
                                   "time: killed, starting another", process.pid)
                else:
                    logger.warning("Child process [%s] died (exit code %s): starting "
                                   "another", process.pid, process.exitcode)
                self._replace(index)
            elif not self._served:
                logger.error("Child process [%s] failed to start, stopping the parent "
                             "process.", process.pid)
                self.failed_to_start = True
                self.should_exit.set()
            else:
                wait = self._backoff.get(index, RESTART_BACKOFF_SECONDS)
                self._backoff[index] = min(wait * 2, RESTART_BACKOFF_MAX_SECONDS)
                self._restart_at[process] = time.monotonic() + wait
                logger.error("Child process [%s] failed to start; starting it again in "
                             "%.1f s (the other workers serve on).", process.pid, wait)

    def _healthcheck(self, process: Process) -> bool | None:
        """Whether `process` serves, or None if it does not answer in time: uvicorn's check,
        given up on when a stop is asked (a worker still importing answers nothing, and the
        stop waited for the check's whole timeout)."""
        deadline = time.monotonic() + self.config.timeout_worker_healthcheck
        try:
            process.parent_conn.send(b"ping")
            while not process.parent_conn.poll(0.05):
                if self._stopping.is_set() or time.monotonic() >= deadline:
                    return None
            started: bool = process.parent_conn.recv()
        except (OSError, EOFError, pickle.UnpicklingError):
            return None
        return started

    def _first_answer(self, process: Process) -> bool | None:
        """What a starting worker answers to the ping it was sent, or None while it has not
        answered: asked without waiting, so one slow start holds up no other worker's check."""
        try:
            if process not in self._pinged:
                process.parent_conn.send(b"ping")
                self._pinged.add(process)
            if not process.parent_conn.poll(0.05):
                return None
            started: bool = process.parent_conn.recv()
        except (OSError, EOFError, pickle.UnpicklingError):
            # Its end of the pipe is closed: it is exiting (a failed start), not starting.
            self._starting.pop(process, None)
            self._pinged.discard(process)
            return None
        del self._starting[process]
        self._pinged.discard(process)
        return started

    def _replace(self, index: int) -> None:
        self.processes[index] = self._start_worker()

    def _start_worker(self) -> Process:
        process = _Worker(self.config, self.sockets)
        with _interrupts_ignored_by_children():
            process.start()
        self._starting[process] = time.monotonic() + WORKER_START_SECONDS
        self._started = [started for started in self._started if started.exitcode is None]
        self._started.append(process)
        return process

    def _queue_stop(self, sig: int, _frame: object) -> None:
        self.signal_queue.append(sig)
        self._stopping.set()

    def init_processes(self) -> None:
        self.processes = [self._start_worker() for _ in range(self.processes_num)]

    def handle_ttin(self) -> None:
        # uvicorn's adds a plain worker: one a hangup kills outright, none reaped at the end.
        logger.info("Received SIGTTIN, increasing the number of processes.")
        self.processes_num += 1
        self.processes.append(self._start_worker())

    def run(self) -> None:
        try:
            super().run()
        finally:
            # After an error too: else multiprocessing's exit waits for them, for ever.
            alive = [process for process in self._started if process.exitcode is None]
            for process in alive:
                process.terminate()
            for process in alive:
                process.join()

    def handle_hup(self) -> None:
        if self._had_terminal and not _has_terminal():
            logger.info("Received SIGHUP, the terminal is gone: exiting.")
            self.hung_up = True
            self.should_exit.set()
            return
        super().handle_hup()

    def restart_all(self) -> None:
        """Start a new worker for each, then stop the old one once the new one serves; a
        new one that does not serve in time ends the restart (the old ones serve on)."""
        for index, old in enumerate(self.processes):
            if self._stopping.is_set() or self.should_exit.is_set():
                return
            new = self._start_worker()
            if not self._wait_until_serving(new):
                if self._stopping.is_set():  # it may serve already: stopped gracefully by `run`
                    return
                new.kill()
                new.join()
                self._forget(new)
                logger.error("Child process [%s] did not serve in time: the restart stops, "
                             "worker [%s] serves on.", new.pid, old.pid)
                return
            old.terminate()
            old.join()
            self._forget(old)
            self.processes[index] = new

    def _wait_until_serving(self, process: Process) -> bool:
        """Whether the new `process` serves within a start's allowance, asked one ping at a
        time: uvicorn's wait sent one a second and left the answers of a slow start in the
        pipe, where the later health checks read them, stale, in place of the live one (a
        worker hung after a restart was caught half a minute late)."""
        deadline = time.monotonic() + max(WORKER_START_SECONDS,
                                          self.config.timeout_worker_healthcheck)
        while time.monotonic() < deadline:
            if self._stopping.is_set() or not process.process.is_alive():
                return False
            if process in self._starting:
                started = self._first_answer(process)
                if started is None:
                    continue  # (it waited a moment for the answer)
            else:
                started = self._healthcheck(process)
                if started is None:
                    return False
            if started:
                return True
            time.sleep(0.1)
        return False

    def _forget(self, process: Process) -> None:
        self._starting.pop(process, None)
        self._pinged.discard(process)
        self._restart_at.pop(process, None)

    def handle_ttou(self) -> None:
        # uvicorn's, forgetting what is known of the worker it stops
        logger.info("Received SIGTTOU, decreasing number of processes.")
        if self.processes_num <= 1:
            logger.info("Already reached one process, cannot decrease the number of "
                        "processes anymore.")
            return
        self.processes_num -= 1
        process = self.processes.pop()
        process.terminate()
        process.join()
        self._forget(process)


@contextlib.contextmanager
def _interrupts_ignored_by_children() -> Iterator[None]:
    """Start processes with SIGINT ignored: a Ctrl-C (the terminal's whole process group)
    while a worker still imports what it serves with printed its KeyboardInterrupt traceback;
    the supervisor, which hears it too, stops its workers with SIGTERM. A worker's server
    handles SIGINT again once it runs. Meanwhile the supervisor's own SIGINT is blocked, not
    ignored: one sent then is handled once it is unblocked (Linux keeps a blocked signal,
    even ignored)."""
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - Windows: no group SIGINT
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


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
