"""What the rollout wants running this moment: the contract between rollout.py and the builders."""

from __future__ import annotations

from dataclasses import dataclass

from sits.operator.spec import WorkloadSpec


@dataclass(frozen=True)
class TrackPlan:
    """One track's Deployment: the pod template's spec, its revision (hash) and its replica count."""

    workload: WorkloadSpec
    revision: str
    replicas: int


@dataclass(frozen=True)
class Plan:
    """Both tracks and the traffic between them.

    Attributes:
        stable, canary: the canary Deployment always exists; with no canary running it carries
            the stable template at 0 replicas.
        canary_weight: percent of traffic for the canary (HTTPRoute weights; 0 with no canary).
        canary_active: a canary is running (its tenants, if any, are routed to it).
    """

    stable: TrackPlan
    canary: TrackPlan
    canary_weight: int = 0
    canary_active: bool = False
