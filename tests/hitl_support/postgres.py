"""A PostgreSQL schema of its own for each test (database `test` at 127.0.0.1:5432 unless
`COPILOT_TEST_POSTGRES` says otherwise), dropped afterwards."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import psycopg
import pytest

SERVER = os.environ.get("COPILOT_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


@contextlib.contextmanager
def postgres_schema() -> Iterator[str]:
    """A checkpointer URL on a fresh schema; the schema is dropped at the end."""
    schema = f"hitl_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(SERVER, autocommit=True, connect_timeout=5):
            pass
    except psycopg.OperationalError as exc:
        pytest.fail(f"these tests need PostgreSQL at {SERVER} ({exc}); scripts/test.sh "
                    "starts it", pytrace=False)
    try:
        yield f"{SERVER}?schema={schema}"
    finally:
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
