"""A stdio MCP server without the SDK, on a legacy code page: `cafe` answers "café" in
Latin-1 (one byte of its line is not UTF-8), `ping` answers "pong"; and careless: `nothing`
answers `"result": null`, `mute` an error without its message (no JSON-RPC answer, either);
with `--unreadable-handshake`, `initialize` answers `"result": null`."""

from __future__ import annotations

import json
import sys
from typing import Any


def send(message: dict[str, Any], encoding: str = "utf-8") -> None:
    sys.stdout.buffer.write(json.dumps(message, ensure_ascii=False).encode(encoding) + b"\n")
    sys.stdout.buffer.flush()


def answer(method: str, params: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The result of a request, and the encoding its line is written in."""
    if method == "initialize":
        return {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
                "serverInfo": {"name": "legacy", "version": "1"}}, "utf-8"
    if method == "tools/list":
        return {"tools": [{"name": name, "description": name, "inputSchema": {"type": "object"}}
                          for name in ("cafe", "ping", "nothing", "mute")]}, "utf-8"
    if method == "tools/call":
        cafe = params.get("name") == "cafe"
        return {"content": [{"type": "text", "text": "café" if cafe else "pong"}]}, \
            "latin-1" if cafe else "utf-8"
    return {}, "utf-8"


if __name__ == "__main__":
    for line in sys.stdin.buffer:
        request = json.loads(line)
        if request.get("id") is None:
            continue  # a notification
        params = request.get("params") or {}
        method = request.get("method")
        if (method == "initialize" and "--unreadable-handshake" in sys.argv) \
                or (method == "tools/call" and params.get("name") == "nothing"):
            send({"jsonrpc": "2.0", "id": request["id"], "result": None})
        elif request.get("method") == "tools/call" and params.get("name") == "mute":
            send({"jsonrpc": "2.0", "id": request["id"],
                  "error": {"code": -32000, "message": None}})
        else:
            result, encoding = answer(request.get("method"), params)
            send({"jsonrpc": "2.0", "id": request["id"], "result": result}, encoding)
