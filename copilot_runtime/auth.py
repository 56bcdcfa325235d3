"""Who is calling: principals, the authenticators that find them, and who may see a thread.

`CopilotRuntime(auth=...)` takes any object with `async def authenticate(request) ->
Principal` that raises `AuthenticationError` (answered 401). The request it gets is a
`RequestInfo`: method, path, lower-cased headers and the client's address. Two ship here:
`BearerTokenAuth` for static API tokens and `JWTAuth` for signed tokens (PyJWT, the `auth`
extra), with a key or a JWKS URL.

Without `auth` the runtime has one anonymous user and checks nothing: every thread is
everyone's, as before. With it, a thread belongs to the principal (and tenant) whose run
created it (`ThreadOwner`), and for anybody else it does not exist.
"""

from __future__ import annotations

import hashlib
import math
import uuid
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

from copilot_runtime._exceptions import AuthenticationError, ConfigurationError
from copilot_runtime._jwks import KeySet
from copilot_runtime._strings import not_one_string
from copilot_runtime.threads.base import ThreadOwner, id_problem

__all__ = [
    "Authenticator",
    "BearerTokenAuth",
    "JWTAuth",
    "Principal",
    "RequestInfo",
    "bearer_token",
    "owner_of",
]


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller. `roles` name what the application lets it do beyond its own
    threads (see `CopilotRuntime(approver_roles=...)`); `claims` keeps what the token said."""

    id: str
    tenant: str | None = None
    roles: frozenset[str] = frozenset()
    claims: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ConfigurationError("A principal needs a non-empty string id")
        # Both name the owner of every thread the principal starts, in every store; held
        # to what a new id is, as a token's claims are (not "." or "..").
        if self.tenant is not None and not isinstance(self.tenant, str):
            # (another type passed, then failed every store's write)
            raise ConfigurationError("A principal's tenant is a string or None")
        for name, value in (("id", self.id), ("tenant", self.tenant)):
            # (An empty tenant is a tenant, never in a URL; the id is non-empty already.)
            problem = id_problem(value, new=True) if isinstance(value, str) and value else None
            if problem is not None:
                raise ConfigurationError(f"A principal's {name} {problem}")
        if not isinstance(self.roles, frozenset):
            not_one_string(self.roles, "A principal's roles")
            object.__setattr__(self, "roles", frozenset(self.roles))

    def __repr__(self) -> str:  # claims may hold personal data: keep them out of logs
        return f"Principal(id={self.id!r}, tenant={self.tenant!r}, roles={sorted(self.roles)!r})"


@dataclass(slots=True)
class RequestInfo:
    """What authenticators, hooks and limits know about a request.

    `annotations` is what `on_request` hooks added; agents see it as
    `RunContext.annotations`.
    """

    method: str
    path: str
    #: Lower-cased names. Kept out of `repr`: they hold the caller's credentials.
    headers: Mapping[str, str] = field(repr=False)
    #: The client's address as the ASGI server reports it (behind a proxy: the proxy's).
    client: str | None = None
    principal: Principal | None = None
    annotations: dict[str, Any] = field(default_factory=dict)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@runtime_checkable
class Authenticator(Protocol):
    async def authenticate(self, request: RequestInfo) -> Principal:
        """The caller, or `AuthenticationError`."""
        ...


def bearer_token(request: RequestInfo) -> str:
    """The token of an `Authorization: Bearer` header, or `AuthenticationError`."""
    value = request.headers.get("authorization")
    if not value:
        raise AuthenticationError("Missing bearer token")
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthenticationError("The Authorization header must be 'Bearer <token>'")
    return token


def owner_of(principal: Principal) -> ThreadOwner:
    return ThreadOwner(principal.id, principal.tenant)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class BearerTokenAuth:
    """Static API tokens: `{token: user_id}` (or `{token: Principal}` for tenants and roles).

    Tokens are kept as SHA-256 digests, so a lookup's timing says nothing about how much of
    a wrong token matched.
    """

    def __init__(self, tokens: Mapping[str, str | Principal]) -> None:
        if not tokens:
            raise ConfigurationError("BearerTokenAuth needs at least one token")
        self._principals: dict[bytes, Principal] = {}
        for token, who in tokens.items():
            if not isinstance(token, str) or len(token) < 8:
                raise ConfigurationError("Bearer tokens must be strings of 8 characters or more")
            self._principals[_digest(token)] = who if isinstance(who, Principal) else Principal(
                who)

    async def authenticate(self, request: RequestInfo) -> Principal:
        principal = self._principals.get(_digest(bearer_token(request)))
        if principal is None:
            raise AuthenticationError("Invalid bearer token")
        return principal


#: Seconds of clock skew `JWTAuth` allows by default: issuers' and hosts' clocks commonly
#: drift apart by a few seconds, and NTP keeps them well within this.
DEFAULT_LEEWAY = 30.0


class JWTAuth:
    """Signed JSON Web Tokens, checked by PyJWT (install the `auth` extra).

    Give either `key` (a shared secret for HS*, a PEM public key for RS*/ES*/EdDSA) or
    `jwks_url` (the issuer's key set; a token's `kid` picks the key, and one without a `kid`
    the set's only key without one of the token's family). The set is fetched
    again after `jwks_cache_seconds`, and for a `kid` it does not hold at most once every 30
    s (a key just rotated in); while the issuer cannot be reached the keys fetched last keep
    serving, and a runtime that never got them answers 503, not 401.
    `audience` and `issuer`, when given, must match; `exp` is always required. The principal
    is `sub` (or `principal_claim`), its tenant `tenant_claim` (each a non-empty string; a
    token without the tenant claim has no tenant) and its roles `roles_claim` (a list, whose
    strings are the roles, or a space-separated string).
    `leeway` (seconds or a `timedelta`, default `DEFAULT_LEEWAY`: 30) is the clock skew
    allowed between the issuer and this host when checking `exp`, `nbf` and `iat`: without
    it a token issued by a clock even 1 s ahead of ours is "not valid yet". 0 allows none.
    """

    def __init__(
        self,
        key: Any = None,
        *,
        algorithms: Collection[str] = ("RS256",),
        audience: str | Iterable[str] | None = None,
        issuer: str | None = None,
        jwks_url: str | None = None,
        principal_claim: str = "sub",
        tenant_claim: str | None = None,
        roles_claim: str | None = "roles",
        leeway: float | timedelta = DEFAULT_LEEWAY,
        jwks_cache_seconds: int = 300,
    ) -> None:
        try:
            import jwt
        except ImportError as exc:
            raise ConfigurationError(
                "JWTAuth needs PyJWT: pip install 'copilot-runtime[auth]'") from exc
        if (key is None) == (jwks_url is None):
            raise ConfigurationError("JWTAuth needs exactly one of key and jwks_url")
        not_one_string(algorithms, "JWTAuth's algorithms")
        if not algorithms or "none" in {a.lower() for a in algorithms}:
            raise ConfigurationError("JWTAuth needs signing algorithms, never 'none'")
        if isinstance(leeway, timedelta):  # PyJWT takes one; checked as its seconds
            leeway = leeway.total_seconds()
        if isinstance(leeway, bool) or not isinstance(leeway, int | float) or not (
                math.isfinite(leeway) and leeway >= 0):
            raise ConfigurationError(f"JWTAuth's leeway must be a number of seconds, 0 or "
                                     f"more, got {leeway!r}")
        self._jwt = jwt
        self.key = key
        self.algorithms = list(algorithms)
        self.audience = audience if audience is None or isinstance(audience, str) else list(
            audience)
        self.issuer = issuer
        self.principal_claim = principal_claim
        self.tenant_claim = tenant_claim
        self.roles_claim = roles_claim
        self.leeway = leeway
        self._jwks = KeySet(jwks_url, fresh_for=jwks_cache_seconds) if jwks_url else None

    async def authenticate(self, request: RequestInfo) -> Principal:
        token = bearer_token(request)
        jwt = self._jwt
        key = self.key
        try:
            if self._jwks is not None:
                header = jwt.get_unverified_header(token)
                kid = header.get("kid")
                key = (await self._jwks.key(kid if isinstance(kid, str) else None,
                                            header.get("alg"))).key
            claims: dict[str, Any] = jwt.decode(
                token, key, algorithms=self.algorithms, audience=self.audience,
                issuer=self.issuer, leeway=self.leeway,
                options={"require": ["exp"], "verify_aud": self.audience is not None})
        except jwt.ExpiredSignatureError:
            raise AuthenticationError("The token has expired") from None
        except jwt.ImmatureSignatureError:  # its `iat` or `nbf` is past now + leeway
            raise AuthenticationError("The token is not valid yet") from None
        except (jwt.PyJWTError, TypeError, ValueError):
            # TypeError/ValueError: PyJWT preparing the key for the algorithm the token names
            # when it is another kind of key (an ES256 token for an RSA key): a forgery, not
            # a failure of ours (it was a 500, logged as unhandled, before any signature).
            raise AuthenticationError("Invalid token") from None
        subject = claims.get(self.principal_claim)
        if subject is None:
            raise AuthenticationError(f"The token has no '{self.principal_claim}' claim")
        tenant = claims.get(self.tenant_claim) if self.tenant_claim else None
        # Both name a thread's owner in every store. Only a non-empty string is an id: a
        # number or a boolean turned into one would share its owner with a string (5 and
        # "5" one tenant); ids a store could not keep are refused here rather than failing
        # the run's write after it streamed. Held to what a new id is (not "." or
        # ".."), as the documented bounds on ids promise of a token's.
        for name, value in ((self.principal_claim, subject), (self.tenant_claim, tenant)):
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise AuthenticationError(f"The token's '{name}' claim is not a non-empty "
                                          "string")
            if id_problem(value, new=True) is not None:
                raise AuthenticationError(f"The token's '{name}' claim is not a usable id")
        roles: Any = claims.get(self.roles_claim) if self.roles_claim else None
        if isinstance(roles, str):
            roles = roles.split()
        elif roles is not None and not isinstance(roles, list):
            # A number or a boolean cannot be iterated, and a mapping's keys are not roles
            # ({"approver": false} must not grant "approver").
            raise AuthenticationError(f"The token's '{self.roles_claim}' claim is not a "
                                      "list of roles")
        return Principal(subject, tenant=tenant,
                         roles=frozenset(r for r in roles or () if isinstance(r, str)),
                         claims=claims)
