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


def standby(schema: str, table: str, on: bool) -> None:
    """`schema`'s `table` answers every write as a standby does ("cannot execute ... in a
    read-only transaction"), or stops to (`on` False)."""
    with psycopg.connect(SERVER, autocommit=True) as conn:
        if on:
            conn.execute(
                f'CREATE FUNCTION "{schema}".standby() RETURNS trigger LANGUAGE plpgsql AS '
                "$$ BEGIN RAISE EXCEPTION 'cannot execute % in a read-only transaction', TG_OP "
                "USING ERRCODE = 'read_only_sql_transaction'; END $$")
            conn.execute(f'CREATE TRIGGER standby BEFORE INSERT OR UPDATE OR DELETE ON '
                         f'"{schema}".{table} EXECUTE FUNCTION "{schema}".standby()')
        else:
            conn.execute(f'DROP FUNCTION "{schema}".standby() CASCADE')
