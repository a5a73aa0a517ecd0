"""SITS operator: reconciles SitsDeployment resources into GPU workloads with canary rollouts.

Package map (pure modules first; only kube.py, analysis.py's provider, tenancy_sync.py,
reconciler.py, webhook.py, health.py and handlers.py talk to anything):

- fields.py, spec.py, spec_rollout.py: the spec as validated dataclasses; errors name the field.
- meta.py (names, labels, owner references), plan.py (what runs), revisions.py (pod-template hash).
- workloads.py, networking.py, monitoring.py, builders.py: pure `build_*` of every owned object.
- status.py (the status document and its merge patch), observations.py, replicas.py,
  rollout.py: the state machine, `decide(spec, owner, status, observations, now)`.
- queries.py (the P95-delta PromQL), analysis.py (MetricProvider, PrometheusProvider, judgement).
- tenants.py (API keys -> SHA-256 records), tenancy_sync.py (the runtime's Redis tenant table).
- kube.py (REST client, server-side apply), reconciler.py (one reconcile, under a per-resource
  lock), webhook.py (Alertmanager receiver), handlers.py (kopf), config.py and __main__.py (CLI).
- stats.py (what the reconciles decided, as a snapshot), metrics.py (the Prometheus collector that
  reads it), health.py (the health server: /healthz and /metrics).
"""
