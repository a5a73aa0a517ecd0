"""A revision is the hash of the pod template: the same spec always gives the same revision.

The hash covers the track-neutral template (no `track` label, no `--track` flag), so the stable
and canary Deployments of one revision agree; replicas, traffic and monitoring are not in it, so
changing them never starts a canary.
"""

from __future__ import annotations

import hashlib
import json

from sits.operator.meta import Owner
from sits.operator.spec import WorkloadSpec
from sits.operator.workloads import build_pod_template

REVISION_LENGTH = 10  # hex digits, as short as a Deployment's pod-template-hash and as unlikely to clash


def revision_of(owner: Owner, workload: WorkloadSpec) -> str:
    """The revision (10 hex digits) of the workload's pod template."""
    template = build_pod_template(owner, workload, track=None)
    canonical = json.dumps(template, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:REVISION_LENGTH]
