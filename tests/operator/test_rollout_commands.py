"""The manual rollout commands (`sits.ai/abort`, `sits.ai/promote: full`, `sits.ai/retry`).

First the decisions, tick by tick with the state machine's simulator (no cluster); then the
operator end to end against KMock, annotating the resource as `kubectl annotate` would.
"""

from __future__ import annotations

import time

from sits.operator.meta import API_VERSION, KIND
from sits.operator.observations import ManualCommands
from sits.operator.stats import RolloutStats
from sits.operator.status import Status
from tests.operator.helpers import (
    condition,
    deployment,
    events,
    set_image,
    sitsdeployment,
    status_of,
    wait_for,
    wait_for_status,
)
from tests.operator.test_rollout import NO_DATA, STEPS, failed, healthy_sim, passed, start_canary

ABORT = ManualCommands(abort="true")
PROMOTE_FULL = ManualCommands(promote="full")
RETRY = ManualCommands(retry="true")


def warnings_of(decision) -> list[str]:
    return [e.message for e in decision.events if e.type == "Warning" and e.reason == "CommandIgnored"]


# -- decisions ------------------------------------------------------------------------------------


def test_abort_mid_canary_rolls_back_and_stays_aborted():
    sim = healthy_sim()
    stable = sim.status["stableRevision"]
    canary = start_canary(sim)
    sim.run_until(lambda s: s.status["currentStep"] == 1, outcome=passed())
    decision = sim.tick(commands=ABORT)
    assert decision.consumed_commands == ("sits.ai/abort",)
    assert sim.phase == "Degraded" and sim.status["abortedRevision"] == canary and "canaryRevision" not in sim.status
    assert sim.status["canaryWeight"] == 0 and decision.plan.canary.replicas == 0
    assert decision.plan.stable.revision == stable and decision.plan.stable.replicas == 4
    assert sim.condition("RolledBack")["reason"] == "RolloutAborted"
    assert sim.condition("Progressing")["reason"] == "RolloutAborted"
    assert "sits.ai/retry=true" in sim.condition("Progressing")["message"]
    aborted = [e for e in decision.events if e.reason == "RolloutAborted"]
    assert aborted[0].type == "Warning" and f"canary {canary} aborted" in aborted[0].message
    for _ in range(20):  # the same template does not start again
        sim.tick(outcome=passed())
    assert sim.phase == "Degraded" and "canaryRevision" not in sim.status and sim.last.plan.canary.replicas == 0
    assert sim.events.count(("Normal", "CanaryStarted")) == 1
    newer = start_canary(sim, image="sits:3")  # a new template starts a new canary
    assert newer != canary and sim.condition("RolledBack") is None


def test_abort_while_promoting_puts_the_old_template_back_on_stable():
    sim = healthy_sim(steps=[{"setWeight": 50}])
    stable = sim.status["stableRevision"]
    start_canary(sim, steps=[{"setWeight": 50}])
    sim.held.add("stable")
    sim.run_until(lambda s: s.condition("Progressing")["reason"] == "Promoting", outcome=passed())
    sim.tick(commands=ABORT)
    assert sim.phase == "Degraded" and sim.last.plan.stable.revision == stable
    assert sim.last.plan.stable.workload.image == "sits:1"


def test_retry_after_an_abort_starts_again_at_step_zero_and_can_be_promoted():
    sim = healthy_sim()
    canary = start_canary(sim)
    sim.run_until(lambda s: s.status["currentStep"] == 1, outcome=passed())
    sim.tick(commands=ABORT)
    sim.tick()
    decision = sim.tick(commands=RETRY)
    assert decision.consumed_commands == ("sits.ai/retry",) and not warnings_of(decision)
    assert sim.phase == "Progressing" and sim.status["canaryRevision"] == canary and sim.status["currentStep"] == 0
    assert "abortedRevision" not in sim.status and sim.condition("RolledBack") is None
    assert [e.reason for e in decision.events] == ["RolloutRetried", "CanaryStarted"]
    sim.run_until(lambda s: s.status["currentStep"] == 3, outcome=passed())
    sim.resume = True
    sim.run_until(lambda s: s.phase == "Healthy", outcome=passed())
    assert sim.status["stableRevision"] == canary


def test_retry_after_an_automatic_rollback():
    sim = healthy_sim()
    canary = start_canary(sim)
    sim.run_until(lambda s: s.phase == "RolledBack", outcome=failed())
    decision = sim.tick(commands=RETRY)
    assert "rolled back" in decision.events[0].message
    assert sim.phase == "Progressing" and sim.status["canaryRevision"] == canary and sim.status["currentStep"] == 0
    assert sim.status["analysis"].get("consecutiveFailures", 0) == 0, "the analysis starts over"


def test_promote_full_from_the_first_step_skips_steps_and_analysis():
    sim = healthy_sim()
    new = start_canary(sim)
    decision = sim.tick(commands=PROMOTE_FULL, outcome=NO_DATA)  # no analysis pass needed
    assert decision.consumed_commands == ("sits.ai/promote",)
    full = [e for e in decision.events if e.reason == "PromotedFull"]
    assert full and full[0].type == "Normal" and "skipping steps 1-4" in full[0].message
    assert sim.status["currentStep"] == len(STEPS) and decision.plan.stable.revision == new
    sim.run_until(lambda s: s.phase == "Healthy")
    assert sim.status["stableRevision"] == new and sim.status["stableSpec"]["image"] == "sits:2"
    assert sim.last.plan.canary.replicas == 0 and ("Normal", "Promoted") in sim.events


def test_promote_full_from_an_indefinite_pause():
    sim = healthy_sim()
    new = start_canary(sim)
    sim.run_until(lambda s: s.status["currentStep"] == 3, outcome=passed())
    assert sim.phase == "Paused" and "sits.ai/promote=full" in sim.condition("Paused")["message"]
    sim.tick(commands=PROMOTE_FULL)
    sim.run_until(lambda s: s.phase == "Healthy")
    assert sim.status["stableRevision"] == new and sim.condition("Paused") is None


def test_an_abort_when_healthy_is_removed_with_a_warning_and_changes_nothing():
    sim = healthy_sim()
    before = dict(sim.status)
    decision = sim.tick(commands=ABORT)
    assert sim.status == before and decision.consumed_commands == ("sits.ai/abort",)
    assert [e.reason for e in decision.events] == ["CommandIgnored"]
    assert "no canary is running (phase Healthy" in warnings_of(decision)[0]


def test_commands_that_do_not_apply_are_removed_with_the_reason():
    sim = healthy_sim()
    sim.tick(commands=RETRY)
    assert "no canary was aborted" in warnings_of(sim.last)[0]
    sim.tick(commands=PROMOTE_FULL)
    assert "no canary is running" in warnings_of(sim.last)[0]
    canary = start_canary(sim)
    sim.tick(commands=ManualCommands(promote="true"))
    assert "must be 'full'" in warnings_of(sim.last)[0] and sim.status["currentStep"] == 0
    sim.tick(commands=RETRY)
    assert f"canary {canary} is running" in warnings_of(sim.last)[0]
    sim.tick(commands=ABORT)
    sim.tick(commands=ABORT)
    assert f"revision {canary} is already aborted" in warnings_of(sim.last)[0]
    sim.tick(commands=PROMOTE_FULL)
    assert "sits.ai/retry starts its canary again" in warnings_of(sim.last)[0] and sim.phase == "Degraded"


def test_abort_comes_before_what_is_given_with_it():
    sim = healthy_sim()
    start_canary(sim)
    decision = sim.tick(commands=ManualCommands(abort="true", promote="full"))
    assert sim.phase == "Degraded" and "sits.ai/abort, given with it, comes first" in warnings_of(decision)[0]
    assert set(decision.consumed_commands) == {"sits.ai/abort", "sits.ai/promote"}
    decision = sim.tick(commands=ManualCommands(abort="true", retry="true"))
    assert sim.phase == "Degraded" and len(warnings_of(decision)) == 2, "stays aborted"
    sim.tick(commands=ManualCommands(retry="true", promote="full"))  # retry, then promote at once
    sim.run_until(lambda s: s.phase == "Healthy")


def test_manual_commands_are_read_from_the_annotations():
    annotations = {"sits.ai/abort": "", "sits.ai/promote": "full", "sits.ai/resume": "true", "other": "x"}
    commands = ManualCommands.from_annotations(annotations)
    assert commands == ManualCommands(abort="", promote="full")
    assert commands.present() == {"sits.ai/abort": "", "sits.ai/promote": "full"}
    assert ManualCommands.from_annotations(None) == ManualCommands()


def test_a_manual_abort_counts_under_its_own_reason():
    stats = RolloutStats()
    stats.record("llm", "a", Status(phase="Degraded"), ["RolloutAborted"])
    aborts = dict(stats.snapshot().rollouts[0].aborts)
    assert aborts == {"analysis": 0, "alert": 0, "manual": 1}


# -- end to end against KMock ---------------------------------------------------------------------

GATEWAY = {"gatewayAPI": {"httpRoute": "llm-route"}}
PAUSED_AT_HALF = {"canary": {"steps": [{"setWeight": 50}, {"pause": {}}]}, "trafficRouting": GATEWAY}


def annotate(kube, name: str, **annotations: str | None) -> None:
    kube.patch(API_VERSION, KIND, "llm", name,
               {"metadata": {"annotations": {f"sits.ai/{key}": value for key, value in annotations.items()}}})


def annotations_of(kube, name: str) -> dict[str, str]:
    return kube.get(API_VERSION, KIND, "llm", name)["metadata"].get("annotations") or {}


def route_weights(kube) -> list[tuple[str, int]]:
    route = kube.get("gateway.networking.k8s.io/v1", "HTTPRoute", "llm", "llm-route")
    return [(b["name"], b["weight"]) for b in route["spec"]["rules"][-1]["backendRefs"]] if route else []


def image_of(kube, name: str, track: str) -> str:
    return deployment(kube, name, track)["spec"]["template"]["spec"]["containers"][0]["image"]


def reasons(kube, name: str) -> list[str]:
    return [e["reason"] for e in events(kube, name)]


def test_abort_mid_canary_then_retry_and_promote(kube, deployments, run_operator):
    with run_operator():
        kube.create(sitsdeployment("manual", rollout=PAUSED_AT_HALF))
        stable = wait_for_status(kube, "manual", lambda s: s.get("phase") == "Healthy", what="Healthy")["stableRevision"]
        set_image(kube, "manual", "registry.example.com/sits:2")
        paused = wait_for_status(kube, "manual", lambda s: s.get("phase") == "Paused", what="paused at 50 %")
        canary = paused["canaryRevision"]
        assert route_weights(kube) == [("manual-stable", 50), ("manual-canary", 50)]
        annotate(kube, "manual", abort="true")
        status = wait_for_status(kube, "manual", lambda s: s.get("phase") == "Degraded", what="aborted")
        assert status["abortedRevision"] == canary and status["stableRevision"] == stable
        assert status["canaryWeight"] == 0 and "canaryRevision" not in status
        assert condition(status, "RolledBack")["reason"] == "RolloutAborted"
        assert "sits.ai/abort" not in annotations_of(kube, "manual")
        wait_for(lambda: deployment(kube, "manual", "canary")["spec"]["replicas"] == 0, what="canary at 0")
        assert route_weights(kube) == [("manual-stable", 100), ("manual-canary", 0)]
        assert image_of(kube, "manual", "stable").endswith(":1")
        # the operator posts Events after it writes the status: wait for them, never read them at once
        aborted = wait_for(lambda: [e for e in events(kube, "manual") if e["reason"] == "RolloutAborted"],
                           what="the RolloutAborted Event")
        assert aborted[0]["type"] == "Warning"
        time.sleep(1.5)  # several more reconciles: still aborted, no new canary
        assert status_of(kube, "manual")["phase"] == "Degraded" and reasons(kube, "manual").count("CanaryStarted") == 1
        assert deployment(kube, "manual", "canary")["spec"]["replicas"] == 0
        deployments.hold("manual-canary")  # keeps the retried canary at its first step
        annotate(kube, "manual", retry="true")
        status = wait_for_status(kube, "manual", lambda s: s.get("canaryRevision") == canary, what="retried")
        assert status["currentStep"] == 0 and status["phase"] == "Progressing" and "abortedRevision" not in status
        assert status["canaryStartedAt"] > paused["canaryStartedAt"]
        assert "sits.ai/retry" not in annotations_of(kube, "manual")
        wait_for(lambda: reasons(kube, "manual").count("CanaryStarted") == 2 and "RolloutRetried" in reasons(kube, "manual"),
                 what="the CanaryStarted and RolloutRetried Events of the retry")
        deployments.release("manual-canary")
        wait_for_status(kube, "manual", lambda s: s.get("phase") == "Paused" and s.get("currentStep") == 1,
                        what="the retried canary at its pause")
        annotate(kube, "manual", resume="true")
        final = wait_for_status(kube, "manual", lambda s: s.get("phase") == "Healthy", what="promoted")
        assert final["stableRevision"] == canary and image_of(kube, "manual", "stable").endswith(":2")


def test_promote_full_from_the_first_step(kube, deployments, run_operator):
    steps = [{"setWeight": 10}, {"pause": {}}, {"setWeight": 50}, {"pause": {}}]
    with run_operator():
        kube.create(sitsdeployment("rush", rollout={"canary": {"steps": steps}, "trafficRouting": GATEWAY}))
        wait_for_status(kube, "rush", lambda s: s.get("phase") == "Healthy", what="Healthy")
        deployments.hold("rush-canary")  # the canary never gets past its first step on its own
        set_image(kube, "rush", "registry.example.com/sits:2")
        status = wait_for_status(kube, "rush", lambda s: s.get("canaryRevision") and s.get("currentStep") == 0,
                                 what="a canary at step 0")
        time.sleep(0.5)
        assert status_of(kube, "rush")["currentStep"] == 0
        annotate(kube, "rush", promote="full")
        final = wait_for_status(kube, "rush", lambda s: s.get("phase") == "Healthy"
                                and s.get("stableRevision") == status["canaryRevision"], what="promoted in full")
        assert "canaryRevision" not in final and final["canaryWeight"] == 0
        assert image_of(kube, "rush", "stable").endswith(":2")
        assert deployment(kube, "rush", "canary")["spec"]["replicas"] == 0
        assert "sits.ai/promote" not in annotations_of(kube, "rush")
        wait_for(lambda: {"PromotedFull", "Promoted"} <= set(reasons(kube, "rush")), what="the promotion Events")


def test_an_abort_when_healthy_is_removed_with_a_warning(kube, deployments, run_operator):
    with run_operator():
        kube.create(sitsdeployment("calm", rollout={"trafficRouting": GATEWAY}))
        before = wait_for_status(kube, "calm", lambda s: s.get("phase") == "Healthy", what="Healthy")
        time.sleep(0.5)
        before = status_of(kube, "calm")
        workloads = {track: deployment(kube, "calm", track)["metadata"]["resourceVersion"]
                     for track in ("stable", "canary")}
        annotate(kube, "calm", abort="true")
        warning = wait_for(lambda: [e for e in events(kube, "calm") if e["reason"] == "CommandIgnored"],
                           what="a Warning Event")
        assert warning[0]["type"] == "Warning" and "no canary is running" in warning[0]["message"]
        wait_for(lambda: "sits.ai/abort" not in annotations_of(kube, "calm"), what="the annotation removed")
        time.sleep(1)
        assert status_of(kube, "calm") == before
        assert {track: deployment(kube, "calm", track)["metadata"]["resourceVersion"]
                for track in ("stable", "canary")} == workloads
        assert len([e for e in events(kube, "calm") if e["reason"] == "CommandIgnored"]) == 1
