"""OpenAI reasoning models (o1, o3-mini, o4-mini, gpt-5...) refuse `max_tokens` and any
`temperature` but 1: a client's maxTokens becomes `max_completion_tokens` for them and its
temperature and (all but o1 and o3-mini) its stop are left out (with a warning), on both of
the adapter's routes and from both protocols; every other model, and every
OpenAI-compatible server's, keeps `max_tokens`. A guardrail judge's own settings fit the
model quietly, with room to reason."""

from __future__ import annotations

from typing import Any, Literal

import aiohttp
import pytest
from ag_ui.core import UserMessage
from structlog.testing import capture_logs

from copilot_runtime import OpenAIAdapter, TopicGuardrail
from copilot_runtime.adapters import ChatRequest, StreamEnd, TextDelta
from copilot_runtime.adapters.openai import is_reasoning_model
from copilot_runtime.testing import MockOpenAIServer, verify_events
from tests.conftest import ServeRuntime, openai_runtime, run_input
from tests.gql.wire import user_turn
from tests.test_graphql_protocol import generate

pytestmark = pytest.mark.timeout(30)

_UNSET = object()


async def _answer(adapter: OpenAIAdapter, request: ChatRequest) -> str:
    try:
        deltas = [d async for batch in adapter.stream(request) for d in batch]
    finally:
        await adapter.aclose()
    assert isinstance(deltas[-1], StreamEnd)
    return "".join(d.text for d in deltas if isinstance(d, TextDelta))


@pytest.mark.parametrize("transport", ["direct", "sdk"])
@pytest.mark.parametrize(("model", "max_tokens_field", "temperature"), [
    ("gpt-4o", "max_tokens", 0.2),
    ("gpt-4.1-mini", "max_tokens", 0.2),
    ("gpt-5-chat-latest", "max_tokens", 0.2),  # GPT-5's chat model does not reason
    ("o1", "max_completion_tokens", _UNSET),
    ("o3-mini", "max_completion_tokens", _UNSET),
    ("o4-mini", "max_completion_tokens", _UNSET),
    ("gpt-5", "max_completion_tokens", _UNSET),
    ("gpt-5-mini", "max_completion_tokens", _UNSET),
    ("gpt-5.1", "max_completion_tokens", _UNSET),
])
async def test_what_openai_receives_for_each_model_family(
        llm: MockOpenAIServer, transport: Literal["direct", "sdk"], model: str,
        max_tokens_field: str, temperature: Any) -> None:
    adapter = OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock", max_retries=0,
                            transport=transport)
    assert adapter.transport == transport
    with capture_logs() as logs:
        text = await _answer(adapter, ChatRequest(
            messages=[UserMessage(id="u", content="hi")], model=model, temperature=0.2,
            max_tokens=50))
    assert text == "echo: hi"
    sent = llm.requests[-1]
    assert sent["model"] == model
    assert sent[max_tokens_field] == 50
    assert len({"max_tokens", "max_completion_tokens"} & set(sent)) == 1
    assert sent.get("temperature", _UNSET) == temperature
    dropped = [e for e in logs if e["event"] == "temperature not sent to a reasoning model"]
    if temperature is _UNSET:
        assert dropped
        assert dropped[0]["log_level"] == "warning"
        assert (dropped[0]["model"], dropped[0]["temperature"]) == (model, 0.2)
    else:
        assert not dropped


@pytest.mark.parametrize("model", ["o3-mini", "gpt-5"])
async def test_a_reasoning_model_without_settings_gets_none_and_no_warning(
        llm: MockOpenAIServer, model: str) -> None:
    adapter = OpenAIAdapter(base_url=llm.base_url, max_retries=0, model=model)
    with capture_logs() as logs:
        assert await _answer(adapter, ChatRequest(
            messages=[UserMessage(id="u", content="hi")])) == "echo: hi"
    sent = llm.requests[-1]
    assert not {"max_tokens", "max_completion_tokens", "temperature"} & set(sent)
    assert not [e for e in logs if e["log_level"] == "warning"]


async def test_gpt_5_1_told_not_to_reason_keeps_its_temperature(llm: MockOpenAIServer) -> None:
    """GPT-5.1 and later take sampling settings when `reasoning_effort` is "none" (set with
    `extra_body`); GPT-5 never does."""
    for model, kept in (("gpt-5.1", True), ("gpt-5.2-mini", True), ("gpt-5", False)):
        adapter = OpenAIAdapter(base_url=llm.base_url, max_retries=0, model=model,
                                extra_body={"reasoning_effort": "none"})
        await _answer(adapter, ChatRequest(messages=[UserMessage(id="u", content="hi")],
                                           temperature=0.3, max_tokens=9))
        sent = llm.requests[-1]
        assert ("temperature" in sent) == kept, model
        assert sent["max_completion_tokens"] == 9


@pytest.mark.parametrize(("reasoning_model", "model", "field", "temperature"), [
    # an Azure deployment named freely, running o3-mini
    (True, "my-deployment", "max_completion_tokens", None),
    # a server that serves a model named like OpenAI's but wants max_tokens
    (False, "o3-mini", "max_tokens", 0.2),
])
def test_reasoning_model_option_overrides_the_name(reasoning_model: bool, model: str,
                                                   field: str, temperature: float | None) -> None:
    adapter = OpenAIAdapter(base_url="http://127.0.0.1:1/v1", model=model,
                            reasoning_model=reasoning_model)
    params = adapter.build_params(ChatRequest(messages=[UserMessage(id="u", content="hi")],
                                              temperature=0.2, max_tokens=7))
    assert params[field] == 7
    assert len({"max_tokens", "max_completion_tokens"} & set(params)) == 1
    assert params.get("temperature") == temperature


@pytest.mark.parametrize(("model", "reasoning"), [
    ("o1", True), ("o1-mini", True), ("o1-preview", True), ("o3", True), ("o3-mini", True),
    ("o3-pro-2025-06-10", True), ("o4-mini", True), ("gpt-5", True), ("gpt-5-mini", True),
    ("gpt-5-nano", True), ("gpt-5-2025-08-07", True), ("gpt-5.1", True),
    ("gpt-5.1-chat-latest", True), ("gpt-5.2-chat-latest", True), ("gpt-5.2-pro", True),
    ("gpt-6", True),
    ("gpt-5-chat-latest", False), ("gpt-4o", False), ("gpt-4o-mini", False),
    ("gpt-4.1", False), ("gpt-3.5-turbo", False), ("llama3.2", False), ("qwen3:8b", False),
    ("omni-moderation-latest", False), ("o1x", False), ("openai/o3-mini", False),
    ("ft:gpt-4o-mini:org::id", False), ("", False),
])
def test_which_model_names_are_reasoning_models(model: str, reasoning: bool) -> None:
    assert is_reasoning_model(model) is reasoning


async def test_agui_forwarded_props_reach_a_reasoning_model_as_it_takes_them(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(openai_runtime(llm)) as served:
        events = await served.run(run_input("hi", forwardedProps={
            "model": "o3-mini", "temperature": 0.2, "maxTokens": 50}))
    verify_events(events)
    assert events[-1]["type"] == "RUN_FINISHED"
    sent = llm.requests[-1]
    assert (sent["model"], sent["max_completion_tokens"]) == ("o3-mini", 50)
    assert "max_tokens" not in sent
    assert "temperature" not in sent


async def test_graphql_forwarded_parameters_reach_a_reasoning_model_as_it_takes_them(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    forwarded = {"model": "gpt-5", "temperature": 0.5, "maxTokens": 100.0}
    async with serve_runtime(openai_runtime(llm)) as served:
        result, _ = await generate(served, user_turn("hi", forwardedParameters=forwarded))
    assert result["status"]["code"] == "Success"
    sent = llm.requests[-1]
    assert (sent["model"], sent["max_completion_tokens"]) == ("gpt-5", 100)
    assert "max_tokens" not in sent
    assert "temperature" not in sent


@pytest.mark.parametrize(("model", "kept"), [
    # OpenAI's API reference: `stop` is "not supported with latest reasoning models o3 and
    # o4-mini"; the GPT-5 family refuses it too (gpt-5, -mini, -nano, 5.1, 5.2); o1 and
    # o3-mini take it.
    ("o3", False), ("o3-pro-2025-06-10", False), ("o4-mini", False),
    ("o4-mini-2025-04-16", False), ("gpt-5", False), ("gpt-5-nano", False),
    ("gpt-5.1", False), ("gpt-5.2-chat-latest", False), ("o1-mini", False),
    ("o1", True), ("o1-2024-12-17", True), ("o3-mini", True), ("o3-mini-2025-01-31", True),
    ("gpt-5-chat-latest", True), ("gpt-4o", True),
])
async def test_stop_is_left_out_for_the_reasoning_models_that_refuse_it(
        llm: MockOpenAIServer, model: str, kept: bool) -> None:
    adapter = OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock", max_retries=0)
    with capture_logs() as logs:
        text = await _answer(adapter, ChatRequest(
            messages=[UserMessage(id="u", content="hi")], model=model, stop=["\n\n"]))
    assert text == "echo: hi"
    assert llm.requests[-1].get("stop") == (["\n\n"] if kept else None)
    dropped = [e for e in logs if e["event"] == "stop not sent to a reasoning model"]
    if kept:
        assert not dropped
    else:
        assert [(e["log_level"], e["model"], e["stop"]) for e in dropped] == [
            ("warning", model, ["\n\n"])]


async def _refusal(llm: MockOpenAIServer, **settings: Any) -> dict[str, Any] | None:
    """The mock's error for a request with these settings, or None when it answers."""
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, **settings}
    async with aiohttp.ClientSession() as session, session.post(
            f"{llm.base_url}/chat/completions", json=body,
            headers={"Authorization": "Bearer sk-mock"}) as response:
        if response.status == 200:
            await response.read()
            return None
        assert response.status == 400
        error: dict[str, Any] = (await response.json())["error"]
        return error


async def test_the_mock_refuses_stop_as_openai_does(llm: MockOpenAIServer) -> None:
    assert await _refusal(llm, model="o4-mini", stop=["END"]) == {
        "message": "Unsupported parameter: 'stop' is not supported with this model.",
        "type": "invalid_request_error", "param": "stop", "code": "unsupported_parameter"}
    assert (await _refusal(llm, model="gpt-5.1", stop="END",
                           reasoning_effort="none"))["param"] == "stop"  # type: ignore[index]
    for model in ("o1", "o3-mini", "gpt-5-chat-latest", "gpt-4o"):
        assert await _refusal(llm, model=model, stop=["END"]) is None, model


@pytest.mark.parametrize("model", [
    "o1", "o3-mini", "o4-mini", "gpt-5", "gpt-5-mini", "gpt-5-chat-latest",
    "gpt-5.1", "gpt-5.1-chat-latest", "gpt-5.2-chat-latest", "gpt-5.3-chat-latest",
    "gpt-6-chat-latest", "gpt-4o", "gpt-4.1", "GPT-5", "openai/gpt-5", "o1x", "llama3.2",
])
async def test_the_mock_and_the_adapter_agree_on_which_models_reason(
        llm: MockOpenAIServer, model: str) -> None:
    """GPT-5.1's and later chat models (`gpt-5.1-chat-latest`, GPT-5.1 Instant) reason and
    refuse `max_tokens` and temperatures as the others do; only GPT-5's does not."""
    refused = await _refusal(llm, model=model, temperature=0.2)
    assert (refused is not None) is is_reasoning_model(model)
    refused = await _refusal(llm, model=model, max_tokens=10)
    assert (refused is not None) is is_reasoning_model(model)


@pytest.mark.parametrize(("model", "reasoning"), [
    ("o4-mini", True), ("gpt-5", True), ("gpt-5.1-chat-latest", True),
    ("gpt-4o", False), ("gpt-5-chat-latest", False)])
async def test_a_topic_judge_on_a_reasoning_model_has_room_to_reason_and_logs_no_warning(
        llm: MockOpenAIServer, model: str, reasoning: bool) -> None:
    """The judge's short answer budget would go to the reasoning tokens a reasoning model
    spends first (they count against `max_completion_tokens`), leaving an empty or cut
    answer that the judge reads as a refusal; and its temperature 0 is the runtime's own
    choice, not a client's to be warned about."""
    adapter = OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock", max_retries=0)
    judge = TopicGuardrail(adapter, deny=["cooking"], model=model)
    try:
        with capture_logs() as logs:
            await judge.check([{"id": "u", "role": "user", "content": "Is it sunny?"}], None)
    finally:
        await adapter.aclose()
    sent = llm.requests[-1]
    assert sent["model"] == model
    if reasoning:
        assert "max_tokens" not in sent
        assert "temperature" not in sent
        assert sent["max_completion_tokens"] >= 4000
    else:
        assert (sent["max_tokens"], sent["temperature"]) == (100, 0)
        assert "max_completion_tokens" not in sent
    assert not [e for e in logs if e["event"].endswith("not sent to a reasoning model")
                and e["log_level"] != "debug"]
