"""Helpers for the in-process GraphQL tests: a chat document, multipart parsing, merging.

`merge` applies increments the way urql 5 does (items at `path[-1]` of the list at
`path[:-1]`, data deep-merged at `path`), so a test sees what the client would.
"""

from __future__ import annotations

import copy
from typing import Any

import orjson

CLIENT_ACCEPT = ("application/graphql-response+json, application/graphql+json, "
                 "application/json, text/event-stream, multipart/mixed")
CLIENT_HEADERS = {"Content-Type": "application/json", "Accept": CLIENT_ACCEPT,
                  "X-CopilotKit-Runtime-Client-GQL-Version": "1.10.6"}
#: Another GraphQL client's: refusals come with their real HTTP status (the 1.10 client,
#: which reads no error answer from 400 to 500, gets them with 200).
OTHER_CLIENT_HEADERS = {"Content-Type": "application/json", "Accept": CLIENT_ACCEPT}

CHAT_DOCUMENT = """
mutation chat($data: GenerateCopilotResponseInput!, $properties: JSONObject) {
  generateCopilotResponse(data: $data, properties: $properties) {
    threadId
    runId
    extensions { openaiAssistantAPI { runId threadId } }
    ... on CopilotResponse @defer {
      status {
        __typename
        ... on BaseResponseStatus { code }
        ... on FailedResponseStatus { reason details }
      }
    }
    messages @stream {
      __typename
      ... on BaseMessageOutput { id createdAt }
      ... on BaseMessageOutput @defer {
        status {
          __typename
          ... on SuccessMessageStatus { code }
          ... on FailedMessageStatus { code reason }
        }
      }
      ... on TextMessageOutput { content @stream role parentMessageId }
      ... on ActionExecutionMessageOutput { name arguments @stream parentMessageId }
      ... on ResultMessageOutput { result actionExecutionId actionName }
    }
    metaEvents @stream { __typename ... on LangGraphInterruptEvent { type name value } }
  }
}
"""

# The 1.10 client's own document (protocol.md §3.1): every message type, agent states and
# both interrupt meta events.
CLIENT_DOCUMENT = """
mutation generateCopilotResponse($data: GenerateCopilotResponseInput!, $properties: JSONObject) {
  generateCopilotResponse(data: $data, properties: $properties) {
    threadId
    runId
    extensions { openaiAssistantAPI { runId threadId __typename } __typename }
    ... on CopilotResponse @defer {
      status {
        ... on BaseResponseStatus { code __typename }
        ... on FailedResponseStatus { reason details __typename }
        __typename
      }
      __typename
    }
    messages @stream {
      __typename
      ... on BaseMessageOutput { id createdAt __typename }
      ... on BaseMessageOutput @defer {
        status {
          ... on SuccessMessageStatus { code __typename }
          ... on FailedMessageStatus { code reason __typename }
          ... on PendingMessageStatus { code __typename }
          __typename
        }
        __typename
      }
      ... on TextMessageOutput { content @stream role parentMessageId __typename }
      ... on ImageMessageOutput { format bytes role parentMessageId __typename }
      ... on ActionExecutionMessageOutput { name arguments @stream parentMessageId __typename }
      ... on ResultMessageOutput { result actionExecutionId actionName __typename }
      ... on AgentStateMessageOutput {
        threadId state running agentName nodeName runId active role __typename
      }
    }
    metaEvents @stream {
      ... on LangGraphInterruptEvent { type name value __typename }
      ... on CopilotKitLangGraphInterruptEvent {
        type
        name
        data {
          messages {
            __typename
            ... on BaseMessageOutput { id createdAt __typename }
            ... on BaseMessageOutput @defer {
              status {
                ... on SuccessMessageStatus { code __typename }
                ... on FailedMessageStatus { code reason __typename }
                ... on PendingMessageStatus { code __typename }
                __typename
              }
              __typename
            }
            ... on TextMessageOutput { content role parentMessageId __typename }
            ... on ActionExecutionMessageOutput { name arguments parentMessageId __typename }
            ... on ResultMessageOutput { result actionExecutionId actionName __typename }
          }
          value
          __typename
        }
        __typename
      }
      __typename
    }
    __typename
  }
}
"""

CREATED = "2025-01-01T00:00:00.000Z"


def text_message(message_id: str, role: str, content: str) -> dict[str, Any]:
    return {"id": message_id, "createdAt": CREATED,
            "textMessage": {"role": role, "content": content}}


def call_message(message_id: str, name: str, arguments: str,
                 parent: str | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {"name": name, "arguments": arguments}
    if parent is not None:
        call["parentMessageId"] = parent
    return {"id": message_id, "createdAt": CREATED, "actionExecutionMessage": call}


def result_message(message_id: str, call_id: str, name: str, result: str) -> dict[str, Any]:
    return {"id": message_id, "createdAt": CREATED, "resultMessage": {
        "actionExecutionId": call_id, "actionName": name, "result": result}}


def chat_data(messages: list[dict[str, Any]], *, thread: str = "gql-thread",
              actions: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "frontend": {"actions": actions or [], "url": "http://localhost:3000/"},
        "threadId": thread, "runId": None, "extensions": {}, "metaEvents": [],
        "messages": messages, "metadata": {"requestType": "Chat"}, "agentStates": [],
        "forwardedParameters": {}, "context": [],
    }
    data.update(extra)
    return data


def user_turn(text: str, **extra: Any) -> dict[str, Any]:
    return chat_data([text_message("sys-1", "system", "Be brief."),
                      text_message("user-1", "user", text)], **extra)


def parse_multipart(body: bytes) -> list[dict[str, Any]]:
    """The JSON payloads of a `multipart/mixed; boundary="-"` body, checking the framing."""
    assert body.startswith(b"\r\n---"), body[:40]
    assert body.endswith(b"\r\n-----\r\n"), body[-40:]
    payloads = []
    for part in body[len(b"\r\n---"):-len(b"--\r\n")].split(b"\r\n---")[:-1]:
        if part == b"\r\n\r\n":
            continue  # an empty part: a keep-alive while the run is silent
        head, _, json_bytes = part.partition(b"\r\n\r\n")
        headers = dict(line.split(b": ", 1) for line in head.strip(b"\r\n").split(b"\r\n"))
        assert headers[b"Content-Type"] == b"application/json; charset=utf-8"
        assert int(headers[b"Content-Length"]) == len(json_bytes)
        payloads.append(orjson.loads(json_bytes))
    return payloads


def _deep_merge(target: Any, patch: Any) -> Any:
    if isinstance(target, dict) and isinstance(patch, dict):
        for key, value in patch.items():
            target[key] = _deep_merge(target.get(key), value)
        return target
    return patch


def merge(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """The result a client holds after every payload (the first must carry `data`)."""
    payloads = copy.deepcopy(payloads)
    result: dict[str, Any] = {"data": payloads[0]["data"]}
    for payload in payloads[1:]:
        for entry in payload.get("incremental", ()):
            path = entry["path"]
            if "items" in entry:
                target: Any = result["data"]
                for step in path[:-1]:
                    target = target[step]
                index = path[-1]
                for offset, item in enumerate(entry["items"]):
                    position = index + offset
                    if position < len(target):
                        target[position] = _deep_merge(target[position], item)
                    else:
                        assert position == len(target), f"hole in the list at {path}"
                        target.append(item)
            else:
                target = result["data"]
                for step in path:
                    target = target[step]
                _deep_merge(target, entry["data"])
            if "errors" in entry:
                result.setdefault("errors", []).extend(entry["errors"])
    assert payloads[-1]["hasNext"] is False
    assert all(p["hasNext"] for p in payloads[:-1])
    return result
