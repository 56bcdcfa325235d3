"""A PostgreSQL checkpointer's `?schema=` spelled with capitals.

Before, CREATE SCHEMA quoted the name (capitals kept) but the pool's search_path did not
(PostgreSQL folds it to lower case): nothing could be created or found, and every use of
the store answered SERVICE_UNAVAILABLE "The checkpoint store cannot be reached". Now both
name the same schema.
"""

from __future__ import annotations

import psycopg
import pytest

from copilot_runtime.checkpointers import checkpointer
from tests.scale_support.services import POSTGRES, postgres_schema

pytestmark = pytest.mark.timeout(60)


async def test_a_schema_with_capitals_holds_the_checkpoints_and_the_ledger() -> None:
    with postgres_schema(prefix="Up") as url:
        saver = checkpointer(url)
        try:
            config = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
            assert await saver.aget_tuple(config) is None  # (SERVICE_UNAVAILABLE before)
            assert await saver.approvals.find(thread_id="t") == []
        finally:
            await saver.aclose()
        schema = url.rsplit("schema=", 1)[1]
        with psycopg.connect(POSTGRES) as conn:
            tables = {row[0] for row in conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                (schema,))}
    assert {"checkpoints", "checkpoint_writes"} <= tables
