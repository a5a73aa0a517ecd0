"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.services import RunningService, redis_server


@pytest.fixture(scope="module")
def redis_service() -> Iterator[RunningService]:
    """A real Redis for the module's tests, stopped afterwards."""
    with redis_server() as service:
        yield service
