"""`sits router`: a tenant-aware, KV-cache-aware OpenAI-compatible proxy in front of replicas.

Imports no torch (it runs in the operator's slim image).

    config.py      RouterConfig, ScoringWeights: the flags, validated
    prompt.py      PromptHasher: a request body -> the tenant-salted prefix block hashes, rendered and
                   tokenized exactly as the replicas do (their tokenizer, chat template, hash code)
    index.py       KVIndex (replicas' published KV state) and RoutingHistory (the router's own choices)
    kv_events.py   KVStateReader: reads the replicas' KV state from the state store
    replicas.py    ReplicaPool: health, in-flight counts, identity (replica id from /metrics)
    policy.py      the four policies and the precise score with its load guard
    canary.py      CanarySplit: the canary weight and canary tenants, per replica track
    proxy.py       forwarding with failover before the first byte, streaming passthrough
    metrics.py     RouterMetrics (Prometheus)
    app.py         the Starlette app: auth (401 before routing), routes
    command.py     `sits router` / `python -m sits.runtime.router`
"""
