"""Multi-tenancy: who may call (API keys), how much (rate limits), and how the KV cache is shared.

    tenants.py       the tenants file, key digests, per-tenant prefix-cache salts
    auth.py          API key / trusted-gateway header -> tenant (401 otherwise)
    request_ids.py   time-ordered UUIDv7 request ids and the time they carry
    shards.py        guaranteed KV-block shares and borrowing
    eviction.py      score-based, shard-aware eviction order
    kv_policy.py     both behind the engine's EvictionPolicy, over the block pool's owner map
    fair_queue.py    priority tiers + weighted fair share; waiting_queue.py: the engine's WaitingQueue
    rate_windows.py  sliding-window RPM/TPM arithmetic; limits.py: the RateLimiter (429 + Retry-After)
    state_store.py   the StateStore contract; memory_store.py, redis_store.py (+ redis_link.py,
                     redis_scripts.py) its two back ends
    tenant_sync.py   live tenant-table updates through the store
    metrics.py       tenant-labelled Prometheus metrics
    config.py, service.py, server_auth.py   the options, all of it wired together, the server hook
"""
