"""Picking a replica: round-robin, least-loaded, approximate (the router's own history as the
prefix index) and precise (the replicas' published KV state), the last two with a load guard.

The precise score of replica r for a prompt of B full blocks:

    matched(r) = max(blocks r published as cached, blocks the router sent r in the last recent_s)
    score(r)   = prefix · matched(r) / B − running · in_flight(r) − waiting · waiting(r) − kv · kv_usage(r)

The highest score wins; ties go to the least loaded, then round-robin. Load guard: when the winner
has `imbalance` or more requests in flight beyond the least loaded replica, the least loaded one
gets the request instead. With nothing matched anywhere the choice is the least loaded replica.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from sits.runtime.router.config import Policy, ScoringWeights
from sits.runtime.router.index import KVIndex, RoutingHistory
from sits.runtime.router.prompt import PromptKey
from sits.runtime.router.replicas import Replica


@dataclass(frozen=True)
class Decision:
    """Replicas to try in order (the first, then one failover), why the first, and its match.

    Attributes:
        order: the chosen replica first, then the others by preference.
        reason: the `policy_decision` label: prefix | load | guard | round_robin | least_loaded.
        matched_blocks: prompt blocks the chosen replica is believed to hold.
    """

    order: list[Replica]
    reason: str
    matched_blocks: int


@dataclass(eq=False)  # compared and hashed by identity, as one router per process
class Router:
    """The policy over a pool's replicas (stateless but for the round-robin counter).

    Args:
        policy: which policy.
        weights: the score's weights and load guard.
        index: the replicas' published KV state (precise).
        history: where the router sent each prefix block (approximate; recent choices in precise).
        recent_s: in precise, history entries younger than this count as cached.
    """

    policy: Policy
    weights: ScoringWeights
    index: KVIndex
    history: RoutingHistory
    recent_s: float = 30.0
    _turn: Iterator[int] = field(default_factory=itertools.count, init=False, repr=False)

    def choose(self, replicas: list[Replica], key: PromptKey) -> Decision:
        """Order `replicas` (those up) for a request whose prompt hashes to `key`."""
        if not replicas:
            raise ValueError("no replica is up")
        turn = next(self._turn)
        rotated = replicas[turn % len(replicas):] + replicas[:turn % len(replicas)]
        if self.policy is Policy.ROUND_ROBIN:
            return Decision(rotated, "round_robin", 0)
        by_load = sorted(rotated, key=self._load)  # stable: ties keep the rotation
        if self.policy is Policy.LEAST_LOADED or not key.block_hashes:
            return Decision(by_load, "least_loaded" if self.policy is Policy.LEAST_LOADED else "load", 0)
        matched = {replica.url: self._matched(replica, key) for replica in rotated}
        total = len(key.block_hashes)
        scored = sorted(by_load, key=lambda r: self.weights.prefix * matched[r.url] / total - self._load(r),
                        reverse=True)
        best, least = scored[0], by_load[0]
        if matched[best.url] == 0:
            return Decision(by_load, "load", 0)
        if best is not least and best.in_flight - least.in_flight >= self.weights.imbalance:
            return Decision([least, *[r for r in scored if r is not least]], "guard", matched[least.url])
        return Decision(scored, "prefix", matched[best.url])

    def _matched(self, replica: Replica, key: PromptKey) -> int:
        if self.policy is Policy.APPROXIMATE:
            return self.history.match(replica.url, key.block_hashes)
        published = self.index.match(replica.replica_id, key.block_hashes)
        recent = self.history.match(replica.url, key.block_hashes, max_age_s=self.recent_s)
        return max(published, recent)

    def _load(self, replica: Replica) -> float:
        """The load part of the score (lower is better); the router's own in-flight count always,
        the replica's published waiting queue and KV use when the store has them."""
        state = self.index.get(replica.replica_id) if self.policy is not Policy.ROUND_ROBIN else None
        load = self.weights.running * replica.in_flight
        if state is not None:
            load += self.weights.waiting * state.waiting + self.weights.kv * state.kv_usage
        return load
