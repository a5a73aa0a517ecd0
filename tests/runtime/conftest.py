"""Fixtures of the OpenAI-API tests: a module defines `served` (the running server and its engine,
e.g. through tests.support.serving.serve_loaded); these give the client and the served model id."""

from __future__ import annotations

import openai
import pytest

from tests.support.serving import openai_client


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai_client(served[0])


@pytest.fixture(scope="module")
def model(served) -> str:
    return served[1].model_name
