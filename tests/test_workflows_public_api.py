"""The workflows' public names are exactly `copilot_runtime.workflows.__all__`, and each one
is the object it names (never a submodule that happens to share the name)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types

import copilot_runtime.workflows as workflows

EXPECTED = [
    "AdapterChatModel", "Approval", "ApprovalPolicy", "ApprovalService", "ApprovalStore",
    "Decision", "ModelSpecialist", "OfflineSpecialistAdapter", "Orchestrator", "ReviewLoop",
    "SpecialistRequest", "Step", "account_review", "approval_service", "existing_agent",
    "finance_specialists", "keyword_router", "parse_decision", "run_existing_agent",
    "wrap_existing_agent",
]
SUBMODULES = ["accounts", "existing", "models", "orchestrator", "review_loop", "specialists"]


def test_all_is_pinned() -> None:
    assert sorted(workflows.__all__) == sorted(EXPECTED)


def test_every_public_name_is_the_object_not_a_module() -> None:
    for submodule in SUBMODULES:  # importing a submodule must not shadow a public name
        importlib.import_module(f"copilot_runtime.workflows.{submodule}")
    for name in workflows.__all__:
        value = getattr(workflows, name)
        assert not isinstance(value, types.ModuleType), name
    assert callable(workflows.account_review)


def test_from_import_gives_the_function_in_a_fresh_interpreter() -> None:
    # `from package import name` tries a submodule of that name first: only a fresh
    # interpreter shows what a user's first import gets.
    script = ("from copilot_runtime.workflows import account_review\n"
              "import copilot_runtime.workflows.accounts\n"
              "from copilot_runtime.workflows import account_review as again\n"
              "print(callable(account_review), callable(again), "
              "account_review(timeout_seconds=5).approval.timeout_seconds)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True", "5"]
