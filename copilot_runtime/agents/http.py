"""`HttpAgent`: any AG-UI agent server reachable over HTTP.

A run POSTs the client's `RunAgentInput` to `url` with `Accept: text/event-stream` and
relays the SSE answer as it arrives, one batch per network read. The events are normalised
and checked on the way (`_wire.RemoteEventChecker`), so a remote agent that breaks the
protocol, dies mid-stream, answers an HTTP error or cannot be reached ends the run with a
`RUN_ERROR` that says so. Stopping the run or losing the client closes the upstream
connection, which is how an AG-UI server learns to stop.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson

from copilot_runtime._exceptions import ConfigurationError, UpstreamError, header_secrets
from copilot_runtime._input import RunInput
from copilot_runtime.agents._http_client import (
    SessionHolder,
    Timeouts,
    error_for_exception,
    error_for_status,
)
from copilot_runtime.agents._wire import RemoteEventChecker, SSEDecoder
from copilot_runtime.agents.base import Agent, RunContext
from copilot_runtime.events import EventBatches
from copilot_runtime.headers import HeaderPolicy, for_aiohttp

__all__ = ["HttpAgent"]

# What an AG-UI server may assume it receives, even from a client that omitted them.
_INPUT_DEFAULTS: dict[str, Any] = {"tools": [], "context": [], "state": {},
                                   "forwardedProps": {}}
#: The media type of AG-UI's protobuf encoding, the one answer @ag-ui/client does not read as
#: SSE.
_PROTOBUF = "application/vnd.ag-ui.event+proto"


class HttpAgent(Agent):
    """A remote AG-UI agent at `url`.

    `headers` are sent with every request and win over forwarded ones (the operator's
    configuration must not be overridable by a browser). `header_policy` picks which of the
    client's request headers are forwarded (default: as the TypeScript runtime does).
    """

    class_name = "HttpAgent"

    def __init__(
        self,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        header_policy: HeaderPolicy | None = None,
        description: str = "",
        timeouts: Timeouts | None = None,
    ) -> None:
        super().__init__(description=description)
        if not url.startswith(("http://", "https://")):
            raise ConfigurationError(f"HttpAgent url must be http(s), got {url!r}")
        self.url = url
        self.headers = {name.lower(): value for name, value in (headers or {}).items()}
        self.header_policy = header_policy or HeaderPolicy()
        self.timeouts = timeouts or Timeouts()
        self._sessions = SessionHolder()

    def capabilities(self) -> dict[str, Any]:
        return {"transport": {"streaming": True}}

    def request_headers(self, context: RunContext) -> dict[str, str]:
        """The headers of the upstream request for a run with `context`."""
        return {**for_aiohttp(self.header_policy.select(context.headers)), **self.headers,
                "content-type": "application/json", "accept": "text/event-stream"}

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run(input, context)

    async def _run(self, input: RunInput, context: RunContext) -> EventBatches:
        what = f"Remote agent '{context.agent_id}'"
        body = orjson.dumps({**_INPUT_DEFAULTS, **input.raw})
        known = header_secrets(self.headers)  # (a remote may echo the key it was sent)
        checker = RemoteEventChecker(what, known)
        session = self._sessions.get()
        try:
            # Redirects are not followed: aiohttp would send this request's headers (the
            # operator's credentials, the client's forwarded ones) to wherever it points.
            async with session.post(self.url, data=body, headers=self.request_headers(context),
                                    timeout=self.timeouts.client_timeout(),
                                    allow_redirects=False) as response:
                if response.status >= 300:
                    raise await error_for_status(response, what, known)
                # Any other content type is read as SSE, as @ag-ui/client reads it (servers
                # that label their stream otherwise, or not at all, work with it); only its
                # protobuf encoding is not SSE. (The parsed media type: its case and
                # parameters are not part of it.)
                content_type = response.headers.get("content-type", "")
                if response.content_type == _PROTOBUF:
                    raise UpstreamError(f"{what} answered with content type "
                                        f"{content_type!r} (AG-UI's protobuf encoding), not "
                                        "an event stream")
                labelled = response.content_type == "text/event-stream"
                relayed = False
                decoder = SSEDecoder(what)
                async for chunk in response.content.iter_any():
                    batch = checker.payloads(decoder.feed(chunk))
                    if batch:
                        relayed = True
                        yield batch
                    if checker.failure is not None:
                        raise checker.failure  # after the good events of the same read
                    if checker.finished:
                        return  # the run is over even if the server keeps the stream open
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise error_for_exception(exc, what, self.url) from None
        last = checker.payloads(decoder.close())
        if last:
            yield last
        if checker.failure is not None:
            raise checker.failure
        if not (labelled or relayed or last):  # (an HTML page, a JSON answer: say so)
            raise UpstreamError(f"{what} answered with content type "
                                f"{content_type or 'none'!r} and no event")
        checker.end_of_stream()

    async def aclose(self) -> None:
        await self._sessions.aclose()
