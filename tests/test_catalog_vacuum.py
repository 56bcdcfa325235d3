"""The session's end vacuums the PostgreSQL catalogs the tests' schemas bloated (this
machine's server runs without autovacuum), within its budget, and never fails the session:
a server away is only skipped."""

from __future__ import annotations

import time
import uuid

import psycopg
import pytest

from tests.conftest import free_port, vacuum_catalogs
from tests.hitl_support.postgres import SERVER

pytestmark = pytest.mark.timeout(120)


def test_the_catalogs_a_dropped_schema_bloated_are_vacuumed() -> None:
    schema = f"vacuum_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(SERVER, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
        for n in range(20):
            conn.execute(f'CREATE TABLE "{schema}".t{n} (a int PRIMARY KEY, b text, c jsonb)')
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
        row = conn.execute("SELECT now()").fetchone()
        assert row is not None
        before = row[0]
    vacuumed = vacuum_catalogs(SERVER, least_dead=1)
    assert vacuumed.skipped is None
    assert "pg_attribute" in vacuumed.catalogs
    assert vacuumed.seconds < 60
    with psycopg.connect(SERVER, autocommit=True) as conn:
        row = conn.execute("SELECT last_vacuum FROM pg_stat_sys_tables WHERE schemaname = "
                           "'pg_catalog' AND relname = 'pg_attribute'").fetchone()
    assert row is not None
    assert row[0] is not None
    assert row[0] >= before


def test_a_server_away_is_skipped_without_failing() -> None:
    started = time.monotonic()
    vacuumed = vacuum_catalogs(f"postgresql://postgres@127.0.0.1:{free_port()}/test")
    assert (vacuumed.catalogs, vacuumed.skipped) == ([], "OperationalError")
    assert time.monotonic() - started < 5


def test_the_budget_bounds_it() -> None:
    vacuumed = vacuum_catalogs(SERVER, least_dead=0, budget=0.0)
    assert (vacuumed.catalogs, vacuumed.skipped) == ([], None)
