"""Fixtures of the runtime tests: for the OpenAI-API tests a module defines `served` (the running
server and its engine, e.g. through tests.support.serving.serve_loaded) and these give the client
and the served model id; `one_torch_thread` for modules that run many small engine steps; `tiny`,
the tiny random Llama loaded for engine tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import ModelConfig
from sits.runtime.models.loading import LoadedModel, load_model

if TYPE_CHECKING:  # the GPU machine has no openai: its test step must still load this conftest
    import openai


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    from tests.support.serving import openai_client

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


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir) -> LoadedModel:
    """The tiny random GQA Llama (real loading and model code, SmolLM2's tokenizer), float32 on CPU."""
    return load_model(ModelConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32"),
                      TorchAttentionBackend(), progress=False)
