"""What the GraphQL route's own stages cost, in process, warm (no server, no LLM).

    python bench/graphql_stages.py            # from the checkout to measure

On the request the real 1.10.6 client sends (bench/.scratch/ts-graphql/request.json, built by
`bench/run --only python-graphql`): decoding the body, coercing the variables, the mutation's
arguments, translating them into a run (`session_run`), and the response encoder over the
batches a 50-chunk answer arrives in (and over 300 chunks in 8 batches, for the cost a chunk).
Best of 7 repeats; run it from two checkouts, alternately, to compare them.
"""

from __future__ import annotations

import copy
import json
import pathlib
import sys
import timeit
import uuid
from collections.abc import Callable
from typing import Any

sys.path.insert(0, str(pathlib.Path.cwd()))  # the checkout it is run from

from graphql import get_operation_ast
from graphql.execution.values import get_argument_values

from copilot_runtime import CopilotRuntime
from copilot_runtime._input import parse_json_body
from copilot_runtime.protocols.graphql import GraphQLProtocol
from copilot_runtime.protocols.graphql.agent_tools import session_run
from copilot_runtime.protocols.graphql.increments import ResponseEncoder

TEMPLATE = pathlib.Path(__file__).parent / ".scratch" / "ts-graphql" / "request.json"
NUMBER, REPEAT = 3000, 7


def request_body() -> bytes:
    body = json.loads(TEMPLATE.read_text())["body"]
    for marker, value in {"__BENCH_CREATED_AT__": "2026-11-26T00:00:00.000Z",
                          "__BENCH_SYSTEM_ID__": f"ck-{uuid.uuid4()}",
                          "__BENCH_USER_ID__": f"ck-{uuid.uuid4()}",
                          "__BENCH_USER_TEXT__": "x" * 200,
                          "__BENCH_THREAD_ID__": str(uuid.uuid4())}.items():
        body = body.replace(marker, value)
    return body.encode()


def answer(chunks: int, batches: int) -> list[list[dict[str, Any]]]:
    """An answer's batches as the run gives them: RUN_STARTED alone, then the text."""
    text = [{"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "word "}
            for _ in range(chunks)]
    size = -(-chunks // batches)
    out: list[list[dict[str, Any]]] = [[{"type": "RUN_STARTED", "threadId": "t", "runId": "r"}]]
    out += [text[i:i + size] for i in range(0, chunks, size)]
    out[1].insert(0, {"type": "TEXT_MESSAGE_START", "messageId": "m", "role": "assistant"})
    out[-1] += [{"type": "TEXT_MESSAGE_END", "messageId": "m"},
                {"type": "RUN_FINISHED", "threadId": "t", "runId": "r"}]
    return out


def best(call: Callable[[], object]) -> float:
    """Microseconds a call, best of the repeats."""
    return min(timeit.repeat(call, number=NUMBER, repeat=REPEAT)) / NUMBER * 1e6


def main() -> None:
    if not TEMPLATE.exists():
        raise SystemExit(f"{TEMPLATE} is missing: run bench/run --only python-graphql once")
    runtime = CopilotRuntime()
    protocol = GraphQLProtocol(runtime)
    body = request_body()
    data = parse_json_body(body)
    prepared = protocol.documents.get(data["query"])
    assert prepared.document is not None
    operation = get_operation_ast(prepared.document, data.get("operationName"))
    assert operation is not None
    coerced = prepared.coerce(protocol.variables, operation, data["variables"])
    assert not isinstance(coerced, list)
    plan = prepared.plan(protocol.schema, operation, coerced)
    mutation = protocol.schema.mutation_type
    assert mutation is not None
    field = mutation.fields["generateCopilotResponse"]
    args = get_argument_values(field, plan.field_node, coerced)

    def encode(batches: list[list[dict[str, Any]]]) -> Callable[[], object]:
        def run() -> object:
            encoder = ResponseEncoder(plan, thread_id="t", run_id=None,
                                      frontend_tools=frozenset(), stopped=lambda: False,
                                      incremental=True, agent_name="default",
                                      agent_run_id="r", agent_state={})
            return [encoder.encode(batch) for batch in batches]
        return run

    copying = best(lambda: copy.deepcopy(args["data"]))  # session_run changes what it gets
    rows = [
        ("decode the body (orjson, depth check)", best(lambda: parse_json_body(body))),
        ("coerce the variables", best(lambda: prepared.coerce(protocol.variables, operation,
                                                                data["variables"]))),
        ("the mutation's arguments", best(lambda: get_argument_values(field, plan.field_node,
                                                                      coerced))),
        ("session_run (the run's input)", best(lambda: session_run(
            runtime, copy.deepcopy(args["data"]), args.get("properties"),
            has_public_key=False)) - copying),
        ("encoder, 50 chunks in 1 batch", best(encode(answer(50, 1)))),
        ("encoder, 300 chunks in 6 batches", best(encode(answer(300, 6)))),
    ]
    for name, micros in rows:
        print(f"{name:40s} {micros:7.2f} µs")


if __name__ == "__main__":
    main()
