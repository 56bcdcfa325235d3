"""Authenticators: static bearer tokens, JWTs with a key and with a JWKS URL; thread owners
in the stores (and an SQLite database from before owners still opens)."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import rsa

from copilot_runtime import (
    AuthenticationError,
    BearerTokenAuth,
    ConfigurationError,
    JWTAuth,
    Principal,
    ServiceUnavailableError,
    SQLiteThreadStore,
)
from copilot_runtime.auth import RequestInfo
from copilot_runtime.testing import LoopbackServer
from copilot_runtime.threads import InMemoryThreadStore, StoredRun, ThreadOwner

SECRET = "a-test-secret-of-at-least-32-bytes!!"


def request(authorization: str | None) -> RequestInfo:
    headers = {"authorization": authorization} if authorization is not None else {}
    return RequestInfo("POST", "/agent/default/run", headers, "127.0.0.1")


async def test_bearer_tokens() -> None:
    auth = BearerTokenAuth({"token-alice-1": "alice",
                            "token-bob-22": Principal("bob", tenant="acme", roles={"ops"})})
    assert await auth.authenticate(request("Bearer token-alice-1")) == Principal("alice")
    bob = await auth.authenticate(request("bearer  token-bob-22 "))
    assert (bob.id, bob.tenant, bob.roles) == ("bob", "acme", frozenset({"ops"}))
    for header, message in [(None, "Missing bearer token"), ("", "Missing bearer token"),
                            ("Basic dXNlcjpwYXNz", "must be 'Bearer <token>'"),
                            ("Bearer", "must be 'Bearer <token>'"),
                            ("Bearer token-alice-2", "Invalid bearer token")]:
        with pytest.raises(AuthenticationError, match=message) as caught:
            await auth.authenticate(request(header))
        assert caught.value.status == 401
    with pytest.raises(ConfigurationError):
        BearerTokenAuth({"short": "x"})
    # What no thread store could keep as a thread's owner.
    for bad in ({"id": "a" * 257}, {"id": "a\x00b"}, {"id": "a", "tenant": "t\nx"}):
        with pytest.raises(ConfigurationError, match="A principal's"):
            Principal(**bad)
    assert "claims" not in repr(Principal("p", claims={"email": "p@example.com"}))


def token(key: Any = SECRET, algorithm: str = "HS256", headers: dict[str, Any] | None = None,
          **claims: Any) -> str:
    claims.setdefault("sub", "alice")
    claims.setdefault("exp", int(time.time()) + 60)
    return jwt.encode(claims, key, algorithm=algorithm, headers=headers)


async def test_jwt_with_a_shared_key() -> None:
    auth = JWTAuth(SECRET, algorithms=["HS256"], audience="copilot", issuer="https://idp",
                   tenant_claim="org", roles_claim="scope")
    principal = await auth.authenticate(request("Bearer " + token(
        aud="copilot", iss="https://idp", org="acme", scope="approver reader")))
    assert (principal.id, principal.tenant) == ("alice", "acme")
    assert principal.roles == {"approver", "reader"}
    assert principal.claims["org"] == "acme"
    bad = {
        "expired": token(aud="copilot", iss="https://idp", exp=int(time.time()) - 120),
        "wrong audience": token(aud="other", iss="https://idp"),
        "wrong issuer": token(aud="copilot", iss="https://evil"),
        "wrong key": token("another-secret-of-at-least-32-bytes!", aud="copilot",
                           iss="https://idp"),
        "no exp": jwt.encode({"sub": "a", "aud": "copilot", "iss": "https://idp"}, SECRET,
                             algorithm="HS256"),
        "no sub": token(sub="", aud="copilot", iss="https://idp"),
        # What no thread store can keep as an owner (PostgreSQL's text cannot hold NUL).
        "NUL in sub": token(sub="ali\x00ce", aud="copilot", iss="https://idp"),
        "long sub": token(sub="a" * 257, aud="copilot", iss="https://idp"),
        "NUL in tenant": token(aud="copilot", iss="https://idp", org="ac\x00me"),
        "alg none": jwt.encode({"sub": "a", "exp": int(time.time()) + 60, "aud": "copilot",
                                "iss": "https://idp"}, None, algorithm="none"),
        "garbage": "not.a.jwt",
    }
    for what, value in bad.items():
        with pytest.raises(AuthenticationError) as caught:
            await auth.authenticate(request("Bearer " + value))
        assert caught.value.status == 401, what
        assert SECRET not in caught.value.message
    with pytest.raises(ConfigurationError):
        JWTAuth(SECRET, algorithms=["none"])
    with pytest.raises(ConfigurationError):
        JWTAuth()


class JWKSServer(LoopbackServer):
    def __init__(self, jwks: dict[str, Any]) -> None:
        super().__init__()
        self.jwks = jwks
        self.fetches = 0

    def routes(self, app: web.Application) -> None:
        async def keys(request: web.Request) -> web.Response:
            self.fetches += 1
            return web.json_response(self.jwks)

        app.router.add_get("/.well-known/jwks.json", keys)


async def test_jwt_with_a_jwks_url() -> None:
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public_jwk = jwt.algorithms.RSAAlgorithm.to_jwk(private.public_key(), as_dict=True)
    public_jwk.update(kid="key-1", use="sig", alg="RS256")
    async with JWKSServer({"keys": [public_jwk]}) as server:
        url = f"http://{server.host}:{server.port}/.well-known/jwks.json"
        auth = JWTAuth(jwks_url=url, algorithms=["RS256"], audience="copilot")
        signed = token(private, "RS256", {"kid": "key-1"}, aud="copilot", sub="carol")
        assert (await auth.authenticate(request("Bearer " + signed))).id == "carol"
        assert (await auth.authenticate(request("Bearer " + signed))).id == "carol"
        assert server.fetches == 1  # cached
        other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        for forged in (token(other, "RS256", {"kid": "key-1"}, aud="copilot"),
                       token(other, "RS256", {"kid": "key-9"}, aud="copilot")):
            with pytest.raises(AuthenticationError):
                await auth.authenticate(request("Bearer " + forged))
    unreachable = JWTAuth(jwks_url=url, algorithms=["RS256"], audience="copilot")
    # The token may be good: the runtime cannot tell yet (503, not 401).
    with pytest.raises(ServiceUnavailableError, match="could not be fetched"):
        await unreachable.authenticate(request("Bearer " + signed))


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_stores_record_and_filter_owners(kind: str, tmp_path: Path) -> None:
    store = InMemoryThreadStore() if kind == "memory" else SQLiteThreadStore(
        tmp_path / "t.sqlite3")
    alice, acme_alice = ThreadOwner("alice"), ThreadOwner("alice", "acme")
    await store.append_run("a1", "default", StoredRun("r1", [], 1.0), [], owner=alice)
    await store.append_run("a2", "default", StoredRun("r1", [], 2.0), [], owner=acme_alice)
    await store.append_run("n1", "default", StoredRun("r1", [], 3.0), [])
    # A later run never changes the owner.
    await store.append_run("a1", "default", StoredRun("r2", [], 4.0), [],
                           owner=ThreadOwner("bob"))
    record = await store.get("a1")
    assert record is not None
    assert record.owner == alice
    assert len(record.runs) == 2
    assert [r.thread_id for r in await store.list(owner=alice)] == ["a1"]
    assert [r.thread_id for r in await store.list(owner=acme_alice)] == ["a2"]
    assert [r.thread_id for r in await store.list(owner=ThreadOwner("bob"))] == []
    assert [r.thread_id for r in await store.list()] == ["a1", "n1", "a2"]
    assert (await store.list(agent_id="default", owner=alice))[0].owner == alice
    await store.aclose()


async def test_an_sqlite_database_from_before_owners_opens(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE threads (thread_id TEXT PRIMARY KEY, agent_id TEXT NOT NULL,
                              created_at REAL NOT NULL, updated_at REAL NOT NULL);
        CREATE TABLE runs (thread_id TEXT NOT NULL, seq INTEGER NOT NULL, run_id TEXT NOT NULL,
                           created_at REAL NOT NULL, events BLOB NOT NULL,
                           PRIMARY KEY (thread_id, seq));
        CREATE TABLE message_ids (thread_id TEXT NOT NULL, message_id TEXT NOT NULL,
                                  PRIMARY KEY (thread_id, message_id)) WITHOUT ROWID;
        INSERT INTO threads VALUES ('old', 'default', 1.0, 1.0);
        INSERT INTO runs VALUES ('old', 1, 'r1', 1.0, '[]');
    """)
    db.commit()
    db.close()
    store = SQLiteThreadStore(path)
    record = await store.get("old")
    assert record is not None
    assert record.owner is None
    assert len(record.runs) == 1
    await store.append_run("new", "default", StoredRun("r1", [], 2.0), [],
                           owner=ThreadOwner("alice"))
    assert [r.thread_id for r in await store.list(owner=ThreadOwner("alice"))] == ["new"]
    await store.aclose()
    again = SQLiteThreadStore(path)  # the migration runs once
    assert {r.thread_id for r in await again.list()} == {"old", "new"}
    await again.aclose()


_WITHOUT_EXTRAS = """
import sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"jwt", "opentelemetry", "redis"}:
            raise ImportError(f"no module named {name!r} (blocked)")

sys.meta_path.insert(0, Blocked())
import copilot_runtime as cr
from copilot_runtime.telemetry import Telemetry, configure_logging

cr.CopilotRuntime(service_adapter=cr.DemoAdapter(), auth=cr.BearerTokenAuth({"tok-1234567": "a"}),
                  rate_limit=cr.RateLimit(runs_per_minute=1),
                  guardrails=[cr.PatternGuardrail(deny=["x"])])
for make in (lambda: cr.JWTAuth("k", algorithms=["HS256"]), Telemetry,
             lambda: cr.CopilotRuntime(rate_limit=cr.RateLimit(runs_per_minute=1,
                                                               backend="redis://127.0.0.1"))):
    try:
        make()
    except cr.ConfigurationError as exc:
        print(exc)
"""


def test_the_core_works_without_the_extras() -> None:
    """auth, otel and redis are extras: without them the rest works, and each feature that
    needs one says which to install."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _WITHOUT_EXTRAS], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "JWTAuth needs PyJWT: pip install 'copilot-runtime[auth]'",
        "Telemetry needs the OpenTelemetry API: pip install 'copilot-runtime[otel]'",
        "Redis rate limits need redis-py: pip install 'copilot-runtime[redis]'"]
