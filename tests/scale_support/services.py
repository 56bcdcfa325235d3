"""A PostgreSQL schema and a Redis key prefix of their own for a test, removed afterwards."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import psycopg
import pytest
import redis

POSTGRES = os.environ.get("COPILOT_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
REDIS = os.environ.get("COPILOT_TEST_REDIS", "redis://127.0.0.1:6379/0")


@contextlib.contextmanager
def postgres_schema(prefix: str = "scale") -> Iterator[str]:
    """`POSTGRES` with `?schema=` a fresh schema; the schema is dropped at the end."""
    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(POSTGRES, autocommit=True, connect_timeout=5):
            pass
    except psycopg.OperationalError as exc:
        pytest.fail(f"these tests need PostgreSQL at {POSTGRES} ({exc})", pytrace=False)
    try:
        yield f"{POSTGRES}?schema={schema}"
    finally:
        with psycopg.connect(POSTGRES, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@contextlib.contextmanager
def redis_prefix() -> Iterator[str]:
    """`REDIS` with `?prefix=` a fresh key prefix; its keys are deleted at the end."""
    prefix = f"scale-test-{uuid.uuid4().hex[:12]}:"
    client = redis.Redis.from_url(REDIS)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"these tests need Redis at {REDIS} ({exc})", pytrace=False)
    try:
        yield f"{REDIS}?prefix={prefix}"
    finally:
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()
