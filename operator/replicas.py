"""How many pods each track runs for a canary traffic weight."""

from __future__ import annotations

import math

from sits.operator.spec import SitsDeploymentSpec


def canary_replicas(spec: SitsDeploymentSpec, weight: int) -> int:
    """Canary pods for a traffic weight: the weight's share of replicas, at least 1 while it gets traffic."""
    if spec.replicas == 0:
        return 0
    wanted = math.ceil(spec.replicas * weight / 100) if weight > 0 else 0
    if wanted == 0 and (weight > 0 or spec.rollout.canary.tenants):
        wanted = 1  # tenant-routed canaries serve their tenants from the first step
    return min(wanted, spec.replicas)


def stable_replicas(spec: SitsDeploymentSpec, weight: int, canary_target: int, canary_ready: int) -> int:
    """Stable pods while a canary runs.

    Behind an HTTPRoute the weights split traffic, so stable keeps every replica. Without one,
    traffic follows the pod ratio: stable gives up one pod per *ready* canary pod (surge first,
    so capacity never dips), and keeps at least one until the canary takes all traffic.
    """
    if spec.rollout.gateway_api is not None or spec.replicas == 0:
        return spec.replicas
    replaced = min(canary_ready, canary_target)
    return max(spec.replicas - replaced, 0 if weight >= 100 else 1)
