"""The package's layers point one way, and it holds after us.

    core < adapters < agents < runtime < workflows < wire edges < the face

A module imports only from its own layer or below; the two wire edges never import each
other; no module imports another subpackage's private (`_name`) module. Imports under
`if TYPE_CHECKING:` count too: a type is a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "copilot_runtime"

#: Each module's layer, by the longest matching prefix of its dotted name (without the
#: package's own name). Every module must match one: a new top-level module is placed
#: here deliberately.
LAYERS: dict[str, int] = {
    # 0. core: the vocabulary every piece speaks
    "_exceptions": 0, "_time": 0, "_seconds": 0, "_version": 0, "_input": 0, "events": 0,
    "headers": 0,
    "actions": 0, "_compaction": 0, "threads": 0, "approvals": 0, "messages": 0,
    "event_order": 0, "_limits": 0, "auth": 0, "_jwks": 0, "hooks": 0, "limits": 0, "telemetry": 0,
    "coordination": 0, "_batching": 0, "_pg_lane": 0, "_url_options": 0, "_redis_client": 0,
    "_deadline": 0, "_held": 0, "_again": 0, "_sqlite_outage": 0, "_strings": 0,
    # 1. model providers, and the guardrails that may use one as a judge
    "adapters": 1, "adapters._idle": 1, "guardrails": 1,
    # MCP servers' tools as actions for the agents
    "mcp_tools": 1,
    # 2. agents, and the LangGraph checkpointers they run on
    "agents": 2, "agents._shared_state": 2, "checkpointers": 2,
    # 3. the runtime: agents, runs, threads
    "runtime": 3, "_runs": 3, "_retention": 3, "_shared_runs": 3, "_server_tools": 3, "_trust": 3,
    "_withheld": 3, "_thread_reads": 3,
    # 4. workflows built on agents and the runtime
    "workflows": 4,
    # 5. the wire edges, and the toolkit they share
    "protocols": 5,
    # 6. the face: apps, command line, demo, test doubles
    "asgi": 6, "cli": 6, "_serving": 6, "demo": 6, "demo_pages": 6, "testing": 6, "__init__": 6,
    "__main__": 6,
}
LAYER_NAMES = ["core", "adapters", "agents", "runtime", "workflows", "wire edges", "face"]
EDGES = ("protocols.agui", "protocols.graphql")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def layer_of(module: str) -> int:
    best = max((prefix for prefix in LAYERS
                if module == prefix or module.startswith(prefix + ".")), key=len, default=None)
    if best is None:
        pytest.fail(f"copilot_runtime.{module} has no layer: add it to LAYERS in "
                    f"{Path(__file__).name}", pytrace=False)
    return LAYERS[best]


def _imports(module: str, path: Path) -> set[str]:
    """What `module` imports from the package (dotted, without the package name)."""
    package = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(["copilot_runtime", *package[:len(package) - node.level + 1]])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            # `from m import x`: x may be a module of m, or a name in it (resolved later).
            names = [f"{source}.{alias.name}" for alias in node.names]
        for name in names:
            if name == "copilot_runtime" or name.startswith("copilot_runtime."):
                found.add(name.removeprefix("copilot_runtime").lstrip("."))
    found.discard("")
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module `name` refers to (a `from m import attr` names `m.attr`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def violations() -> list[str]:
    modules = _modules()
    out = []
    for module, path in sorted(modules.items()):
        mine = layer_of(module)
        for imported in sorted(_imports(module, path)):
            target = _resolve(imported, modules)
            if target is None or target == module:
                continue
            theirs = layer_of(target)
            if theirs > mine:
                out.append(f"{module} ({LAYER_NAMES[mine]}) imports {target} "
                           f"({LAYER_NAMES[theirs]}), a layer above it")
            for edge in EDGES:
                other = next(e for e in EDGES if e != edge) if edge in EDGES else None
                if (module == edge or module.startswith(edge + ".")) and other and (
                        target == other or target.startswith(other + ".")):
                    out.append(f"{module} imports {target}: the wire edges are independent")
            private = [i for i, part in enumerate(target.split(".")) if part.startswith("_")
                       and part not in ("__init__", "__main__")]
            if private:
                owner = ".".join(target.split(".")[:private[0]])
                if owner and not (module == owner or module.startswith(owner + ".")):
                    out.append(f"{module} imports {target}, private to {owner}")
    return sorted(set(out))


def test_layers_point_one_way() -> None:
    found = violations()
    assert not found, "\n".join(found)


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    # The walker must notice each kind of violation, or the test above proves nothing.
    assert layer_of("protocols.agui.handlers") > layer_of("runtime") > layer_of("agents")
    source = "from copilot_runtime.protocols.agui import handlers\n" \
             "from copilot_runtime.agents._wire import x\nfrom . import _private\n"
    path = tmp_path / "builtin.py"
    path.write_text(source)
    assert _imports("agents.builtin", path) == {"protocols.agui.handlers",
                                                "agents._wire.x", "agents._private"}
