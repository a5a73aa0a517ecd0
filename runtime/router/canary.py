"""The canary split, applied by the router where no Gateway API does it.

Replicas say which track they serve (`sits serve --track stable|canary`, read from their /metrics).
While a canary replica is up, the tenants named for the canary go to canary replicas only, and of
the other requests `weight` percent go to the canary, spread evenly (request n goes to the canary
when ⌊(n+1)·w/100⌋ > ⌊n·w/100⌋: exactly w of every 100, no randomness). The policy then picks among
the chosen track's replicas; the other track's replicas follow in the failover order. Each replica
keeps its `track` label, so the P95 per track still reaches the operator's analysis.
"""

from __future__ import annotations

from collections.abc import Collection

from sits.runtime.router.replicas import Replica

CANARY, STABLE = "canary", "stable"


class CanarySplit:
    """Splits the replicas that are up into (chosen track, the rest) for each request.

    Args:
        weight: percent of requests (outside `tenants`) for the canary, 0..100.
        tenants: tenants whose requests all go to the canary while one is up.
    """

    def __init__(self, weight: int = 0, tenants: Collection[str] = ()) -> None:
        if not 0 <= weight <= 100:
            raise ValueError(f"canary weight must be 0..100 percent, got {weight}")
        self.weight = weight
        self.tenants = frozenset(tenants)
        self._count = 0

    def split(self, replicas: list[Replica], tenant: str) -> tuple[list[Replica], list[Replica]]:
        """(replicas of the track this request goes to, the others for failover)."""
        canary = [r for r in replicas if r.track == CANARY]
        stable = [r for r in replicas if r.track != CANARY]
        if not canary or not stable:
            return replicas, []
        if tenant in self.tenants:
            return canary, stable
        count, self._count = self._count, self._count + 1
        to_canary = (count + 1) * self.weight // 100 > count * self.weight // 100
        return (canary, stable) if to_canary else (stable, canary)
