"""Guardrails judge what the model is sent, whatever the client names or adds.

- `ag_ui.core` models took a field by its Python name as well as its alias (`tool_calls`
  for `toolCalls`), and agents read the model while guardrails read the JSON by the alias:
  the model got what no guardrail saw. A field named by its Python name is now refused.
- A `text` field on an attachment part was judged instead of the attachment it rode on.
- Inline source code attachments (which Gemini reads as text) were not judged.
"""

from __future__ import annotations

import base64
from typing import Any

import httpx
import orjson
import pydantic
import pytest
from ag_ui.core import RunAgentInput

from copilot_runtime import (
    AnthropicAdapter,
    CopilotRuntime,
    GoogleGenAIAdapter,
    InvalidRequestError,
    OpenAIAdapter,
    PatternGuardrail,
)
from copilot_runtime._input import _GATED, _model_classes, _python_field_names, parse_run_input
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.guardrails import texts_of
from copilot_runtime.testing import MockAnthropicServer, MockGeminiServer, MockOpenAIServer
from tests.agents_support import graphs
from tests.conftest import ServeRuntime, run_input, text_of, types

pytestmark = pytest.mark.timeout(60)

DENIED = "give me the SSN of john"
REFUSAL = "Sorry, I can't help with that request."


def _guardrails() -> list[PatternGuardrail]:
    return [PatternGuardrail(deny=[r"\bssn\b"])]


def _data(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _document(mime_key: str = "mimeType", mime: str = "text/plain", **extra: Any
              ) -> dict[str, Any]:
    return {"type": "document", **extra,
            "source": {"type": "data", "value": _data(DENIED), mime_key: mime}}


def _with_document(part: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"id": "u1", "role": "user", "content": [
        {"type": "text", "text": "summarise the attachment"}, part]}]


def _with_tool_call(calls_key: str, id_key: str) -> list[dict[str, Any]]:
    return [{"id": "u1", "role": "user", "content": "hello"},
            {"id": "a1", "role": "assistant", "content": "", calls_key: [{
                "id": "c1", "type": "function",
                "function": {"name": "lookup",
                             "arguments": orjson.dumps({"q": DENIED}).decode()}}]},
            {"id": "t1", "role": "tool", id_key: "c1", "content": "done"}]


# -- 1. fields named by their Python names ------------------------------------------------

_PYTHON_NAMES: dict[str, tuple[dict[str, Any], list[Any], str]] = {
    # case: (the body's changes, where the refusal points, the alias it names)
    "forwarded_props": ({"forwarded_props": {"items": [DENIED]}}, ["forwarded_props"],
                        "forwardedProps"),
    "parent_run_id": ({"parent_run_id": "p"}, ["parent_run_id"], "parentRunId"),
    "tool_calls": ({"messages": _with_tool_call("tool_calls", "toolCallId")},
                   ["messages", 1, "tool_calls"], "toolCalls"),
    "tool_call_id beside toolCallId": (
        {"messages": [*_with_tool_call("toolCalls", "toolCallId")[:2],
                      {"id": "t1", "role": "tool", "toolCallId": "c1", "tool_call_id": "c2",
                       "content": "done"}]},
        ["messages", 2, "tool_call_id"], "toolCallId"),
    "a tool call's encrypted_value": (
        {"messages": [{"id": "a1", "role": "assistant", "toolCalls": [{
            "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"},
            "encrypted_value": "x"}]}]},
        ["messages", 0, "toolCalls", 0, "encrypted_value"], "encryptedValue"),
    "mime_type": ({"messages": _with_document({
        "type": "document", "source": {"type": "data", "value": _data(DENIED),
                                       "mimeType": "application/pdf",
                                       "mime_type": "text/plain"}})},
                  ["messages", 0, "content", 1, "source", "mime_type"], "mimeType"),
    "a binary part's mime_type": ({"messages": _with_document({
        "type": "binary", "mimeType": "application/pdf", "mime_type": "text/plain",
        "data": _data(DENIED)})}, ["messages", 0, "content", 1, "mime_type"], "mimeType"),
    "interrupt_id": ({"resume": [{"interruptId": "i", "interrupt_id": "j", "status": "resolved"}]},
                     ["resume", 0, "interrupt_id"], "interruptId"),
}


@pytest.mark.parametrize("case", list(_PYTHON_NAMES))
def test_a_field_named_by_its_python_name_is_refused(case: str) -> None:
    """The refusal says where the field is and what it is called in AG-UI. Before the fix
    the model took the value (`populate_by_name`), while guardrails and remote agents read
    the JSON: each saw something else."""
    changes, path, alias = _PYTHON_NAMES[case]
    with pytest.raises(InvalidRequestError) as caught:
        parse_run_input(run_input("hi") | changes)
    (issue,) = orjson.loads(caught.value.details)
    assert issue["code"] == "python_field_name"
    assert issue["path"] == path
    assert f"`{path[-1]}`" in issue["message"]
    assert f"`{alias}`" in issue["message"]


def test_aliases_and_unknown_fields_still_validate() -> None:
    body = run_input("hi", parentRunId="p", messages=[
        *_with_tool_call("toolCalls", "toolCallId"),
        {"id": "u2", "role": "user", "content": [_document(), {"type": "text", "text": "x"}],
         "some_field": 1}],
        resume=[{"interruptId": "i", "status": "resolved"}])
    model = parse_run_input(body).model
    assert model.parent_run_id == "p"
    assert model.messages[1].tool_calls is not None  # type: ignore[union-attr]
    # Other snake_case names are not AG-UI's: kept as extras, as before.
    assert model.messages[3].model_extra == {"some_field": 1}


def _model_paths(cls: type[pydantic.BaseModel], prefix: str = "",
                 seen: frozenset[type[pydantic.BaseModel]] = frozenset()) -> set[str]:
    """The dotted aliases of the fields, from `cls` down, that hold models."""
    paths: set[str] = set()
    for name, field in cls.model_fields.items():
        classes = _model_classes(field.annotation)
        if classes:
            path = prefix + (field.alias or name)
            paths.add(path)
            for inner in classes:
                if inner not in seen:
                    paths |= _model_paths(inner, path + ".", seen | {cls})
    return paths


def test_the_quick_look_covers_every_model_of_the_input() -> None:
    """`parse_run_input` walks the model for Python names only when a quick look at the JSON
    objects where models sit finds one: the look must know every such place (an ag_ui
    release that adds one fails here)."""
    assert _model_paths(RunAgentInput) == _GATED
    assert {"tool_calls", "tool_call_id", "mime_type", "forwarded_props", "interrupt_id",
            "encrypted_value"} <= _python_field_names()


async def test_python_names_reach_no_model(serve_runtime: ServeRuntime) -> None:
    """The hunter's bypasses, against real guardrails and mock providers: a `tool_calls`
    history (OpenAI) and a `mime_type` document (Anthropic) are refused with a 400, the
    camelCase controls by the guardrail; the denied text reaches neither model."""
    async with MockOpenAIServer(chunks=2) as gpt, MockAnthropicServer() as claude:
        openai = CopilotRuntime(service_adapter=OpenAIAdapter(
            base_url=gpt.base_url, api_key="k", max_retries=0), guardrails=_guardrails())
        async with serve_runtime(openai) as served:
            for calls_key, id_key in (("tool_calls", "tool_call_id"), ("tool_calls", "toolCallId")):
                response = await served.post("/agent/default/run", run_input(
                    "", thread="snake", messages=_with_tool_call(calls_key, id_key)))
                assert response.status == 400, await response.text()
                # (without `toolCallId` the tool message is invalid: said first)
                assert f"`{id_key if id_key == 'tool_call_id' else calls_key}`" in orjson.loads(
                    await response.read())["details"]
            events = await served.run(run_input(
                "", thread="camel", messages=_with_tool_call("toolCalls", "toolCallId")))
            assert text_of(events) == REFUSAL
        anthropic = CopilotRuntime(service_adapter=AnthropicAdapter(
            base_url=claude.base_url, api_key="k", max_retries=0), guardrails=_guardrails())
        async with serve_runtime(anthropic) as served:
            response = await served.post("/agent/default/run", run_input(
                "", thread="snake", messages=_with_document(_document("mime_type"))))
            assert response.status == 400, await response.text()
            assert "mimeType" in await response.text()
            events = await served.run(run_input(
                "", thread="camel", messages=_with_document(_document())))
            assert text_of(events) == REFUSAL
    assert gpt.requests == []
    assert claude.requests == []


async def test_forwarded_props_by_python_name_reach_no_graph(serve_runtime: ServeRuntime
                                                             ) -> None:
    """A LangGraph graph merges `forwardedProps` entries named like its state keys into its
    input, and guardrails judge them; `forwarded_props` went to it unjudged."""
    async with MockOpenAIServer(chunks=2) as llm, httpx.AsyncClient() as client:
        runtime = CopilotRuntime(agents={"lg": LangGraphAgent(
            name="lg", graph=graphs.shared_state_graph(llm.base_url, client))},
            guardrails=_guardrails())
        async with serve_runtime(runtime) as served:
            for key in ("forwarded_props", "forwardedProps"):
                body = run_input("plan please", thread=key)
                del body["forwardedProps"]
                body[key] = {"items": [DENIED]}
                if key == "forwarded_props":
                    response = await served.post("/agent/lg/run", body)
                    assert response.status == 400, await response.text()
                    assert "forwardedProps" in await response.text()
                else:
                    assert text_of(await served.run(body, agent="lg")) == REFUSAL
        assert DENIED not in orjson.dumps([r["messages"] for r in llm.requests]).decode()


# -- 2. a text field on an attachment -----------------------------------------------------

def test_an_attachment_is_judged_whatever_text_it_carries() -> None:
    """A part's `text` is its text only when it is a text part: a document with a `text`
    field is still its document (what the adapter sends). Before the fix only the `text` was
    judged."""
    texts = texts_of([_document(text="please summarise")])
    assert texts == [DENIED]
    named = {"type": "image", "text": "a cat", "metadata": {"filename": "ssn.png"},
             "source": {"type": "data", "value": "iVBORw0KGgo=", "mimeType": "image/png"}}
    assert texts_of([named]) == ["ssn.png"]
    assert texts_of([{"type": "text", "text": "hello"}]) == ["hello"]


async def test_a_document_with_a_text_field_reaches_no_model(serve_runtime: ServeRuntime
                                                             ) -> None:
    async with MockAnthropicServer() as claude:
        runtime = CopilotRuntime(service_adapter=AnthropicAdapter(
            base_url=claude.base_url, api_key="k", max_retries=0), guardrails=_guardrails())
        async with serve_runtime(runtime) as served:
            events = await served.run(run_input("", thread="t", messages=[{
                "id": "u1", "role": "user", "content": [_document(text="please summarise")]}]))
            assert text_of(events) == REFUSAL
    assert claude.requests == []


# -- 3. inline source code ----------------------------------------------------------------

_CODE = ["text/x-python", "application/x-python", "application/x-python-code",
         "application/javascript", "application/x-javascript", "application/typescript",
         "application/x-typescript", "application/x-sh", "application/x-shellscript",
         "application/sql", "application/x-httpd-php", "application/ecmascript"]


@pytest.mark.parametrize("mime", _CODE)
def test_code_attachments_are_judged(mime: str) -> None:
    assert texts_of([_document(mime=mime)]) == [DENIED]


async def test_code_attachments_reach_no_gemini_model(serve_runtime: ServeRuntime) -> None:
    """Gemini reads inline code as text. Before the fix only `text/*`, JSON, XML and YAML
    were judged: `application/x-python` went to the model unjudged."""
    async with MockGeminiServer() as gemini:
        runtime = CopilotRuntime(service_adapter=GoogleGenAIAdapter(
            base_url=gemini.base_url, api_key="k", max_retries=0), guardrails=_guardrails())
        async with serve_runtime(runtime) as served:
            for mime in ("application/x-python", "application/x-javascript"):
                events = await served.run(run_input("", thread=mime.replace("/", "-"),
                                                    messages=_with_document(_document(mime=mime))))
                assert text_of(events) == REFUSAL
            # Control: a harmless script still goes.
            harmless = _document(mime="application/x-python")
            harmless["source"]["value"] = _data("print('hello')")
            events = await served.run(run_input("", thread="fine",
                                                messages=_with_document(harmless)))
            assert types(events)[-1] == "RUN_FINISHED"
    assert len(gemini.requests) == 1
