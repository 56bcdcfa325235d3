"""A stdio MCP server without the SDK that says the credential its `env` gave it
(`SERVICE_CRED`) on every failure: `tools/list` when the marker file named by its argument
exists, a call with x "key" (a tool error) or "key-rpc" (a JSON-RPC error); x "exit" ends its
process, as a crash would."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

CRED = os.environ.get("SERVICE_CRED", "")
ECHO = {"name": "echo", "description": "Echo",
        "inputSchema": {"type": "object", "properties": {"x": {"type": "string"}}}}


def answer(method: str, params: dict[str, Any]) -> dict[str, Any]:
    """A request's JSON-RPC answer: its `result` or its `error`."""
    if method == "initialize":
        return {"result": {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
                           "serverInfo": {"name": "secret", "version": "1"}}}
    if method == "tools/list":
        if Path(sys.argv[1]).exists():
            return {"error": {"code": -32603, "message": f"credential {CRED} is not authorised"}}
        return {"result": {"tools": [ECHO]}}
    if method == "tools/call":
        x = str((params.get("arguments") or {}).get("x"))
        if x == "exit":
            os._exit(3)
        if x == "key-rpc":
            return {"error": {"code": -32000, "message": f"key {CRED} revoked"}}
        said = f"key {CRED} revoked" if x == "key" else f"echoed {x}"
        return {"result": {"isError": x == "key", "content": [{"type": "text", "text": said}]}}
    return {"result": {}}


if __name__ == "__main__":
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("id") is None:
            continue  # a notification
        reply = {"jsonrpc": "2.0", "id": request["id"],
                 **answer(request.get("method"), request.get("params") or {})}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
