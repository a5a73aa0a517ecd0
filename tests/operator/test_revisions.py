"""Revisions: the hash of the pod template, stable across calls, blind to replicas, traffic and monitoring."""

from __future__ import annotations

from sits.operator.meta import Owner
from sits.operator.revisions import revision_of
from sits.operator.spec import parse_spec

OWNER = Owner("demo", "llm", "uid-1")
BASE = {"model": {"uri": "hf://org/tiny"}, "image": "sits:1", "replicas": 2}


def revision(**changes):
    return revision_of(OWNER, parse_spec({**BASE, **changes}, "demo").workload)


def test_same_spec_same_revision():
    assert revision() == revision()
    assert len(revision()) == 10 and int(revision(), 16) >= 0


def test_pod_template_changes_make_a_new_revision():
    base = revision()
    changed = [revision(image="sits:2"), revision(engine={"maxNumSeqs": 8}), revision(gpusPerReplica=2),
               revision(nccl={"env": {"NCCL_DEBUG": "INFO"}}), revision(model={"uri": "hf://org/other"}),
               revision(gpuProduct="NVIDIA-H200")]
    assert base not in changed
    assert len(set(changed)) == len(changed)


def test_replicas_traffic_and_monitoring_do_not():
    base = revision()
    assert revision(replicas=7) == base
    assert revision(monitoring={"serviceMonitor": True}) == base
    assert revision(rollout={"canary": {"steps": [{"setWeight": 50}]},
                             "trafficRouting": {"gatewayAPI": {"httpRoute": "r"}}}) == base


def test_recreating_the_resource_keeps_its_revision():
    spec = parse_spec(BASE, "demo").workload
    assert revision_of(Owner("demo", "llm", "a-new-uid"), spec) == revision_of(OWNER, spec)
