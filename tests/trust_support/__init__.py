"""Shared pieces of the identity, guardrail, limit, hook and telemetry tests."""

from __future__ import annotations

import faulthandler
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def deadline() -> Iterator[None]:
    """A hard timeout per test: a hung test dumps every stack and ends the run."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
