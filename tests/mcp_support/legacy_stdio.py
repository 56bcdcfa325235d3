"""A stdio MCP server without the SDK, on a legacy code page: `cafe` answers "café" in
Latin-1 (one byte of its line is not UTF-8), `ping` answers "pong"; and careless: `nothing`
answers `"result": null`, `mute` an error without its message (no JSON-RPC answer, either);
with `--unreadable-handshake`, `initialize` answers `"result": null`. As a TypeScript server
writes text cut inside an emoji (`JSON.stringify`: an escaped lone surrogate), `cut_emoji`
answers one, and with `--cut-emoji-listing` a tool's description holds one; `deep` answers
structured content 300 levels deep; `huge_ts` and `huge_py` answer a line of 6 MiB, its id
last (the TypeScript SDK's order of keys) or first (the Python SDK's)."""

from __future__ import annotations

import json
import sys
from typing import Any


def send(message: dict[str, Any], encoding: str = "utf-8") -> None:
    try:
        line = json.dumps(message, ensure_ascii=False).encode(encoding)
    except UnicodeEncodeError:  # a lone surrogate: written escaped, as JSON.stringify does
        line = json.dumps(message).encode(encoding)
    sys.stdout.buffer.write(line + b"\n")
    sys.stdout.buffer.flush()


def nested(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels):
        value = {"a": value}
    return value


def answer(method: str, params: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The result of a request, and the encoding its line is written in."""
    if method == "initialize":
        return {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
                "serverInfo": {"name": "legacy", "version": "1"}}, "utf-8"
    if method == "tools/list":
        tools = [{"name": name, "description": name, "inputSchema": {"type": "object"}}
                 for name in ("cafe", "ping", "nothing", "mute", "cut_emoji", "deep",
                              "huge_ts", "huge_py")]
        if "--cut-emoji-listing" in sys.argv:
            tools.append({"name": "summarize", "description": "Summarizes text \ud83d",
                          "inputSchema": {"type": "object"}})
        return {"tools": tools}, "utf-8"
    if method == "tools/call":
        cafe = params.get("name") == "cafe"
        if params.get("name") == "cut_emoji":
            return {"content": [{"type": "text", "text": "cut emoji: \ud83d"}]}, "utf-8"
        if params.get("name") == "deep":
            return {"content": [], "structuredContent": nested(300)}, "utf-8"
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
        elif method == "tools/call" and params.get("name") in ("huge_ts", "huge_py"):
            result = {"content": [{"type": "text", "text": "x" * (6 * 1024 * 1024)}]}
            ordered = ({"result": result, "jsonrpc": "2.0", "id": request["id"]}
                       if params["name"] == "huge_ts"
                       else {"jsonrpc": "2.0", "id": request["id"], "result": result})
            send(ordered)
        elif request.get("method") == "tools/call" and params.get("name") == "mute":
            send({"jsonrpc": "2.0", "id": request["id"],
                  "error": {"code": -32000, "message": None}})
        else:
            result, encoding = answer(request.get("method"), params)
            send({"jsonrpc": "2.0", "id": request["id"], "result": result}, encoding)
