"""Thread storage: the interface and its implementations."""

from copilot_runtime.threads.base import StoredRun, ThreadOwner, ThreadRecord, ThreadStore
from copilot_runtime.threads.memory import InMemoryThreadStore
from copilot_runtime.threads.sqlite import SQLiteThreadStore

__all__ = ["InMemoryThreadStore", "SQLiteThreadStore", "StoredRun", "ThreadOwner", "ThreadRecord",
           "ThreadStore"]
