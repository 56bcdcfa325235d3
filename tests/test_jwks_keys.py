"""`JWTAuth(jwks_url=...)`: the issuer's keys fetched once at a time, kept through its
outages, and never fetched for every made-up `kid`.

Before, PyJWT's `PyJWKClient` fetched the key set again for each token naming a key it did
not hold, so a client sending tokens with made-up `kid`s had the runtime fetch the issuer's
keys once per request (each fetch holding one of the event loop's few worker threads), and
once its cache expired an issuer that could not be reached failed every caller's token.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import jwt
import pytest
import structlog
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from copilot_runtime import AuthenticationError, JWTAuth, ServiceUnavailableError
from copilot_runtime.auth import RequestInfo
from copilot_runtime.testing import LoopbackServer

pytestmark = pytest.mark.timeout(30)


class Issuer(LoopbackServer):
    """A JWKS endpoint publishing `keys` (by kid), or answering `status` without them."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: dict[str, rsa.RSAPrivateKey] = {}
        #: Published without a `kid` (RFC 7517 makes it optional).
        self.unnamed: list[rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey] = []
        self.status = 200
        self.body: bytes | None = None
        self.delay = 0.0
        self.fetches = 0

    def add(self, kid: str) -> rsa.RSAPrivateKey:
        self.keys[kid] = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        return self.keys[kid]

    def routes(self, app: web.Application) -> None:
        async def keys(request: web.Request) -> web.Response:
            self.fetches += 1
            await asyncio.sleep(self.delay)
            if self.body is not None:
                return web.Response(body=self.body, content_type="application/json")
            if self.status != 200:
                return web.Response(status=self.status, text="down")
            published = []
            for kid, private in self.keys.items():
                public = jwt.algorithms.RSAAlgorithm.to_jwk(private.public_key(), as_dict=True)
                published.append({**public, "kid": kid, "use": "sig", "alg": "RS256"})
            for private in self.unnamed:
                kind = (jwt.algorithms.RSAAlgorithm if isinstance(private, rsa.RSAPrivateKey)
                        else jwt.algorithms.ECAlgorithm)
                published.append({**kind.to_jwk(private.public_key(), as_dict=True),
                                  "use": "sig"})
            return web.json_response({"keys": published})

        app.router.add_get("/jwks.json", keys)

    @property
    def jwks_url(self) -> str:
        return f"http://{self.host}:{self.port}/jwks.json"


def bearer(key: Any, kid: str | None, sub: str = "carol") -> RequestInfo:
    headers = {"kid": kid} if kid is not None else None
    token = jwt.encode({"sub": sub, "exp": int(time.time()) + 60}, key, algorithm="RS256",
                       headers=headers)
    return RequestInfo("GET", "/info", {"authorization": f"Bearer {token}"}, "127.0.0.1")


@pytest.fixture(scope="module")
def stranger() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


async def test_made_up_kids_fetch_nothing(stranger: rsa.RSAPrivateKey) -> None:
    """Tokens naming keys the issuer never had, together and one after another: one fetch in
    all (the first), each an invalid token at once."""
    async with Issuer() as issuer:
        good = issuer.add("key-1")
        auth = JWTAuth(jwks_url=issuer.jwks_url)
        assert (await auth.authenticate(bearer(good, "key-1"))).id == "carol"
        made_up = [bearer(stranger, uuid.uuid4().hex) for _ in range(60)]
        results = await asyncio.gather(*(auth.authenticate(r) for r in made_up[:30]),
                                       return_exceptions=True)
        for request in made_up[30:]:
            with pytest.raises(AuthenticationError, match=r"^Invalid token$"):
                await auth.authenticate(request)
        for result in results:
            assert isinstance(result, AuthenticationError)
            assert result.message == "Invalid token"
        # A token without a kid names no key either.
        with pytest.raises(AuthenticationError, match=r"^Invalid token$"):
            await auth.authenticate(bearer(good, None))
        assert issuer.fetches == 1


async def test_a_key_rotated_in_is_found_by_fetching_again() -> None:
    """A kid the set does not hold fetches it again, at most once per refresh interval: the
    issuer's new key is taken then, and a made-up kid right after costs no fetch."""
    async with Issuer() as issuer:
        old = issuer.add("key-1")
        auth = JWTAuth(jwks_url=issuer.jwks_url)
        assert (await auth.authenticate(bearer(old, "key-1"))).id == "carol"
        new = issuer.add("key-2")
        # Within the interval after the first fetch: not fetched again.
        with pytest.raises(AuthenticationError, match=r"^Invalid token$"):
            await auth.authenticate(bearer(new, "key-2"))
        assert issuer.fetches == 1
        assert auth._jwks is not None
        auth._jwks.refresh_interval = 0.2
        await asyncio.sleep(0.25)
        together = await asyncio.gather(*(auth.authenticate(bearer(new, "key-2", f"u{i}"))
                                          for i in range(10)))
        assert [p.id for p in together] == [f"u{i}" for i in range(10)]
        assert issuer.fetches == 2  # one fetch for all ten
        with pytest.raises(AuthenticationError, match=r"^Invalid token$"):
            await auth.authenticate(bearer(new, "key-3"))
        assert issuer.fetches == 2


@pytest.mark.parametrize("outage", ["status", "closed", "slow"])
async def test_the_keys_fetched_last_serve_while_the_issuer_is_down(outage: str) -> None:
    """The set is older than its cache time and the issuer cannot be reached (an error
    status, gone, too slow): tokens of the keys fetched last are still accepted at once (the
    set is fetched again in the background), the outage is logged once, and the issuer is
    asked again only after a while."""
    async with Issuer() as issuer:
        key = issuer.add("key-1")
        auth = JWTAuth(jwks_url=issuer.jwks_url, jwks_cache_seconds=0)
        keys = auth._jwks
        assert keys is not None
        keys.timeout = 0.3
        assert (await auth.authenticate(bearer(key, "key-1"))).id == "carol"
        if outage == "status":
            issuer.status = 503
        elif outage == "slow":
            issuer.delay = 1.0
        else:
            await issuer.close()
        with structlog.testing.capture_logs() as logs:
            for i in range(20):
                started = time.monotonic()
                assert (await auth.authenticate(bearer(key, "key-1", f"u{i}"))).id == f"u{i}"
                assert time.monotonic() - started < 0.2  # never held up by the issuer
            if keys._fetching is not None:  # the fetch made in the background ends
                await keys._fetching
        assert [e["event"] for e in logs] == ["could not fetch the token signing keys"]
        assert logs[0]["keeping"] == 1
        # Past `max_stale` without a fetch, the keys held are not trusted any more.
        keys.max_stale, keys.retry_after = 0.0, 0.0
        with pytest.raises(ServiceUnavailableError):
            await auth.authenticate(bearer(key, "key-1"))
        keys.retry_after = 5.0
        if outage != "closed":
            assert issuer.fetches == 3
            issuer.status, issuer.delay = 200, 0.0
            keys.retry_after = 0.0
            with structlog.testing.capture_logs() as logs:
                await auth.authenticate(bearer(key, "key-1"))
                if keys._fetching is not None:
                    await keys._fetching
            assert [e["event"] for e in logs] == ["token signing keys fetched again"]
            assert issuer.fetches == 4


@pytest.mark.parametrize("answer", ["status", "too big", "not a set", "no usable key"])
async def test_no_keys_ever_is_a_503_asked_once_at_a_time(answer: str) -> None:
    """An issuer that never gave keys: every caller is answered 503 (its token may be good),
    the requests arriving together share one fetch, and the next comes after a while."""
    async with Issuer() as issuer:
        key = issuer.add("key-1")
        issuer.delay = 0.1
        if answer == "status":
            issuer.status = 500
        elif answer == "too big":
            issuer.body = b'{"keys": [' + b" " * (2 * 1024 * 1024) + b"]}"
        elif answer == "not a set":
            issuer.body = b'["keys"]'
        else:
            issuer.body = b'{"keys": [{"kty": "RSA", "kid": "k", "n": "AQAB"}]}'
        auth = JWTAuth(jwks_url=issuer.jwks_url)
        results = await asyncio.gather(*(auth.authenticate(bearer(key, "key-1"))
                                         for _ in range(10)), return_exceptions=True)
        for result in results:
            assert isinstance(result, ServiceUnavailableError)
            assert (result.status, result.message) == (
                503, "The token's signing keys could not be fetched")
        with pytest.raises(ServiceUnavailableError):
            await auth.authenticate(bearer(key, "key-1"))
        assert issuer.fetches == 1


async def test_a_caller_that_leaves_does_not_cancel_the_others_fetch() -> None:
    async with Issuer() as issuer:
        key = issuer.add("key-1")
        issuer.delay = 0.3
        auth = JWTAuth(jwks_url=issuer.jwks_url)
        leaving = asyncio.ensure_future(auth.authenticate(bearer(key, "key-1", "leaves")))
        staying = asyncio.ensure_future(auth.authenticate(bearer(key, "key-1", "stays")))
        await asyncio.sleep(0.1)
        leaving.cancel()
        assert (await staying).id == "stays"
        assert leaving.cancelled()
        assert issuer.fetches == 1


async def test_a_token_whose_algorithm_is_not_its_keys_kind_is_a_401() -> None:
    """A forged token naming an allowed algorithm of another family than the key (ES256 or
    HS256 against an RSA key, RS256 against an EC key; issuers that publish RSA and EC keys
    allow both families) made PyJWT raise TypeError preparing the key: a 500, logged as an
    unhandled error with its stack, for anyone, before any signature was checked."""
    now = int(time.time())
    ec_key = ec.generate_private_key(ec.SECP256R1())
    async with Issuer() as issuer:
        rsa_key = issuer.add("key-1")
        cases = [
            (JWTAuth(jwks_url=issuer.jwks_url, algorithms=["RS256", "ES256"]),
             jwt.encode({"sub": "x", "exp": now + 60}, ec_key, "ES256",
                        headers={"kid": "key-1"})),
            (JWTAuth(rsa_key.public_key(), algorithms=["RS256", "ES256"]),
             jwt.encode({"sub": "x", "exp": now + 60}, ec_key, "ES256")),
            (JWTAuth(ec_key.public_key(), algorithms=["ES256", "RS256"]),
             jwt.encode({"sub": "x", "exp": now + 60}, rsa_key, "RS256")),
            (JWTAuth(ec_key.public_key(), algorithms=["ES256", "HS256"]),
             jwt.encode({"sub": "x", "exp": now + 60}, b"k" * 32, "HS256")),
        ]
        for auth, token in cases:
            with pytest.raises(AuthenticationError, match=r"^Invalid token$"):
                await auth.authenticate(RequestInfo(
                    "GET", "/info", {"authorization": f"Bearer {token}"}, "127.0.0.1"))


async def test_a_key_without_a_kid_checks_tokens_without_one() -> None:
    """`kid` is optional (RFC 7517): an issuer publishing its one key without one had every
    request answered 503 "could not be fetched", for ever (the set was refused as holding no
    key with a kid). Now a token without a kid is checked with the set's one key without a
    kid of the token's family (RSA for RS256, EC for ES256), and a token naming a kid the
    set does not hold is a 401."""
    ec_key = ec.generate_private_key(ec.SECP256R1())
    async with Issuer() as issuer:
        rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        issuer.unnamed = [rsa_key, ec_key]
        named = issuer.add("key-1")
        auth = JWTAuth(jwks_url=issuer.jwks_url, algorithms=["RS256", "ES256"])
        assert (await auth.authenticate(bearer(rsa_key, None, "rsa"))).id == "rsa"
        token = jwt.encode({"sub": "ec", "exp": int(time.time()) + 60}, ec_key, "ES256")
        assert (await auth.authenticate(RequestInfo(
            "GET", "/info", {"authorization": f"Bearer {token}"}, "127.0.0.1"))).id == "ec"
        assert (await auth.authenticate(bearer(named, "key-1", "named"))).id == "named"
        for forged in (bearer(rsa_key, "key-9"), bearer(named, None),
                       bearer(rsa_key, "key-1")):
            with pytest.raises(AuthenticationError, match=r"^Invalid token$"):
                await auth.authenticate(forged)
        assert issuer.fetches == 1


async def test_several_keys_without_a_kid_are_not_tried_in_turn() -> None:
    """Two keys of one family without a kid: a token without a kid does not say which, and
    is not tried against each (a 401, not a 503)."""
    async with Issuer() as issuer:
        first, second = (rsa.generate_private_key(public_exponent=65537, key_size=2048)
                         for _ in range(2))
        issuer.unnamed = [first, second]
        auth = JWTAuth(jwks_url=issuer.jwks_url)
        for key in (first, second):
            with pytest.raises(AuthenticationError, match=r"^Invalid token$"):
                await auth.authenticate(bearer(key, None))
        assert issuer.fetches == 1


async def test_an_issuer_whose_only_key_has_no_kid_is_used() -> None:
    async with Issuer() as issuer:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        issuer.unnamed = [key]
        auth = JWTAuth(jwks_url=issuer.jwks_url)
        assert (await auth.authenticate(bearer(key, None))).id == "carol"
        with pytest.raises(AuthenticationError, match=r"^Invalid token$"):
            await auth.authenticate(bearer(key, "key-1"))
