"""Validation once, at the edge: a served request's sampling params and model are checked once, the
engine takes them as checked; a direct user of the engine gets the same errors as before."""

from __future__ import annotations

import openai
import pytest

from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.errors import PromptTooLongError
from sits.runtime.engine.request import SamplingParams, SamplingParamsError
from sits.runtime.engine.validated import ValidatedSamplingParams
from sits.runtime.server.serving import ServingContext
from tests.support.serving import openai_client, serve_loaded

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def served(tiny):
    with serve_loaded(tiny, max_model_len=64, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=64) as pair:
        yield pair


@pytest.fixture
def calls(monkeypatch):
    """How many times the real SamplingParams.validate and ServingContext.check_model ran."""
    counted = {"validate": 0, "check_model": 0}

    def counting(name, real):
        def wrapper(*args, **kwargs):
            counted[name] += 1
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(SamplingParams, "validate", counting("validate", SamplingParams.validate))
    monkeypatch.setattr(ServingContext, "check_model", counting("check_model", ServingContext.check_model))
    return counted


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_served_request_is_validated_once(served, calls, endpoint):
    client = openai_client(served[0])
    if endpoint == "chat":
        reply = client.chat.completions.create(model=served[1].model_name, max_tokens=3,
                                               messages=[{"role": "user", "content": "hi"}])
    else:
        reply = client.completions.create(model=served[1].model_name, prompt="hi", max_tokens=3)
    assert reply.usage.completion_tokens == 3
    assert calls == {"validate": 1, "check_model": 1}


def test_the_edge_error_is_unchanged(served):
    client = openai_client(served[0])
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=served[1].model_name, prompt="hi", max_tokens=3, temperature=3.0)
    assert refused.value.body["param"] == "temperature" and "between 0 and 2" in refused.value.body["message"]


def engine_for(loaded) -> LLMEngine:
    config = EngineConfig(model=ModelConfig(device="cpu", max_model_len=64), cache=CacheConfig(num_blocks=32),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    return LLMEngine.from_loaded(loaded, config)


def test_a_direct_engine_user_gets_the_engines_own_check(tiny):
    engine = engine_for(tiny)
    with pytest.raises(SamplingParamsError, match="temperature"):
        engine.add_request("a", [1, 2, 3], SamplingParams(temperature=3.0))
    with pytest.raises(PromptTooLongError, match="maximum context length is 64"):
        engine.add_request("b", [1] * 60, SamplingParams(max_tokens=10))
    engine.add_request("c", [1, 2, 3], ValidatedSamplingParams(max_tokens=2))  # checked at the edge
    while engine.has_unfinished_requests():
        engine.step()


async def test_a_direct_async_engine_user_gets_the_same_errors(tiny):
    engine = AsyncEngine.from_engine(engine_for(tiny))
    try:
        with pytest.raises(SamplingParamsError, match="top_p"):
            async for _ in engine.generate([1, 2, 3], SamplingParams(top_p=0.0), "a"):
                pass
        outputs = [o async for o in engine.generate([1, 2, 3], SamplingParams(max_tokens=2), "b")]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 2
    finally:
        await engine.shutdown(0.0)
