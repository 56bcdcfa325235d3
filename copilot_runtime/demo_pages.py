"""The demo's web pages beside the runtime: the stock CopilotKit chat of both generations.

`web/` builds them (`npm ci && npm run build`, Node.js 20+) into `copilot_runtime/demo_web/`,
which a wheel built after that carries, so an installed package serves them without Node:

* `/`: react-core 1.74 with its v2 chat, over AG-UI;
* `/classic`: react-core and react-ui 1.10.6, over GraphQL;

both at the same origin as the runtime, so no CORS is involved (the demo sends none: no other
site's page may call it from a browser). Without a build, `/` says how to make one (and shows
the pages as soon as one appears) and the runtime is served as usual.

Bound to a loopback address, the demo answers only requests naming a loopback host: a page
of a name that an attacker's DNS points at 127.0.0.1 (DNS rebinding) gets 421.
"""

from __future__ import annotations

import html
import ipaddress
import socket
from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BUILD_HINT", "DemoPages", "binds_loopback", "built_pages", "pages_note"]

PAGES_DIR = Path(__file__).with_name("demo_web")
BUILD_HINT = "cd web && npm ci && npm run build   (Node.js 20+; ./scripts/demo.sh does it)"
# The meta tag the pages read the runtime's URL from (see web/src/shared/demo.jsx).
_URL_META = '<meta name="copilot-runtime-url" content="/copilotkit" />'
_PAGES = {"/": "index.html", "/classic/": "classic/index.html"}


def built_pages(directory: Path = PAGES_DIR) -> Path | None:
    """`directory` when it holds a build of both pages, else None."""
    if all((directory / page).is_file() for page in _PAGES.values()):
        return directory
    return None


def pages_note(pages: DemoPages, host: str, port: int) -> str:
    """What the demo prints about its pages."""
    if pages.directory is None:
        return (f"web pages not built yet: http://{host}:{port}/ shows them once they are "
                f"(in a clone of the repository: {BUILD_HINT})")
    return (f"open http://{host}:{port}/ (CopilotKit 1.74, AG-UI) or "
            f"http://{host}:{port}/classic (1.10.6, GraphQL)")


def binds_loopback(host: str) -> bool:
    """Whether listening on `host` reaches this machine only (every address it names is a
    loopback one); `""` (every interface) does not."""
    if not host:
        return False
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None,
                                                               type=socket.SOCK_STREAM)}
        return all(ipaddress.ip_address(str(address).partition("%")[0]).is_loopback
                   for address in addresses)
    except (OSError, ValueError):
        return False


def _names_loopback(host_header: bytes | None) -> bool:
    """Whether a `Host` names this machine: `localhost` or a loopback address, any port.
    No `Host` at all passes: a browser always sends one, so no web page sends such a request."""
    if host_header is None:
        return True
    host = host_header.decode("latin-1").strip().lower()
    name = host[:host.find("]") + 1] if host.startswith("[") else host.partition(":")[0]
    name = name.rstrip(".")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


class DemoPages:
    """An ASGI app: requests under `runtime_path` go to `app`; the rest are the pages.

    With `loopback_hosts_only`, a request whose `Host` names anything but this machine is
    answered 421 (a DNS rebinding page's)."""

    def __init__(self, app: ASGIApp, runtime_path: str = "/copilotkit",
                 directory: Path | None = PAGES_DIR, *,
                 loopback_hosts_only: bool = False) -> None:
        self.app = app
        self.loopback_hosts_only = loopback_hosts_only
        self.runtime_path = "/" + runtime_path.strip("/") if runtime_path.strip("/") else ""
        self._candidate = directory
        self.directory: Path | None = None
        self._meta = _URL_META.replace("/copilotkit", html.escape(self.runtime_path or "/"))
        self._assets: ASGIApp | None = None
        self._discover()

    def _discover(self) -> None:
        """Serve the pages once they are built (`demo.sh` may build them while serving)."""
        if self.directory is None and self._candidate is not None:
            self.directory = built_pages(self._candidate)
            if self.directory is not None:
                self._assets = StaticFiles(directory=self.directory / "assets")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] == "http" and self.loopback_hosts_only and not _names_loopback(
                dict(scope.get("headers", ())).get(b"host")):
            await PlainTextResponse("Misdirected request: this demo answers only requests for "
                                    "localhost, 127.0.0.1 or [::1]", 421)(scope, receive, send)
            return
        if scope["type"] != "http" or self._is_runtime(path):
            await self.app(scope, receive, send)
            return
        response: ASGIApp
        self._discover()
        if scope.get("method", "GET") not in ("GET", "HEAD"):
            response = PlainTextResponse("Method Not Allowed", 405, headers={"Allow": "GET, HEAD"})
        elif self.directory is None:
            response = self._not_built() if path == "/" else PlainTextResponse("Not Found", 404)
        elif path == "/classic":
            query = scope.get("query_string", b"").decode("latin-1")
            # The page keeps its agent and thread in the query: a link keeps them.
            response = RedirectResponse("/classic/" + (f"?{query}" if query else ""), 307)
        elif path in _PAGES:
            # Read per request (a few hundred bytes), so a rebuild shows without a restart.
            try:
                page = (self.directory / _PAGES[path]).read_text(encoding="utf-8")
            except OSError:  # the build was removed while serving
                response = self._not_built()
            else:
                response = HTMLResponse(page.replace(_URL_META, self._meta),
                                        headers={"Cache-Control": "no-cache"})
        elif self._is_asset(path) and self._assets is not None:
            # Names carry a content hash: they never change, so browsers may keep them.
            scope = {**scope, "path": path[len("/assets"):], "root_path": ""}
            try:
                await self._assets(scope, receive, _cache_forever(send))
                return
            except HTTPException as exc:  # StaticFiles raises them (405, 404 for a link)
                response = PlainTextResponse(exc.detail, exc.status_code, headers=exc.headers)
        else:
            response = PlainTextResponse("Not Found", 404)
        await response(scope, receive, send)

    def _is_asset(self, path: str) -> bool:
        name = path[len("/assets/"):] if path.startswith("/assets/") else ""
        # The build writes flat, hashed names; anything else is not one of its files.
        if not name or "/" in name or name.startswith(".") or self.directory is None:
            return False
        try:
            return (self.directory / "assets" / name).is_file()
        except (OSError, ValueError):  # a name too long for the file system, say
            return False

    def _is_runtime(self, path: str) -> bool:
        base = self.runtime_path
        return not base or path == base or path.startswith(base + "/")

    def _not_built(self) -> Response:
        # It reloads itself: ./scripts/demo.sh may be building the pages right now.
        return HTMLResponse(
            "<!doctype html><title>copilot-runtime demo</title>"
            '<meta http-equiv="refresh" content="10">'
            "<p>The demo's web pages are not built yet. <code>./scripts/demo.sh</code> builds "
            "them on first use (this page reloads itself until they are there); by hand, "
            "from a clone of the repository:</p>"
            f"<pre>{html.escape(BUILD_HINT)}</pre>"
            f"<p>The runtime itself is at <code>{html.escape(self.runtime_path)}</code>.</p>",
            status_code=404)


def _cache_forever(send: Send) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start" and message.get("status") == 200:
            message = {**message, "headers": [
                *message.get("headers", []),
                (b"cache-control", b"public, max-age=31536000, immutable")]}
        await send(message)
    return sending
