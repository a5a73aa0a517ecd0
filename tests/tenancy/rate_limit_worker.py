"""One replica's rate limiter in its own process, for the cross-process tests.

    python tests/tenancy/rate_limit_worker.py --url redis://127.0.0.1:P/0 --deployment D --tenant T \
        --rpm 30 --requests 40 --start-at UNIX --clock-base UNIX

Waits until --start-at, sends --requests admission checks (4 at a time) through a RateLimiter on a
RedisStateStore, and prints one JSON line: {"admitted": n, "refused": n, "shared": n}. Its clock is
`clock_base + (time.time() - start_at)`, so every worker of a test sits in the same rate window.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from sits.runtime.tenancy.limits import RateLimiter
from sits.runtime.tenancy.redis_store import RedisStateStore
from sits.runtime.tenancy.tenants import Tenant


async def run(args: argparse.Namespace) -> dict[str, int]:
    store = RedisStateStore(args.url, deployment=args.deployment, replica_id=args.replica, flush_interval_s=0.05)
    await store.start()
    limiter = RateLimiter(store, clock=lambda: args.clock_base + (time.time() - args.start_at))
    tenant = Tenant(args.tenant, requests_per_minute=args.rpm)
    await asyncio.sleep(max(0.0, args.start_at - time.time()))
    results = {"admitted": 0, "refused": 0}
    remaining = list(range(args.requests))

    async def client() -> None:
        while remaining:
            remaining.pop()
            decision = await limiter.check(tenant, 1)
            results["admitted" if decision.allowed else "refused"] += 1

    await asyncio.gather(*(client() for _ in range(4)))
    results["up"] = int(store.up)
    await store.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--deployment", required=True)
    parser.add_argument("--replica", required=True)
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--rpm", type=int, required=True)
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--start-at", type=float, required=True)
    parser.add_argument("--clock-base", type=float, required=True)
    print(json.dumps(asyncio.run(run(parser.parse_args()))), flush=True)


if __name__ == "__main__":
    main()
