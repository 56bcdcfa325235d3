"""An issuer's JSON Web Key Set, fetched and kept: the keys `JWTAuth(jwks_url=...)` checks
signatures with.

PyJWT's own `PyJWKClient` fetched the set again for every token naming a key it did not
know, so anyone could make the runtime fetch it as often as they sent a token with a made-up
`kid`, each fetch holding one of the event loop's few worker threads for up to its timeout;
and once its cache expired, an issuer that could not be reached failed every caller's token.
Here:

* one fetch at a time, over aiohttp on the event loop; callers arriving meanwhile wait for it;
* a `kid` not in the set fetches it again at most once per `refresh_interval` (an issuer
  rotating its keys is seen within that; any other unknown `kid` is an invalid token at once);
* a set older than `fresh_for` is fetched again in the background: the keys held keep
  serving meanwhile, and while the issuer cannot be reached (a failed fetch is not tried
  again for `retry_after`), so a slow or failing issuer holds no caller up, for at most
  `max_stale` (an hour: a key the issuer withdrew must stop verifying tokens some time);
* with no keys at all (the issuer unreachable since the start), the caller is answered 503:
  its token may be good, the runtime cannot tell yet;
* `kid` is optional (RFC 7517): a token without one is checked with the set's one key
  without a kid of the token's family (RSA, EC, ...), never with several in turn; with
  none or several such keys it is an invalid token. (Such a key rotated is only seen at
  the next fetch, after `fresh_for`: there is no unknown kid to fetch it for.)
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import structlog

from copilot_runtime._exceptions import AuthenticationError, ServiceUnavailableError

__all__ = ["KeySet"]

_log = structlog.get_logger("copilot_runtime.auth")

#: A key set is a few keys: a body past this is not one.
MAX_BODY_BYTES = 1024 * 1024
NOT_FETCHED = "The token's signing keys could not be fetched"
#: A token's algorithm's prefix -> the `kty` of the keys it is checked with.
_FAMILIES = {"HS": "oct", "RS": "RSA", "PS": "RSA", "ES": "EC", "Ed": "OKP"}


class KeySet:
    """The signing keys published at `url` (PyJWT's `PyJWK`s by key id)."""

    def __init__(self, url: str, *, fresh_for: float = 300.0, refresh_interval: float = 30.0,
                 retry_after: float = 5.0, timeout: float = 10.0,
                 max_stale: float = 3600.0) -> None:
        import jwt

        self._jwt = jwt
        self.url = url
        self.fresh_for = fresh_for
        self.refresh_interval = refresh_interval
        self.retry_after = retry_after
        self.timeout = timeout
        self.max_stale = max_stale
        self._keys: dict[str, Any] | None = None
        self._unnamed: tuple[Any, ...] = ()  # the keys without a kid, from the same fetch
        self._fetched_at = 0.0  # monotonic time of the last fetch that gave keys
        self._tried_at = -float("inf")  # ... of the last fetch, whatever it gave
        self._failing = False
        self._fetching: asyncio.Future[None] | None = None

    async def key(self, kid: str | None, algorithm: Any = None) -> Any:
        """The key named `kid` (a `PyJWK`), or without a kid the one key without a kid of
        `algorithm`'s family: `AuthenticationError` if the issuer has none,
        `ServiceUnavailableError` while its keys could never be fetched."""
        age = time.monotonic() - self._fetched_at
        if self._keys is not None and age > self.fresh_for + self.max_stale:
            self._keys = None  # too old to trust: fetched again, or the caller waits
        if self._keys is None:
            await self._refresh()
        elif age > self.fresh_for:
            self._start_fetch()
        keys = self._keys
        if keys is None:
            raise ServiceUnavailableError(NOT_FETCHED)
        found = keys.get(kid) if kid else _only_unnamed(self._unnamed, algorithm)
        if found is None and kid and time.monotonic() - self._tried_at >= self.refresh_interval:
            await self._refresh()  # perhaps a key the issuer has just added
            found = (self._keys or {}).get(kid)
        if found is None:
            raise AuthenticationError("Invalid token")
        return found

    async def _refresh(self) -> None:
        """Fetch the set, or wait for the fetch in flight; a failure keeps the keys held."""
        fetching = self._start_fetch()
        if fetching is not None:
            # Shielded: a caller that goes away does not cancel the others' fetch.
            await asyncio.shield(fetching)

    def _start_fetch(self) -> asyncio.Future[None] | None:
        """The fetch in flight, or a new one; None just after a failed one."""
        if self._fetching is None:
            if self._failing and time.monotonic() - self._tried_at < self.retry_after:
                return None  # failed just now: not again before `retry_after`
            self._fetching = asyncio.ensure_future(self._fetch())
        return self._fetching

    async def _fetch(self) -> None:
        self._tried_at = time.monotonic()
        try:
            keys = await self._download()
        except Exception as exc:
            if not self._failing:
                _log.warning("could not fetch the token signing keys", url=self.url,
                             error=_reason(exc), keeping=len(self._keys or ()))
            self._failing = True
            return
        finally:
            self._fetching = None
        if self._failing:
            _log.info("token signing keys fetched again", url=self.url)
        self._failing = False
        (self._keys, self._unnamed), self._fetched_at = keys, time.monotonic()

    async def _download(self) -> tuple[dict[str, Any], tuple[Any, ...]]:
        import aiohttp  # (here: importing the package must not load it, see its tests)

        timeout = aiohttp.ClientTimeout(total=self.timeout)
        # trust_env: an issuer reached through the environment's HTTP proxy, as PyJWT's was.
        async with aiohttp.ClientSession(timeout=timeout, trust_env=True) as session, \
                session.get(self.url, headers={"Accept": "application/json"}) as response:
            if response.status != 200:
                raise _Unusable(f"HTTP {response.status}")
            body = bytearray()
            async for piece in response.content.iter_any():
                body += piece
                if len(body) > MAX_BODY_BYTES:
                    raise _Unusable("a body past 1 MiB")
        data = orjson.loads(body)
        if not isinstance(data, dict):
            raise _Unusable("not a key set")
        # PyJWKSet skips the keys it cannot use and raises if none is left.
        key_set = self._jwt.PyJWKSet.from_dict(data)
        signing = [k for k in key_set.keys if k.public_key_use in ("sig", None)]
        keys = {k.key_id: k for k in signing if isinstance(k.key_id, str) and k.key_id}
        unnamed = tuple(k for k in signing if not k.key_id)
        if not keys and not unnamed:
            raise _Unusable("no signing key")
        return keys, unnamed


def _only_unnamed(unnamed: tuple[Any, ...], algorithm: Any) -> Any:
    """The one key of `unnamed` of `algorithm`'s family, or None (none, or several: the
    token does not say which, and trying each would accept what any of them signed)."""
    family = _FAMILIES.get(algorithm[:2]) if isinstance(algorithm, str) else None
    fitting = [k for k in unnamed if family is not None and k.key_type == family]
    return fitting[0] if len(fitting) == 1 else None


class _Unusable(Exception):
    """The issuer answered, but not with a key set."""


def _reason(exc: Exception) -> str:
    """What went wrong, for the log: the exception's kind and, for ours, its words."""
    if isinstance(exc, _Unusable):
        return str(exc)
    return type(exc).__name__
