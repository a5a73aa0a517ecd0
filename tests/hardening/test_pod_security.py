"""The runtime pods the operator builds run locked down, as the chart's operator pod does.

For every example SitsDeployment (a GPU model from a PVC, an hf:// model, the CPU minimal one): a
non-root user, a read-only root filesystem, no privilege escalation, no capabilities, the default
seccomp profile, and emptyDirs for every place the runtime writes (HOME caches, /tmp, /dev/shm,
the hf:// download). The chart's own operator pod and RBAC are checked in tests/packaging
(`test_the_operator_pod_is_locked_down`, `test_no_rule_uses_a_wildcard`).
"""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from sits.operator.meta import Owner
from sits.operator.spec import parse_spec
from sits.operator.workloads import build_pod_template

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ["sitsdeployment.yaml", "sitsdeployment-full.yaml", "sitsdeployment-minimal.yaml"]


@pytest.mark.parametrize("example", EXAMPLES)
def test_runtime_pods_are_non_root_with_a_read_only_root_filesystem(example):
    body = yaml.safe_load((ROOT / "examples" / example).read_text())
    owner = Owner(name=body["metadata"]["name"], namespace="llm", uid="uid")
    template = build_pod_template(owner, parse_spec(body["spec"], owner.name).workload, "stable", "rev")
    pod = template["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    env = {e["name"]: e["value"] for e in container["env"]}
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert {"/tmp", "/dev/shm", env["HOME"]} <= writable  # caches (GGUF, Triton, torch.compile) and scratch
    if "HF_HOME" in env:
        assert env["HF_HOME"] in writable
    empty_dirs = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    assert {m["name"] for m in container["volumeMounts"] if m["mountPath"] in writable} <= empty_dirs
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x", "namespace": "llm"},
                  "spec": {"selector": {"matchLabels": template["metadata"]["labels"]}, "template": template}}
    kubernetes_validate.validate(deployment, "1.30.0", strict=True)
