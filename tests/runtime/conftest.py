"""Fixtures of the runtime tests: for the OpenAI-API tests a module defines `served` (the running
server and its engine, e.g. through tests.support.serving.serve_loaded) and these give the client
and the served model id; `one_torch_thread` for modules that run many small engine steps."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.support.serving import openai_client


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai_client(served[0])


@pytest.fixture(scope="module")
def model(served) -> str:
    return served[1].model_name


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread while a module runs (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`):
    test workers share two cores, and the small batches of these tests run several times faster
    without oversubscription."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
