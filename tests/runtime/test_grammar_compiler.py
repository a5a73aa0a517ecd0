"""The grammar compiler in front of the engine (`sits.runtime.server.grammar_compiler`), with real
xgrammar worker processes over SmolLM2's vocabulary: nesting and size limits, the per-tenant bound,
the timeout that kills a worker, and a client that leaves stopping its compile at once. The
server-level behaviour (400s naming the param, no admission slot held, /health answering) is
tests/hardening/test_request_cost_bounds.py."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from sits.runtime.engine.structured_output import (
    GrammarCache,
    StructuredOutputError,
    json_schema_spec,
    regex_spec,
)
from sits.runtime.models.tokenizer import Tokenizer
from sits.runtime.server.errors import OpenAIError
from sits.runtime.server.grammar_compiler import (
    ClientLeft,
    GrammarCompileCollector,
    GrammarCompiler,
    GrammarLimits,
    check_spec_limits,
    nesting_depth,
)

SLOW_DEPTH = 550  # tens of seconds in xgrammar


def nested_arrays(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.fixture(scope="module")
def cache(smollm2_checkpoint_dir) -> GrammarCache:
    tokenizer = Tokenizer.from_file(smollm2_checkpoint_dir / "tokenizer.json", smollm2_checkpoint_dir / "tokenizer_config.json")
    return GrammarCache(tokenizer, tokenizer.vocab_size)


def test_nesting_depth_counts_containers_outside_strings():
    assert nesting_depth(json.dumps(nested_arrays(3)), "json_schema") == 4
    assert nesting_depth('{"a": "{{{[[[", "b": ["\\"]]]"]}', "json_schema") == 2
    assert nesting_depth("((a|(b))[c-d]{2})", "regex") == 3
    assert nesting_depth('"((((a))))"', "regex") == 4  # quotes are ordinary characters in a regex
    assert nesting_depth('root ::= "((((" (a (b))', "grammar") == 2  # a literal's brackets are text
    assert nesting_depth("\\(\\(\\(x", "regex") == 0
    deep = "[" * 200_000 + "]" * 200_000  # far past Python's stack: counted without recursion
    assert nesting_depth(deep, "json_schema") == 200_000


def test_limits_refuse_deep_and_large_constraints_naming_their_param():
    limits = GrammarLimits(max_depth=10, max_bytes=1000)
    check_spec_limits(json_schema_spec(nested_arrays(8)), limits)
    with pytest.raises(StructuredOutputError) as deep:
        check_spec_limits(json_schema_spec(nested_arrays(12), "structured_outputs.json"), limits)
    assert deep.value.param == "structured_outputs" and "nests 13 levels" in str(deep.value)
    with pytest.raises(StructuredOutputError) as large:
        check_spec_limits(regex_spec("a" * 1001, "guided_regex"), limits)
    assert large.value.param == "guided_regex" and "1001 bytes" in str(large.value)
    with pytest.raises(ValueError, match="compile_timeout_s"):
        GrammarLimits(compile_timeout_s=0).validate()


def test_compiles_land_in_the_cache_slow_ones_time_out_and_a_leaving_client_kills_its_worker(cache):
    limits = GrammarLimits(max_depth=1000, compile_timeout_s=1.0, workers=2, per_tenant=1)

    async def scenario() -> None:
        compiler = GrammarCompiler(cache, limits)
        try:
            await compiler.prepare()
            small = json_schema_spec({"type": "object", "properties": {"a": {"type": "integer"}}})
            await compiler.compile(small, "t1")
            assert cache.contains(small) and compiler.in_flight("t1") == 0
            with pytest.raises(StructuredOutputError) as refused:  # xgrammar's refusal: a 400 naming the field
                await compiler.compile(regex_spec("(", "guided_regex"), "t1")
            assert refused.value.param == "guided_regex"

            slow = json_schema_spec(nested_arrays(SLOW_DEPTH), "structured_outputs.json")
            started = time.monotonic()
            with pytest.raises(StructuredOutputError, match="longer than 1 s to compile") as timed_out:
                await compiler.compile(slow, "t1")
            assert timed_out.value.param == "structured_outputs" and not cache.contains(slow)
            assert compiler.killed == 1 and time.monotonic() - started < 30  # boot + 1 s, not the compile

            # the client leaves while its compile runs: the worker is killed at once, long before the timeout
            compiler.limits = GrammarLimits(max_depth=1000, compile_timeout_s=600, workers=2, per_tenant=1,
                                            queue_per_tenant=1)
            left = asyncio.Event()
            task = asyncio.ensure_future(compiler.compile(slow, "t1", left.wait))
            while not compiler._busy:  # the compile reached a worker
                await asyncio.sleep(0.01)
            [worker] = compiler._busy
            waiting_spec = json_schema_spec({"type": "string"})
            waiting = asyncio.ensure_future(compiler.compile(waiting_spec, "t1"))  # waits for t1's turn
            while compiler.in_flight("t1") < 2:
                await asyncio.sleep(0.01)
            with pytest.raises(OpenAIError) as busy:  # one running and one waiting: no more for t1
                await compiler.compile(json_schema_spec({"type": "number"}), "t1")
            assert busy.value.status == 429 and busy.value.code == "too_many_grammar_compiles"
            await compiler.compile(json_schema_spec({"type": "boolean"}), "t2")  # another tenant is served
            assert not waiting.done() and len(compiler._busy) == 1
            left.set()
            leaving = time.monotonic()
            with pytest.raises(ClientLeft):
                await task
            assert worker.process.returncode is not None and time.monotonic() - leaving < 5
            await waiting  # t1's next compile had its turn
            assert cache.contains(waiting_spec)
            assert compiler.killed == 2 and compiler.in_flight("t1") == 0
            scraped = {sample.name: sample.value for family in GrammarCompileCollector(compiler, "m", "stable").collect()
                       for sample in family.samples}
            assert scraped == {"sits_grammar_compiles_in_flight": 0.0, "sits_grammar_compile_timeouts_total": 1.0,
                               "sits_grammar_compile_workers_killed_total": 2.0, "sits_grammar_compiles_refused_total": 1.0}
        finally:
            await compiler.close()

    asyncio.run(scenario())
