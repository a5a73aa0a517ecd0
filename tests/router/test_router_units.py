"""The router's pure parts: no torch on import, the weights flag, the prefix index, the policies,
and hashes equal to the engine's own for the same tokens and tenant salt."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sits.runtime.config import ConfigError
from sits.runtime.engine.prefix_hash import extend_block_hashes
from sits.runtime.router.config import Policy, RouterConfig, ScoringWeights
from sits.runtime.router.index import KVIndex, ReplicaKV, RoutingHistory
from sits.runtime.router.policy import Router
from sits.runtime.router.prompt import PromptHasher, PromptKey
from sits.runtime.router.replicas import Replica


def test_the_router_imports_no_torch():
    code = ("import sys, sits.runtime.router.app, sits.runtime.router.command, sits.runtime.router.prompt; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_weights_parse_and_refuse_bad_input():
    weights = ScoringWeights.parse("prefix=2, running=0.5,imbalance=3")
    assert (weights.prefix, weights.running, weights.imbalance, weights.kv) == (2.0, 0.5, 3, ScoringWeights().kv)
    for bad in ("speed=1", "prefix", "prefix=fast", "running=-1"):
        with pytest.raises(ConfigError):
            ScoringWeights.parse(bad)
    with pytest.raises(ConfigError, match="--replica"):
        RouterConfig(replicas=["localhost:8000"]).validate()


class FakeTokenizer:
    """Token ids are the characters' code points (the hasher's tokenizer is an input, not the unit)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def test_prompt_hashes_equal_the_engines_for_the_same_salt_and_differ_across_tenants():
    hasher = PromptHasher(FakeTokenizer(), block_size=4, served_model_name="base")  # type: ignore[arg-type]
    ids, lora, shared = hasher.prompt_ids("/v1/completions", {"model": "base", "prompt": "abcdefghijklm"})
    assert ids == [ord(c) for c in "abcdefghijklm"] and lora is None and not shared
    key = hasher.key(ids, "salt-a", None)
    engine: list[bytes] = []
    extend_block_hashes(engine, ids, 4, (len(ids) - 1) // 4, "salt-a", None)
    assert list(key.block_hashes) == engine and len(engine) == 3
    assert hasher.key(ids, "salt-b", None).block_hashes[0] != key.block_hashes[0]
    _, adapter, _ = hasher.prompt_ids("/v1/completions", {"model": "sql-lora", "prompt": "abcd"})
    assert adapter == "sql-lora"
    assert hasher.prompt_ids("/v1/completions", {"prompt": 5}) is None  # the replica answers the 400


def make_router(policy: Policy, **weights) -> tuple[Router, KVIndex, RoutingHistory, list[Replica]]:
    index, history = KVIndex(), RoutingHistory(max_blocks=100)
    replicas = [Replica("http://a", replica_id="ra"), Replica("http://b", replica_id="rb"),
                Replica("http://c", replica_id="rc")]
    return Router(policy, ScoringWeights(**weights), index, history), index, history, replicas


KEY = PromptKey((b"1" * 32, b"2" * 32, b"3" * 32, b"4" * 32), 70)


def test_precise_goes_to_the_replica_holding_the_longest_prefix():
    router, index, _, replicas = make_router(Policy.PRECISE)
    index.replace({"rb": ReplicaKV(frozenset(KEY.block_hashes[:2])), "rc": ReplicaKV(frozenset(KEY.block_hashes))})
    decision = router.choose(replicas, KEY)
    assert decision.order[0].url == "http://c" and decision.reason == "prefix" and decision.matched_blocks == 4
    # A gap breaks the chain: holding blocks 0, 1 and 3 matches 2.
    index.replace({"rc": ReplicaKV(frozenset([KEY.block_hashes[i] for i in (0, 1, 3)]))})
    assert router.choose(replicas, KEY).matched_blocks == 2


def test_the_load_guard_and_nothing_matched_go_to_the_least_loaded():
    router, index, _, replicas = make_router(Policy.PRECISE, imbalance=3)
    index.replace({"rc": ReplicaKV(frozenset(KEY.block_hashes))})
    replicas[2].in_flight = 3
    decision = router.choose(replicas, KEY)
    assert decision.reason == "guard" and decision.order[0].in_flight == 0
    replicas[2].in_flight, replicas[0].in_flight, replicas[1].in_flight = 0, 2, 1
    index.clear()
    decision = router.choose(replicas, KEY)
    assert decision.reason == "load" and decision.order[0].url == "http://c"


def test_approximate_follows_the_routers_own_history_and_round_robin_rotates():
    router, _, history, replicas = make_router(Policy.APPROXIMATE)
    history.record("http://b", KEY.block_hashes[:3])
    assert router.choose(replicas, KEY).order[0].url == "http://b"
    history.forget("http://b")
    assert router.choose(replicas, KEY).reason == "load"
    rr, _, _, replicas = make_router(Policy.ROUND_ROBIN)
    assert [rr.choose(replicas, KEY).order[0].url for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]


def test_the_routing_history_is_bounded():
    history = RoutingHistory(max_blocks=3)
    history.record("http://a", [bytes([i]) * 32 for i in range(5)])
    assert len(history) == 3


def test_the_canary_split_takes_its_weight_exactly_and_its_tenants_whole():
    from sits.runtime.router.canary import CanarySplit

    stable, canary = Replica("http://s", track="stable"), Replica("http://c", track="canary")
    split = CanarySplit(weight=25, tenants=("beta",))
    chosen = [split.split([stable, canary], "acme")[0][0].url for _ in range(100)]
    assert chosen.count("http://c") == 25 and "http://c" in chosen[:4]
    assert all(split.split([stable, canary], "beta") == ([canary], [stable]) for _ in range(5))
    assert split.split([stable], "beta") == ([stable], [])  # no canary up: everyone on stable
    with pytest.raises(ValueError):
        CanarySplit(weight=101)


@pytest.mark.parametrize("flags, message", [
    (["--replica", "localhost:8000"], "--replica must be an http(s)://host:port URL"),
    (["--replica", "http://127.0.0.1:1", "--weights", "speed=2"], "--weights takes name=value pairs"),
    (["--replica", "http://127.0.0.1:1", "--canary-weight", "150"], "--canary-weight must be 0..100"),
])
def test_bad_flags_are_one_line_errors(flags, message):
    result = subprocess.run([sys.executable, "-m", "sits.runtime.router", *flags], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
