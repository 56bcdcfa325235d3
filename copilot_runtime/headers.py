"""Which request headers reach an agent, and which it passes on to the service behind it.

Every edge hands an agent the client's headers minus those of the connection
(`forwardable`); each agent that calls another service passes on only what its
`HeaderPolicy` allows.

The TypeScript runtime forwards `authorization` and every `x-*` header of the client's
request to remote agents, except a few that describe the hop to the runtime or are the
runtime's own secrets. `HeaderPolicy()` is that behaviour; its fields widen or narrow it.
Cookies are never forwarded unless a policy names `cookie` explicitly, because a session
cookie of the frontend's origin is a credential the remote service was never meant to see.
With `CopilotRuntime(auth=...)` the caller's `authorization` (and `cookie`) authenticate
them to this runtime, so agents never see them unless the runtime is built with
`forward_credentials=True` (each agent's policy still applies then).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from copilot_runtime._strings import not_one_string

__all__ = ["CREDENTIAL_HEADERS", "DEFAULT_DENIED_HEADERS", "DEFAULT_DENIED_PREFIXES",
           "HOP_BY_HOP", "HeaderPolicy", "for_aiohttp", "forwardable"]

#: Never forwarded by the default policy: what the proxies in front of this runtime wrote
#: about the client's hop to it (its address, host, scheme, a client certificate), and the
#: client's own words to this runtime (its public API key, its protocol version). The
#: remote service has proxies of its own; these would tell it a hop it did not take.
DEFAULT_DENIED_HEADERS: frozenset[str] = frozenset({
    "forwarded", "via", "x-real-ip", "x-client-ip", "x-cluster-client-ip",
    "x-original-forwarded-for", "true-client-ip", "cf-connecting-ip",
    "x-copilotcloud-public-api-key", "x-copilotkit-runtime-client-gql-version",
})
#: Name prefixes denied alike: every `x-forwarded-*` (for, host, proto, port, prefix,
#: server, client-cert...) and Envoy's `x-envoy-*`, which also steer the next Envoy.
DEFAULT_DENIED_PREFIXES: tuple[str, ...] = ("x-forwarded-", "x-envoy-")
# Headers that belong to one HTTP connection and must never be copied to another (besides
# those a `Connection` header names, see `forwardable`).
HOP_BY_HOP: frozenset[str] = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
    "proxy-connection", "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host",
    "content-length", "content-type", "accept", "accept-encoding",
})


@dataclass(frozen=True, slots=True)
class HeaderPolicy:
    """An allow list (exact names and name prefixes) minus a deny list (the same).

    `HeaderPolicy()` forwards `authorization` and `x-*` minus `DEFAULT_DENIED_HEADERS` and
    `DEFAULT_DENIED_PREFIXES`, as the TypeScript runtime does. `HeaderPolicy(allow=(
    "authorization", "x-tenant"), allow_prefixes=())` forwards exactly those two;
    `HeaderPolicy.none()` forwards nothing. `forward_cookies=True` adds `cookie`. A deny
    wins over an allow; `deny` and `deny_prefixes` are replaced separately (an app that
    denies one more name keeps the proxies' headers denied). Names are compared lower-cased.
    """

    allow: tuple[str, ...] = ("authorization",)
    allow_prefixes: tuple[str, ...] = ("x-",)
    deny: frozenset[str] = DEFAULT_DENIED_HEADERS
    forward_cookies: bool = False
    deny_prefixes: tuple[str, ...] = DEFAULT_DENIED_PREFIXES

    def __post_init__(self) -> None:
        for name in ("allow", "allow_prefixes", "deny", "deny_prefixes"):
            not_one_string(getattr(self, name), f"HeaderPolicy's {name}")
        # Names are matched lower-cased; normalise what the user wrote once, here.
        object.__setattr__(self, "allow", tuple(n.lower() for n in self.allow))
        object.__setattr__(self, "allow_prefixes", tuple(p.lower() for p in self.allow_prefixes))
        object.__setattr__(self, "deny", frozenset(n.lower() for n in self.deny))
        object.__setattr__(self, "deny_prefixes", tuple(p.lower() for p in self.deny_prefixes))

    @classmethod
    def none(cls) -> HeaderPolicy:
        """A policy that forwards no header at all."""
        return cls(allow=(), allow_prefixes=())

    def allows(self, name: str) -> bool:
        name = name.lower()
        if name in HOP_BY_HOP or name in self.deny or name.startswith(self.deny_prefixes):
            return False
        if name == "cookie":
            return self.forward_cookies
        return name in self.allow or name.startswith(self.allow_prefixes)

    def select(self, headers: Mapping[str, str]) -> dict[str, str]:
        """The headers of `headers` this policy forwards, with lower-cased names."""
        return {name.lower(): value for name, value in headers.items() if self.allows(name)}


#: What authenticates a caller to this runtime: kept from agents when the runtime checks it.
CREDENTIAL_HEADERS: frozenset[str] = frozenset({"authorization", "cookie"})


def forwardable(raw: Iterable[tuple[bytes, bytes]], *,
                credentials: bool = True) -> dict[str, str]:
    """A request's headers (ASGI pairs) for its agent: lower-cased, minus this connection's
    (`HOP_BY_HOP` and the names its `Connection` header lists, RFC 9110 7.6.1); without
    `credentials`, minus those that authenticated the caller to this runtime."""
    out: dict[str, str] = {}
    named: list[bytes] = []  # the `Connection` headers' values
    for key, value in raw:
        name = key.decode("latin-1").lower()
        if name == "connection":
            named.append(value)
        elif name not in HOP_BY_HOP and (credentials or name not in CREDENTIAL_HEADERS):
            out[name] = value.decode("latin-1")
    for value in named:
        for token in value.decode("latin-1").split(","):
            out.pop(token.strip().lower(), None)
    return out


def for_aiohttp(forwarded: Mapping[str, str]) -> dict[str, str]:
    """`forwarded` (values as `forwardable` reads them: one character per byte, so that
    their latin-1 encoding is the client's bytes) as aiohttp must be handed them to send
    those bytes unchanged: aiohttp writes a header value as UTF-8, so each value is given
    as its bytes read as UTF-8. Bytes that are not UTF-8 cannot be sent unchanged through
    aiohttp; their characters are sent (as UTF-8), as is a value that is already text
    (one given to `CopilotRuntime.start_run` by code, not read off a request)."""
    return {name: _as_utf8(value) for name, value in forwarded.items()}


def _as_utf8(value: str) -> str:
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:  # (not bytes read as latin-1, or not UTF-8 bytes)
        return value
