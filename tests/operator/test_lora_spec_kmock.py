"""spec.model.loraAdapters against an emulated API server: the operator runs (kopf) and builds the runtime pods.

KMock runs no pods; `deployments` marks Deployments ready as kube-controller-manager would. The test
reads the stable and canary Deployments' pod templates: the runtime's LoRA flags and the adapters'
volume mounts, a canary when an adapter changes, and an InvalidSpec condition for a bad block.
"""

from __future__ import annotations

from typing import Any

from sits.operator.kube import KubeClient
from sits.operator.meta import API_VERSION, KIND, RESUME_ANNOTATION
from tests.operator.helpers import (
    condition,
    deployment,
    events,
    sitsdeployment,
    status_of,
    wait_for,
    wait_for_status,
)

BASE = {"name": "tiny", "uri": "pvc://models/tiny"}
ADAPTERS = [{"name": "sql", "uri": "pvc://models/adapters/sql"}, {"name": "poet", "uri": "hf://org/poet-lora@v1"}]
STEPS = {"canary": {"steps": [{"setWeight": 50}, {"pause": {}}]}}  # the canary waits for sits.ai/resume


def container(kube: KubeClient, name: str, track: str) -> dict[str, Any]:
    return deployment(kube, name, track)["spec"]["template"]["spec"]["containers"][0]


def lora_flags(args: list[str]) -> list[str]:
    return args[args.index("--enable-lora"):args.index("--track")]


def mounts(kube: KubeClient, name: str, track: str) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in container(kube, name, track)["volumeMounts"]}


def test_adapters_reach_the_pods_and_an_adapter_change_is_a_canary(kube, deployments, run_operator):
    with run_operator():
        kube.create(sitsdeployment("lora", gpusPerReplica=0, model={**BASE, "loraAdapters": ADAPTERS},
                                   engine={"maxLoraRank": 32}, rollout=STEPS))
        first = wait_for_status(kube, "lora", lambda s: s.get("phase") == "Healthy", what="Healthy")
        stable = container(kube, "lora", "stable")
        assert lora_flags(stable["args"]) == ["--enable-lora", "--lora-modules", "sql=/mnt/lora/sql",
                                              "poet=hf://org/poet-lora@v1", "--max-loras", "2", "--max-lora-rank", "32"]
        assert mounts(kube, "lora", "stable")["/mnt/lora/sql"] == {
            "name": "model", "mountPath": "/mnt/lora/sql", "readOnly": True, "subPath": "adapters/sql"}
        assert {"name": "HF_HOME", "value": "/var/cache/huggingface"} in stable["env"]  # poet is downloaded there

        # A new adapter version is a new pod template: a canary, the stable track untouched
        moved = [{"name": "sql", "uri": "pvc://adapters/sql/v2"}, ADAPTERS[1]]
        kube.patch(API_VERSION, KIND, "llm", "lora", {"spec": {"model": {"loraAdapters": moved}}})
        status = wait_for_status(kube, "lora", lambda s: s.get("canaryRevision") and s.get("phase") == "Paused",
                                 what="a paused canary")
        assert status["stableRevision"] == first["stableRevision"] != status["canaryRevision"]
        assert deployment(kube, "lora", "canary")["spec"]["replicas"] == 1
        assert mounts(kube, "lora", "canary")["/mnt/lora/sql"] == {
            "name": "lora-0", "mountPath": "/mnt/lora/sql", "readOnly": True, "subPath": "sql/v2"}
        volumes = deployment(kube, "lora", "canary")["spec"]["template"]["spec"]["volumes"]
        assert {"name": "lora-0", "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}} in volumes
        assert container(kube, "lora", "stable")["args"] == stable["args"]
        assert mounts(kube, "lora", "stable")["/mnt/lora/sql"]["subPath"] == "adapters/sql"

        kube.patch(API_VERSION, KIND, "llm", "lora", {"metadata": {"annotations": {RESUME_ANNOTATION: "true"}}})
        wait_for_status(kube, "lora", lambda s: s.get("phase") == "Healthy"
                        and s.get("stableRevision") == status["canaryRevision"], what="the canary promoted")
        assert mounts(kube, "lora", "stable")["/mnt/lora/sql"]["subPath"] == "sql/v2"
        assert deployment(kube, "lora", "canary")["spec"]["replicas"] == 0


def test_an_invalid_lora_block_is_a_condition_and_changes_nothing(kube, deployments, run_operator):
    with run_operator():
        # Refused outright: nothing is created
        kube.create(sitsdeployment("wrong", model={**BASE, "loraAdapters": [{"name": "tiny", "uri": "hf://org/a"}]}))
        status = wait_for_status(kube, "wrong", lambda s: condition(s, "InvalidSpec"), what="InvalidSpec")
        assert condition(status, "InvalidSpec")["message"] == (
            "spec.model.loraAdapters[0].name: 'tiny' is the base model's name (spec.model.name); "
            "an adapter needs a model id of its own")
        assert status["phase"] == "Degraded" and deployment(kube, "wrong", "stable") is None
        wait_for(lambda: [e for e in events(kube, "wrong") if e["reason"] == "InvalidSpec"], what="an Event")

        # Broken later: the running pods keep their adapters until the spec is fixed
        kube.create(sitsdeployment("later", model={**BASE, "loraAdapters": ADAPTERS[:1]}))
        healthy = wait_for_status(kube, "later", lambda s: s.get("phase") == "Healthy", what="Healthy")
        before = deployment(kube, "later", "stable")["spec"]["template"]
        kube.patch(API_VERSION, KIND, "llm", "later", {"spec": {"engine": {"maxLoras": 0}}})
        status = wait_for_status(kube, "later", lambda s: condition(s, "InvalidSpec"), what="InvalidSpec")
        assert condition(status, "InvalidSpec")["message"].startswith("spec.engine.maxLoras: must be an integer >= 1")
        assert deployment(kube, "later", "stable")["spec"]["template"] == before
        assert status_of(kube, "later")["stableRevision"] == healthy["stableRevision"]
        assert "canaryRevision" not in status_of(kube, "later")
