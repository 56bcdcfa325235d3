"""JWT claims naming a thread's owner: the principal and its tenant are non-empty strings.

Before, a tenant claim of another JSON type was turned into a string: a token saying
`"org": 5` and one saying `"org": "5"` were one tenant (and `true`, `[1]`, `{}` tenants
"True", "[1]", "{}"), so one tenant's callers could be made to share threads with another
by an issuer that types the claim loosely. Now such a token is refused (401), as a
principal claim that is not a non-empty string already was."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import jwt
import orjson
import pytest

from copilot_runtime import (
    AuthenticationError,
    BearerTokenAuth,
    ConfigurationError,
    JWTAuth,
    Principal,
    SQLiteThreadStore,
)
from copilot_runtime.auth import RequestInfo
from copilot_runtime.testing import MockOpenAIServer
from tests.conftest import ServeRuntime, openai_runtime, run_input

SECRET = "a-test-secret-of-at-least-32-bytes!!"


def _request(**claims: Any) -> RequestInfo:
    claims.setdefault("sub", "alice")
    claims.setdefault("exp", int(time.time()) + 60)
    token = jwt.encode(claims, SECRET, algorithm="HS256")
    return RequestInfo("GET", "/info", {"authorization": f"Bearer {token}"}, "127.0.0.1")


def _auth(principal_claim: str = "sub") -> JWTAuth:
    return JWTAuth(SECRET, algorithms=["HS256"], tenant_claim="org",
                   principal_claim=principal_claim)


NOT_STRINGS = [5, 0, 1.5, True, False, [], ["acme"], {}, {"id": "acme"}, ""]
IDS = ["int", "zero", "float", "true", "false", "empty-list", "list", "empty-dict", "dict",
       "empty-string"]


@pytest.mark.parametrize("tenant", NOT_STRINGS, ids=IDS)
async def test_a_tenant_claim_that_is_not_a_non_empty_string_is_a_401(tenant: Any) -> None:
    with pytest.raises(AuthenticationError) as caught:
        await _auth().authenticate(_request(org=tenant))
    assert caught.value.status == 401
    assert caught.value.message == "The token's 'org' claim is not a non-empty string"


@pytest.mark.parametrize("subject", NOT_STRINGS, ids=IDS)
async def test_a_principal_claim_that_is_not_a_non_empty_string_is_a_401(subject: Any) -> None:
    """A claim PyJWT does not check (`sub` it does, but for being empty)."""
    with pytest.raises(AuthenticationError) as caught:
        await _auth("uid").authenticate(_request(uid=subject))
    assert caught.value.status == 401
    assert caught.value.message == "The token's 'uid' claim is not a non-empty string"
    with pytest.raises(AuthenticationError) as caught:
        await _auth().authenticate(_request(sub=subject))
    assert caught.value.status == 401


async def test_tenants_of_strings_and_tokens_without_one_still_pass() -> None:
    auth = _auth()
    assert (await auth.authenticate(_request(org="5"))).tenant == "5"
    assert (await auth.authenticate(_request())).tenant is None
    assert (await auth.authenticate(_request(org=None))).tenant is None
    assert (await _auth("uid").authenticate(_request(uid="u-1"))).id == "u-1"
    with pytest.raises(AuthenticationError, match="The token has no 'uid' claim"):
        await _auth("uid").authenticate(_request())


async def test_a_numeric_tenant_is_refused_over_http(serve_runtime: ServeRuntime,
                                                      llm: MockOpenAIServer) -> None:
    """The 401 says which claim, nothing of the token or the key."""
    async with serve_runtime(openai_runtime(llm, auth=_auth())) as served:
        for org, status in (("5", 200), (5, 401), (True, 401)):
            token = _request(org=org).headers["authorization"]
            response = await served.session.get(served.url + "/info",
                                                headers={"Authorization": token})
            body = await response.read()
            assert response.status == status, body
            if status == 401:
                assert orjson.loads(body)["code"] == "AUTHENTICATION_ERROR"
                assert b"'org' claim" in body
                assert SECRET.encode() not in body
                assert token.removeprefix("Bearer ").encode() not in body


@pytest.mark.parametrize("claims", [
    {"sub": "mallory\ud800"}, {"sub": "\udfffmallory"}, {"org": "acme\udfff"},
    {"sub": "."}, {"sub": ".."}],
    ids=["sub-high-surrogate", "sub-low-surrogate", "tenant-surrogate", "sub-dot",
         "sub-dot-dot"])
async def test_a_claim_no_store_keeps_or_no_url_carries_is_a_401(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer, tmp_path: Path,
        claims: dict[str, str]) -> None:
    """A lone surrogate (a JSON escape PyJWT keeps, as `"\\ud800"`) passed as an id: the
    listings answered 500 and every run streamed to its end and was never stored. A `sub`
    of "." or ".." passed too, though the bounds on ids refuse them. Each is a 401 now, on
    every route, and nothing is stored."""
    runtime = openai_runtime(llm, auth=_auth(),
                             thread_store=SQLiteThreadStore(tmp_path / "threads.sqlite3"))
    async with serve_runtime(runtime) as served:
        token = _request(**claims).headers["authorization"]
        for method, path, body in (("GET", "/threads", None), ("GET", "/approvals", None),
                                   ("POST", "/agent/default/run", run_input("hi"))):
            response = await served.session.request(
                method, served.url + path, data=None if body is None else orjson.dumps(body),
                headers={"Authorization": token, "Content-Type": "application/json"})
            answer = await response.read()
            assert response.status == 401, (path, answer)
            assert orjson.loads(answer)["code"] == "AUTHENTICATION_ERROR"
            assert b"claim is not a usable id" in answer
        assert (await runtime.store.list()) == []
        fine = _request(sub="mallory", org="acme").headers["authorization"]
        response = await served.session.get(served.url + "/threads",
                                            headers={"Authorization": fine})
        assert response.status == 200, await response.text()


@pytest.mark.parametrize("tenant", [5, True, b"t"])
def test_a_principals_tenant_is_a_string(tenant: Any) -> None:
    """A tenant of another type passed (its runs streamed, then every store's write failed
    and the caller's thread list answered 500)."""
    with pytest.raises(ConfigurationError, match="tenant is a string or None"):
        Principal("alice", tenant=tenant)
    assert Principal("alice", tenant="acme").tenant == "acme"


@pytest.mark.parametrize("value", [".", "..", "copilot-suggestion-1", "a\ud800", "a\nb"])
async def test_a_principal_is_held_to_what_a_tokens_claims_are(value: str) -> None:
    """A JWT's `sub` or tenant of "." or ".." (or one starting `copilot-suggestion-`) is
    refused, but a `Principal` built with one (a bearer token's, a custom authenticator's)
    was accepted: the same owner ids passed by one route and not the other. Both refuse
    them now, as the documented bounds on ids say."""
    with pytest.raises(AuthenticationError, match="claim is not a usable id"):
        await _auth().authenticate(_request(sub=value))
    for made in ({"id": value}, {"id": "alice", "tenant": value}):
        with pytest.raises(ConfigurationError, match="A principal's"):
            Principal(**made)
    with pytest.raises(ConfigurationError, match="A principal's id"):
        BearerTokenAuth({"token-of-an-odd-id": value})


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ahead", [1, 2, 20])
async def test_a_fresh_token_from_an_issuer_whose_clock_is_a_little_ahead_passes(
        ahead: int) -> None:
    """PyJWT refuses an `iat` (or `nbf`) later than now plus the leeway, and the leeway was 0:
    a token issued a second ago by an issuer whose clock ran 1 s ahead of ours was a 401
    "Invalid token". The default leeway (30 s) now absorbs such skew."""
    issued = int(time.time()) + ahead
    principal = await _auth().authenticate(
        _request(iat=issued, nbf=issued - 10, exp=issued + 60))
    assert principal.id == "alice"


@pytest.mark.timeout(30)
async def test_a_token_from_the_future_past_the_leeway_is_refused_precisely() -> None:
    issued = int(time.time()) + 120
    for auth in (_auth(), JWTAuth(SECRET, algorithms=["HS256"], leeway=0)):
        with pytest.raises(AuthenticationError) as caught:
            await auth.authenticate(_request(iat=issued, exp=issued + 60))
        assert caught.value.status == 401
        assert caught.value.message == "The token is not valid yet"
    with pytest.raises(AuthenticationError, match="not valid yet"):
        await JWTAuth(SECRET, algorithms=["HS256"], leeway=0).authenticate(
            _request(iat=int(time.time()) + 2))


@pytest.mark.timeout(30)
async def test_a_leeway_given_as_a_timedelta_is_its_seconds() -> None:
    """PyJWT takes a `timedelta` leeway, and JWTAuth passed it on; the check that it is
    seconds refused it. It is taken as its seconds, held to the same bounds."""
    auth = JWTAuth(SECRET, algorithms=["HS256"], leeway=timedelta(seconds=10))
    principal = await auth.authenticate(_request(exp=int(time.time()) - 5))
    assert principal.id == "alice"
    with pytest.raises(AuthenticationError):
        await auth.authenticate(_request(exp=int(time.time()) - 20))
    with pytest.raises(ConfigurationError, match="leeway"):
        JWTAuth(SECRET, algorithms=["HS256"], leeway=timedelta(seconds=-1))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("leeway", [-1, float("nan"), float("inf"), True, "30"])
def test_a_leeway_that_is_not_seconds_is_refused(leeway: Any) -> None:
    with pytest.raises(ConfigurationError, match="leeway"):
        JWTAuth(SECRET, algorithms=["HS256"], leeway=leeway)
