"""The rollout state machine, driven tick by tick with a virtual clock and no cluster.

`Sim` plays the cluster: the plan of each tick becomes the Deployments the next tick observes (ready
at once unless held), and the status goes through `to_dict`/`from_dict` between ticks, as it does
through the API server, so everything the machine needs must live in the status.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from sits.operator.meta import Owner
from sits.operator.observations import (
    FAILED,
    INCONCLUSIVE,
    PASSED,
    AnalysisOutcome,
    DeploymentObservation,
    Observations,
)
from sits.operator.replicas import canary_replicas
from sits.operator.rollout import analysis_due, decide
from sits.operator.spec import parse_spec
from sits.operator.status import Status

OWNER = Owner("demo", "llm", "uid-1")
ANALYSIS = {"prometheus": {"url": "http://prometheus:9090"}, "maxDeltaMs": 50, "interval": "10s", "failureLimit": 2,
            "inconclusiveLimit": 3}
STEPS = [{"setWeight": 25}, {"pause": {"duration": "30s"}}, {"setWeight": 50}, {"pause": {}}]


def spec_of(image: str = "sits:1", replicas: int = 4, steps=STEPS, analysis=ANALYSIS, gateway: bool = True, **extra):
    rollout: dict[str, Any] = {"canary": {"steps": steps}}
    if analysis is not None:
        rollout["canary"]["analysis"] = analysis
    if gateway:
        rollout["trafficRouting"] = {"gatewayAPI": {"httpRoute": "demo"}}
    return parse_spec({"model": {"uri": "hf://org/tiny"}, "image": image, "replicas": replicas, "rollout": rollout,
                       **extra}, "demo")


@dataclass
class Sim:
    spec: Any
    now: float = 1_000_000.0
    status: dict[str, Any] = field(default_factory=dict)
    deployments: dict[str, DeploymentObservation] = field(default_factory=dict)
    held: set[str] = field(default_factory=set)
    events: list[tuple[str, str]] = field(default_factory=list)
    resume: bool = False
    last: Any = None

    def tick(self, seconds: float = 1.0, outcome: AnalysisOutcome | None = None, **overrides: Any):
        """Advance the clock, observe, decide, and let the 'cluster' act on the plan."""
        self.now += seconds
        status = Status.from_dict(self.status)
        due = analysis_due(self.spec, OWNER, status, self.now)
        obs = Observations(stable=self.deployments.get("stable", DeploymentObservation()),
                           canary=self.deployments.get("canary", DeploymentObservation()),
                           generation=1, resume_requested=self.resume,
                           analysis=outcome if due else None, **overrides)
        decision = decide(self.spec, OWNER, status, obs, self.now)
        self.status = decision.status.to_dict()
        self.events += [(e.type, e.reason) for e in decision.events]
        if decision.consume_resume:
            self.resume = False
        for track, plan in (("stable", decision.plan.stable), ("canary", decision.plan.canary)):
            ready = 0 if track in self.held else plan.replicas
            self.deployments[track] = DeploymentObservation(
                exists=True, revision=plan.revision, replicas=plan.replicas, status_replicas=plan.replicas,
                ready_replicas=ready, updated_replicas=plan.replicas, generation=1, observed_generation=1)
        self.last = decision
        return decision

    def run_until(self, predicate, max_ticks: int = 200, **tick_args: Any):
        for _ in range(max_ticks):
            self.tick(**tick_args)
            if predicate(self):
                return self
        raise AssertionError(f"never reached; status {self.status}")

    @property
    def phase(self) -> str:
        return self.status.get("phase")

    def condition(self, kind: str) -> dict[str, Any] | None:
        return next((c for c in self.status.get("conditions", []) if c["type"] == kind), None)


def passed(delta: float = 3.0) -> AnalysisOutcome:
    return AnalysisOutcome(PASSED, delta, f"P95 delta {delta} ms <= maxDeltaMs 50 ms")


def failed(delta: float = 120.0) -> AnalysisOutcome:
    return AnalysisOutcome(FAILED, delta, f"P95 delta {delta} ms > maxDeltaMs 50 ms")


NO_DATA = AnalysisOutcome(INCONCLUSIVE, None, "Prometheus at http://prometheus:9090 unreachable")


def healthy_sim(**spec_args: Any) -> Sim:
    sim = Sim(spec_of(**spec_args))
    sim.run_until(lambda s: s.phase == "Healthy")
    return sim


def start_canary(sim: Sim, image: str = "sits:2", **spec_args: Any) -> str:
    sim.spec = spec_of(image=image, **spec_args)
    sim.tick()
    assert sim.phase == "Progressing"
    return sim.status["canaryRevision"]


def test_first_revision_becomes_stable_directly():
    sim = Sim(spec_of())
    sim.held.add("stable")
    sim.tick()
    assert sim.phase == "Pending" and sim.status["stableRevision"] and "canaryRevision" not in sim.status
    assert sim.last.plan.stable.replicas == 4 and sim.last.plan.canary.replicas == 0
    sim.tick()
    assert sim.phase == "Pending"  # the pods are not ready yet
    sim.held.clear()
    sim.run_until(lambda s: s.phase == "Healthy")
    assert sim.status["ready"] == "4/4" and sim.condition("Healthy")["status"] == "True"
    assert sim.events == []


def test_replica_changes_apply_in_place():
    sim = healthy_sim()
    stable = sim.status["stableRevision"]
    sim.spec = spec_of(replicas=6)
    sim.run_until(lambda s: s.phase == "Healthy" and s.status["ready"] == "6/6")
    assert sim.status["stableRevision"] == stable and "canaryRevision" not in sim.status
    assert sim.last.plan.stable.replicas == 6


def test_template_change_runs_the_steps_and_promotes():
    sim = healthy_sim()
    old = sim.status["stableRevision"]
    new = start_canary(sim)
    assert new != old and ("Normal", "CanaryStarted") in sim.events
    assert sim.status["currentStep"] == 0 and sim.status["canaryWeight"] == 25
    assert sim.last.plan.canary.replicas == 1 and sim.last.plan.stable.replicas == 4  # HTTPRoute: stable stays full
    assert sim.last.plan.canary.revision == new and sim.last.plan.stable.revision == old
    # step 0 waits for a passing analysis run (every 10 s, once the canary serves)
    sim.run_until(lambda s: s.status["currentStep"] == 1, outcome=passed())
    assert sim.phase == "Paused" and sim.condition("Paused")["reason"] == "CanaryPauseStep"
    paused_at = sim.now
    sim.run_until(lambda s: s.status["currentStep"] == 2, outcome=passed())
    assert sim.now - paused_at >= 30
    sim.run_until(lambda s: s.status["currentStep"] == 3, outcome=passed())
    assert sim.status["canaryWeight"] == 50 and sim.last.plan.canary.replicas == 2
    for _ in range(50):  # an indefinite pause holds
        sim.tick(outcome=passed())
    assert sim.phase == "Paused" and sim.status["currentStep"] == 3
    sim.resume = True
    sim.tick(outcome=passed())
    assert not sim.resume, "the annotation is consumed"
    sim.run_until(lambda s: s.phase == "Healthy")
    assert sim.status["stableRevision"] == new and "canaryRevision" not in sim.status
    assert sim.status["canaryWeight"] == 0 and sim.last.plan.canary.replicas == 0
    assert sim.last.plan.stable.revision == new and sim.status["stableSpec"]["image"] == "sits:2"
    assert ("Normal", "Promoted") in sim.events


def test_promotion_waits_for_the_stable_deployment():
    sim = healthy_sim(steps=[{"setWeight": 50}])
    new = start_canary(sim, steps=[{"setWeight": 50}])
    sim.held.add("stable")
    sim.run_until(lambda s: s.status.get("currentStep") == 1, outcome=passed())
    for _ in range(5):
        sim.tick(outcome=passed())
    assert sim.phase == "Progressing" and sim.condition("Progressing")["reason"] == "Promoting"
    assert sim.last.plan.stable.revision == new and sim.last.plan.canary.replicas == 2  # the canary still serves
    sim.held.clear()
    sim.run_until(lambda s: s.phase == "Healthy")
    assert sim.status["stableRevision"] == new


def test_steps_wait_for_canary_readiness():
    sim = healthy_sim()
    sim.held.add("canary")
    start_canary(sim)
    for _ in range(30):
        sim.tick(outcome=passed())
    assert sim.status["currentStep"] == 0
    assert "waiting for canary pods (0/1 ready)" in sim.condition("Progressing")["message"]
    assert "nextRunAt" not in sim.status["analysis"], "no analysis before the canary serves"
    sim.held.clear()
    sim.run_until(lambda s: s.status["currentStep"] == 1, outcome=passed())


def test_failed_analysis_rolls_back_after_failure_limit_consecutive_failures():
    sim = healthy_sim()
    stable = sim.status["stableRevision"]
    canary = start_canary(sim)
    sim.run_until(lambda s: s.status["analysis"].get("consecutiveFailures") == 1, outcome=failed())
    assert sim.phase == "Progressing"
    sim.run_until(lambda s: s.status["analysis"].get("lastResult") == PASSED, outcome=passed())
    assert sim.status["analysis"]["consecutiveFailures"] == 0, "a pass resets the count"
    sim.run_until(lambda s: s.phase == "RolledBack", outcome=failed(120.4))
    assert sim.status["abortedRevision"] == canary and sim.status["stableRevision"] == stable
    assert sim.status["canaryWeight"] == 0 and "canaryRevision" not in sim.status
    assert sim.last.plan.canary.replicas == 0 and sim.last.plan.stable.revision == stable
    rolled_back = sim.condition("RolledBack")
    assert rolled_back["status"] == "True" and rolled_back["reason"] == "AnalysisFailed"
    assert "120.4 ms > maxDeltaMs 50 ms" in rolled_back["message"] and "2 consecutive" in rolled_back["message"]
    assert ("Warning", "RolledBack") in sim.events
    for _ in range(20):  # stays rolled back while the spec still names that revision
        sim.tick(outcome=failed())
    assert sim.phase == "RolledBack" and "canaryRevision" not in sim.status
    newer = start_canary(sim, image="sits:3")
    assert newer not in (canary, stable) and sim.condition("RolledBack") is None


def test_inconclusive_analysis_never_rolls_back_and_pauses_at_its_limit():
    sim = healthy_sim()
    start_canary(sim)
    sim.run_until(lambda s: s.status["analysis"].get("consecutiveInconclusive") == 2, outcome=NO_DATA)
    assert sim.phase == "Progressing" and sim.status["currentStep"] == 0, "inconclusive is never a pass"
    sim.run_until(lambda s: s.phase == "Paused", outcome=NO_DATA)
    paused = sim.condition("Paused")
    assert paused["reason"] == "AnalysisInconclusive" and "unreachable" in paused["message"]
    assert ("Warning", "AnalysisInconclusive") in sim.events
    for _ in range(100):
        sim.tick(outcome=NO_DATA)
    assert sim.phase == "Paused" and sim.status["currentStep"] == 0 and "abortedRevision" not in sim.status
    sim.status["phase"] = "Progressing"  # resume by a status patch
    sim.tick(outcome=passed())
    assert ("Normal", "Resumed") in sim.events
    sim.run_until(lambda s: s.status["currentStep"] == 1, outcome=passed())


def test_a_failure_while_paused_for_no_data_still_aborts():
    sim = healthy_sim()
    start_canary(sim)
    sim.run_until(lambda s: s.phase == "Paused", outcome=NO_DATA)
    sim.run_until(lambda s: s.phase == "RolledBack", outcome=failed())


def test_an_alert_aborts_the_running_canary():
    sim = healthy_sim()
    canary = start_canary(sim)
    sim.status["abortRequest"] = {"revision": canary, "reason": "AlertFiring", "message": "alert SitsCanaryP95Delta"}
    sim.tick()
    assert sim.phase == "RolledBack" and sim.condition("RolledBack")["reason"] == "AlertFiring"
    assert "abortRequest" not in sim.status
    start_canary(sim, image="sits:3")
    sim.status["abortRequest"] = {"revision": canary, "reason": "AlertFiring", "message": "old"}
    sim.tick()
    assert sim.phase == "Progressing" and "abortRequest" not in sim.status, "a request for an older canary is dropped"


def test_reverting_the_template_cancels_the_canary():
    sim = healthy_sim()
    start_canary(sim)
    sim.spec = spec_of(image="sits:1")
    sim.tick()
    assert sim.phase == "Healthy" and "canaryRevision" not in sim.status
    assert ("Normal", "CanaryCancelled") in sim.events and sim.last.plan.canary.replicas == 0


def test_a_new_template_mid_rollout_restarts_the_canary():
    sim = healthy_sim()
    first = start_canary(sim)
    sim.run_until(lambda s: s.status["currentStep"] == 1, outcome=passed())
    second = start_canary(sim, image="sits:3")
    assert second != first and sim.status["currentStep"] == 0 and sim.status["analysis"]["consecutiveFailures"] == 0


def test_without_gateway_api_traffic_follows_the_replica_ratio():
    sim = healthy_sim(gateway=False)
    start_canary(sim, gateway=False)
    assert (sim.last.plan.stable.replicas, sim.last.plan.canary.replicas) == (4, 1), "stable shrinks once canary serves"
    sim.tick()
    assert (sim.last.plan.stable.replicas, sim.last.plan.canary.replicas) == (3, 1)
    sim.run_until(lambda s: s.status["currentStep"] == 3, outcome=passed())
    sim.tick()
    assert (sim.last.plan.stable.replicas, sim.last.plan.canary.replicas) == (2, 2)


@pytest.mark.parametrize(("replicas", "weight", "expected"), [(4, 25, 1), (4, 10, 1), (4, 50, 2), (4, 100, 4),
                                                              (1, 10, 1), (0, 50, 0), (4, 0, 0)])
def test_canary_replicas_for_a_weight(replicas, weight, expected):
    assert canary_replicas(spec_of(replicas=replicas), weight) == expected


def test_without_steps_or_analysis_a_new_template_rolls_straight_through():
    sim = healthy_sim(steps=[], analysis=None)
    new = start_canary(sim, steps=[], analysis=None)
    sim.run_until(lambda s: s.phase == "Healthy")
    assert sim.status["stableRevision"] == new


def test_timed_pause_can_be_skipped_with_the_annotation_and_stray_annotations_are_dropped():
    sim = healthy_sim()
    sim.resume = True
    sim.tick()
    assert not sim.resume, "no canary: the annotation is dropped so it cannot skip a later pause"
    start_canary(sim)
    sim.run_until(lambda s: s.phase == "Paused", outcome=passed())
    sim.resume = True
    sim.tick(outcome=passed())
    assert sim.status["currentStep"] == 2 and not sim.resume


def test_a_quiet_tick_changes_nothing():
    sim = healthy_sim()
    before = dict(sim.status)
    sim.tick()
    assert sim.status == before
