"""Two replica processes sharing one real Redis enforce one tenant's RPM across both."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("rate_limit_worker.py")


def test_two_processes_share_one_tenants_requests_per_minute(redis_service):
    deployment = f"replicas-{uuid.uuid4().hex[:8]}"
    rpm, per_process = 30, 40
    start_at = time.time() + 2.0  # both processes import and connect first
    clock_base = math.floor(time.time() / 60) * 60 + 5.0  # 5 s into a window: the burst stays in it
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "--url", f"redis://127.0.0.1:{redis_service.port}/0",
             "--deployment", deployment, "--replica", f"replica-{i}", "--tenant", "finance", "--rpm", str(rpm),
             "--requests", str(per_process), "--start-at", str(start_at), "--clock-base", str(clock_base)],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    results = []
    for worker in workers:
        out, err = worker.communicate(timeout=60)
        assert worker.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["up"] == 1 for r in results)
    assert sum(r["admitted"] for r in results) == rpm  # exactly the limit, not 2 x 30
    assert sum(r["refused"] for r in results) == 2 * per_process - rpm
    assert all(r["admitted"] > 0 for r in results)  # both replicas served part of it
    # The window in Redis holds each replica's own count, and they add up to the limit.
    client = redis.Redis(port=redis_service.port, decode_responses=True)
    window = client.hgetall(f"sits:{deployment}:rl:finance:{math.floor(clock_base / 60)}")
    assert sum(int(v) for f, v in window.items() if f.startswith("r:")) == rpm
    assert {f.split(":", 1)[1] for f in window} == {"replica-0", "replica-1"}
