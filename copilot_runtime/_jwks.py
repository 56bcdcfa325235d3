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
  its token may be good, the runtime cannot tell yet.
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
        self._fetched_at = 0.0  # monotonic time of the last fetch that gave keys
        self._tried_at = -float("inf")  # ... of the last fetch, whatever it gave
        self._failing = False
        self._fetching: asyncio.Future[None] | None = None

    async def key(self, kid: str | None) -> Any:
        """The key named `kid` (a `PyJWK`): `AuthenticationError` if the issuer has none,
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
        found = keys.get(kid) if kid else None
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
        self._keys, self._fetched_at = keys, time.monotonic()

    async def _download(self) -> dict[str, Any]:
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
        keys = {k.key_id: k for k in key_set.keys
                if isinstance(k.key_id, str) and k.key_id and k.public_key_use in ("sig", None)}
        if not keys:
            raise _Unusable("no signing key with a key id")
        return keys


class _Unusable(Exception):
    """The issuer answered, but not with a key set."""


def _reason(exc: Exception) -> str:
    """What went wrong, for the log: the exception's kind and, for ours, its words."""
    if isinstance(exc, _Unusable):
        return str(exc)
    return type(exc).__name__
