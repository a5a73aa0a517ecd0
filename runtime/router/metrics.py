"""The router's Prometheus metrics, in its own registry (labels never carry an API key: replica
URLs, tenant names, decisions and error kinds only)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 1.0)


class RouterMetrics:
    """sits_router_* series.

    requests_total{replica, policy_decision}: requests sent, by where and why (failover included).
    prefix_match_ratio{tenant}: matched fraction of the prompt's full blocks on the chosen replica.
    upstream_errors_total{replica, kind}: connect | disconnect (no answer) | status_503 | stream.
    replica_up{replica, track}, replica_in_flight{replica}: the pool.
    kv_index_blocks{replica}: block hashes the replica has published, as the router last read them.
    state_store_up: 1 while the router reads the replicas' KV state.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("sits_router_requests", "Requests the router sent to a replica.",
                                ("replica", "policy_decision"), registry=self.registry)
        self.prefix_match = Histogram("sits_router_prefix_match_ratio",
                                      "Fraction of a prompt's full KV blocks the chosen replica was believed "
                                      "to hold.", ("tenant",), buckets=RATIO_BUCKETS, registry=self.registry)
        self.upstream_errors = Counter("sits_router_upstream_errors", "Failed attempts to reach a replica.",
                                       ("replica", "kind"), registry=self.registry)
        self.replica_up = Gauge("sits_router_replica_up", "1 while the replica takes requests.", ("replica", "track"),
                                registry=self.registry)
        self.in_flight = Gauge("sits_router_replica_in_flight", "Requests the router has in flight on the replica.",
                               ("replica",), registry=self.registry)
        self.index_blocks = Gauge("sits_router_kv_index_blocks", "Prefix blocks the replica has published as cached.",
                                  ("replica",), registry=self.registry)
        self.store_up = Gauge("sits_router_state_store_up", "1 while the router reads the replicas' KV state.",
                              registry=self.registry)
