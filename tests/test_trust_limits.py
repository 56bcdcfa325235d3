"""Rate limits: a caller over its limit gets 429 with Retry-After on both protocols while
another caller still works; counters in this process and in Redis; allowed models."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest

from copilot_runtime import (
    BearerTokenAuth,
    CopilotRuntime,
    OpenAIAdapter,
    RateLimit,
)
from copilot_runtime._exceptions import (
    ConfigurationError,
    RateLimitedError,
    ServiceUnavailableError,
)
from copilot_runtime.agents import BuiltInAgent
from copilot_runtime.auth import Principal, RequestInfo
from copilot_runtime.limits import InMemoryCounters, RateLimiter, RedisCounters
from copilot_runtime.testing import MockOpenAIServer
from tests.conftest import Served, ServeRuntime, parse_sse, run_input, text_of, types
from tests.gql.wire import CHAT_DOCUMENT, CLIENT_HEADERS, user_turn
from tests.scale_support.services import redis_prefix

pytestmark = pytest.mark.timeout(60)

ALICE, BOB = "tok-alice-0001", "tok-bob-00002"
USERS = BearerTokenAuth({ALICE: "alice", BOB: "bob"})


def adapter(llm: MockOpenAIServer) -> OpenAIAdapter:
    return OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock", max_retries=0)


async def run(served: Served, token: str | None, thread: str, text: str = "Hi"
              ) -> tuple[int, bytes, dict[str, str]]:
    response = await served.session.post(
        served.url + "/agent/default/run", data=orjson.dumps(run_input(text, thread=thread)),
        headers={"Content-Type": "application/json",
                 **({"Authorization": f"Bearer {token}"} if token else {})})
    return response.status, await response.read(), dict(response.headers)


@pytest.fixture
async def limited(serve_runtime: ServeRuntime, llm: MockOpenAIServer
                  ) -> AsyncIterator[Served]:
    runtime = CopilotRuntime(service_adapter=adapter(llm), auth=USERS,
                             rate_limit=RateLimit(runs_per_minute=2))
    async with serve_runtime(runtime) as served:
        yield served


async def test_runs_per_minute_per_principal(limited: Served, llm: MockOpenAIServer) -> None:
    served = limited
    for n in range(2):
        status, _, _ = await run(served, ALICE, f"a{n}")
        assert status == 200
    status, body, headers = await run(served, ALICE, "a3")
    assert status == 429
    assert 1 <= int(headers["Retry-After"]) <= 60
    assert orjson.loads(body)["code"] == "RATE_LIMITED"
    assert await served.runtime.store.get("a3") is None
    calls = len(llm.requests)
    # Bob is not affected.
    status, body, _ = await run(served, BOB, "b1", "Still here")
    assert status == 200
    assert text_of(parse_sse(body)) == "echo: Still here"
    assert len(llm.requests) == calls + 1
    # Over GraphQL: the same HTTP answer, before anything streams; the 1.10 client gets it
    # with 200, as it reads no error answer from 400 to 500.
    for client, status in (({"X-CopilotKit-Runtime-Client-GQL-Version": "1.10.6"}, 200),
                           ({}, 429)):
        response = await served.session.post(served.url, data=orjson.dumps({
            "query": "mutation($data: GenerateCopilotResponseInput!) { generateCopilotResponse("
                     "data: $data) { threadId } }",
            "variables": {"data": {"threadId": "g1", "frontend": {"actions": []},
                                   "metadata": {"requestType": "Chat"}, "messages": []}}}),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {ALICE}",
                     **client})
        assert response.status == status
        assert int(response.headers["Retry-After"]) >= 1
        extensions = (await response.json())["errors"][0]["extensions"]
        assert (extensions["code"], extensions["runtimeCode"]) == ("MISUSE", "RATE_LIMITED")
        assert extensions["statusCode"] == 429


async def test_concurrent_runs_and_anonymous_callers(serve_runtime: ServeRuntime,
                                                     llm: MockOpenAIServer) -> None:
    runtime = CopilotRuntime(service_adapter=adapter(llm), auth=USERS,
                             rate_limit=RateLimit(concurrent_runs=1))
    async with serve_runtime(runtime) as served:
        slow = asyncio.create_task(run(served, ALICE, "slow", "slow:100 a b c d"))
        for _ in range(300):
            if "slow" in runtime.runs.active:
                break
            await asyncio.sleep(0.01)
        status, _, headers = await run(served, ALICE, "other")
        assert (status, headers["Retry-After"]) == (429, "1")
        assert (await run(served, BOB, "bob"))[0] == 200
        status, body, _ = await slow
        assert status == 200
        assert types(parse_sse(body))[-1] == "RUN_FINISHED"
        for _ in range(100):  # the slot is given back just after the end
            status, _, _ = await run(served, ALICE, f"again-{_}")
            if status == 200:
                break
            await asyncio.sleep(0.02)
        assert status == 200

    anonymous = CopilotRuntime(service_adapter=adapter(llm),
                               rate_limit=RateLimit(runs_per_minute=1))
    assert anonymous.wants_request_info
    async with serve_runtime(anonymous) as served:
        assert (await run(served, None, "x1"))[0] == 200
        assert (await run(served, None, "x2"))[0] == 429  # by client address


class SlowToRelease(RedisCounters):
    """Counters whose release takes a moment to be sent (a busy event loop, a far Redis)."""

    async def release(self, key: str, token: str) -> None:
        await asyncio.sleep(0.2)
        await super().release(key, token)


async def test_a_shutdown_mid_run_gives_the_callers_slot_back(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    """The limiter was closed before the runs a shutdown cut short had ended: their slots,
    given back as they ended, went to a closed Redis client, and each restart locked their
    callers out for an hour (429 on every other worker)."""
    prefix = f"copilot-runtime-test:{uuid.uuid4().hex}:"
    url = "redis://127.0.0.1:6379/0"
    runtime = CopilotRuntime(service_adapter=adapter(llm), auth=USERS, rate_limit=RateLimit(
        concurrent_runs=1, backend=SlowToRelease(url, prefix=prefix)))
    other = RateLimiter(RateLimit(concurrent_runs=1, backend=RedisCounters(url, prefix=prefix)))
    try:
        async with serve_runtime(runtime) as served:
            slow = asyncio.create_task(run(served, ALICE, "slow", "slow:200 " + "a " * 50))
            for _ in range(300):
                if "slow" in runtime.runs.active:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(RateLimitedError):  # the slot is taken, on every worker
                await other.acquire(caller("alice"))
            await runtime.aclose()  # a SIGTERM: the run is cut short
            await asyncio.wait_for(slow, 10)
        again = await other.acquire(caller("alice"))
        assert again is not None
        await again.release()
    finally:
        redis = other.backend._redis  # type: ignore[attr-defined]
        keys = [k async for k in redis.scan_iter(match=prefix + "*")]
        if keys:
            await redis.delete(*keys)
        await other.aclose()


async def test_allowed_models(serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    runtime = CopilotRuntime(agents={"default": BuiltInAgent(
        adapter(llm), allowed_models=["gpt-4o-mini"])})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("Hi", forwardedProps={"model": "gpt-4o"}))
        assert events[-1]["type"] == "RUN_ERROR"
        assert events[-1]["code"] == "MODEL_NOT_ALLOWED"
        assert "gpt-4o-mini" in events[-1]["message"]
        assert llm.requests == []
        events = await served.run(run_input("Hi", thread="t2",
                                            forwardedProps={"model": "gpt-4o-mini"}))
        assert text_of(events) == "echo: Hi"
        assert llm.requests[-1]["model"] == "gpt-4o-mini"


async def test_many_new_callers_do_not_reset_a_limited_callers_window() -> None:
    """Before: once the in-process counters were full of live keys, each new key evicted the
    oldest tenth, so hits from many addresses (IPv6 gives each client plenty) reset another
    caller's window and let it start runs again at once. Live windows are never forgotten
    now: while full, a new caller waits for the first window to end."""
    counters = InMemoryCounters(max_keys=100)
    limiter = RateLimiter(RateLimit(runs_per_minute=2, backend=counters))
    for _ in range(2):
        await limiter.acquire(caller("victim"))
    with pytest.raises(RateLimitedError, match="a minute"):
        await limiter.acquire(caller("victim"))
    for n in range(99):  # the victim's key and these fill it
        await limiter.acquire(RequestInfo("POST", "/run", {}, f"2001:db8::{n:x}"))
    for n in range(99, 1000):
        with pytest.raises(RateLimitedError, match="Too many callers") as caught:
            await limiter.acquire(RequestInfo("POST", "/run", {}, f"2001:db8::{n:x}"))
        assert 1 <= caught.value.retry_after <= 61
    with pytest.raises(RateLimitedError, match="a minute"):  # still limited
        await limiter.acquire(caller("victim"))
    await limiter.aclose()
    # Once the windows end, their keys go and new callers come in.
    small = InMemoryCounters(max_keys=2)
    assert [await small.hit(key, 1, 0.2) for key in ("a", "b")] == [0.0, 0.0]
    with pytest.raises(RateLimitedError, match="Too many callers"):
        await small.hit("c", 1, 0.2)
    await asyncio.sleep(0.25)
    assert await small.hit("c", 1, 0.2) == 0.0


def caller(principal: str) -> RequestInfo:
    return RequestInfo("POST", "/run", {}, "10.0.0.1", principal=Principal(principal))


async def test_redis_counters_are_shared_by_workers() -> None:
    prefix = f"copilot-runtime-test:{uuid.uuid4().hex}:"
    url = "redis://127.0.0.1:6379/0"
    workers = [RateLimiter(RateLimit(runs_per_minute=3, concurrent_runs=2,
                                     backend=RedisCounters(url, prefix=prefix)))
               for _ in range(2)]
    try:
        first = await workers[0].acquire(caller("alice"))
        second = await workers[1].acquire(caller("alice"))
        with pytest.raises(RateLimitedError, match="at once"):
            await workers[0].acquire(caller("alice"))
        assert first is not None
        assert second is not None
        await first.release()
        await first.release()  # once only
        third = await workers[1].acquire(caller("alice"))  # the 3rd start this minute
        assert third is not None
        await second.release()
        await third.release()
        with pytest.raises(RateLimitedError, match="a minute") as caught:
            await workers[0].acquire(caller("alice"))
        assert 1 <= caught.value.retry_after <= 61
        assert await workers[1].acquire(caller("bob")) is not None
    finally:
        redis = workers[0].backend._redis  # type: ignore[attr-defined]
        keys = [k async for k in redis.scan_iter(match=prefix + "*")]
        if keys:
            await redis.delete(*keys)
        for worker in workers:
            await worker.aclose()
    with pytest.raises(ConfigurationError):
        RateLimit()
    with pytest.raises(ConfigurationError):
        RateLimiter(RateLimit(runs_per_minute=1, backend="http://nope"))


@pytest.mark.parametrize(("url", "expected"), [
    ("redis://127.0.0.1:6379/0?bogus=1", "'bogus' is not an option of a Redis URL"),
    ("redis://127.0.0.1:6379/0?lease_ttl=5", "'lease_ttl' is not an option of a Redis URL"),
    ("redis://127.0.0.1:6379/0?socket_timeout=abc",
     "cannot read the Redis URL: Invalid value for 'socket_timeout'"),
    ("redis://127.0.0.1:6379/abc", "a Redis URL's path is its database number, got 'abc'"),
    ("redis://127.0.0.1:99999/0", "a Redis URL's port must be 1-65535, got '99999'"),
], ids=["unknown-option", "coordinator-only-option", "bad-value", "db-path", "port"])
def test_a_backend_url_no_server_could_accept_is_refused_when_built(
        url: str, expected: str) -> None:
    """Before: the runtime was built and started, /ready said 200, and every run was a 500
    (`TypeError: ... unexpected keyword argument 'bogus'` at each connection), or a path
    that is no database number used database 0 without a word."""
    with pytest.raises(ConfigurationError, match=expected):
        CopilotRuntime(rate_limit=RateLimit(runs_per_minute=100, backend=url))


async def test_a_backend_urls_prefix_names_the_keys_as_a_coordinators() -> None:
    """Before: `?prefix=` (as a coordinator's URL takes it) reached redis-py, and every run
    was a 500. The counters live under the prefix's `limits:`, where a coordinator with the
    same URL keeps them."""
    prefix = f"copilot-runtime-test:{uuid.uuid4().hex}:"
    limiter = RateLimiter(RateLimit(
        runs_per_minute=5, backend=f"redis://127.0.0.1:6379/0?prefix={prefix}&pool_size=2"))
    redis = limiter.backend._redis  # type: ignore[attr-defined]
    try:
        assert limiter.backend.prefix == prefix + "limits:"  # type: ignore[attr-defined]
        assert (await limiter.acquire(caller("alice"))).token is None  # no slot to hold
        assert [k async for k in redis.scan_iter(match=prefix + "limits:rate:*")]
    finally:
        keys = [k async for k in redis.scan_iter(match=prefix + "*")]
        if keys:
            await redis.delete(*keys)
        await limiter.aclose()


@pytest.fixture(params=["memory", "redis"])
def counters(request: pytest.FixtureRequest) -> Iterator[InMemoryCounters | RedisCounters]:
    if request.param == "memory":
        yield InMemoryCounters()
        return
    with redis_prefix() as url:
        yield RedisCounters(url)


async def test_requests_that_start_no_run_do_not_count(
        counters: InMemoryCounters | RedisCounters, serve_runtime: ServeRuntime,
        llm: MockOpenAIServer) -> None:
    """Before: a request counted towards `runs_per_minute` before its run was reserved, so
    one refused 409 THREAD_BUSY or 404 (another caller's thread) spent the caller's budget:
    a client retrying on a busy thread locked itself out for a minute. Only runs that start
    count now, on both protocols and every backend."""
    runtime = CopilotRuntime(service_adapter=adapter(llm), auth=USERS,
                             rate_limit=RateLimit(runs_per_minute=2, backend=counters))
    async with serve_runtime(runtime) as served:
        slow = asyncio.create_task(run(served, ALICE, "busy", "slow:100 a b c d"))
        for _ in range(300):
            if "busy" in runtime.runs.active:
                break
            await asyncio.sleep(0.01)
        for _ in range(3):
            status, body, _ = await run(served, ALICE, "busy")
            assert (status, orjson.loads(body)["code"]) == (409, "THREAD_BUSY")
            assert (await generate(served, ALICE, "busy"))["runtimeCode"] == "THREAD_BUSY"
        status, body, _ = await slow
        assert status == 200
        for _ in range(3):  # alice's thread: not found for bob
            status, body, _ = await run(served, BOB, "busy")
            assert (status, orjson.loads(body)["code"]) == (404, "THREAD_NOT_FOUND"), body
            assert (await generate(served, BOB, "busy"))["statusCode"] == 404
        summary = runtime.store.summary

        async def away(thread_id: str) -> Any:
            if thread_id == "away":
                raise ServiceUnavailableError("The thread store cannot be reached")
            return await summary(thread_id)

        runtime.store.summary = away  # type: ignore[method-assign]
        for _ in range(3):
            assert (await run(served, ALICE, "away"))[0] == 503
        assert (await run(served, ALICE, "second"))[0] == 200
        assert (await run(served, ALICE, "third"))[0] == 429  # still exactly 2 a minute
        assert [(await run(served, BOB, f"b{n}"))[0] for n in range(3)] == [200, 200, 429]


async def generate(served: Served, token: str, thread: str) -> dict[str, Any]:
    """A GraphQL run's refusal: its error's extensions."""
    response = await served.session.post(served.url, data=orjson.dumps({
        "query": CHAT_DOCUMENT, "variables": {"data": user_turn("Hi", thread=thread)}}),
        headers={**CLIENT_HEADERS, "Authorization": f"Bearer {token}"})
    body = await response.read()
    extensions: dict[str, Any] = orjson.loads(body)["errors"][0]["extensions"]
    return extensions
