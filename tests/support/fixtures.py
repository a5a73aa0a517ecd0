"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.models import (  # noqa: F401 - fixtures, registered by importing them here
    hf_smollm2,
    hf_smollm2_tokenizer,
    smollm2,
    smollm2_checkpoint_dir,
    smollm2_gguf_path,
    tiny_llama_dir,
)
from tests.support.services import RunningService, redis_server


@pytest.fixture(scope="module")
def redis_service() -> Iterator[RunningService]:
    """A real Redis for the module's tests, stopped afterwards."""
    with redis_server() as service:
        yield service
