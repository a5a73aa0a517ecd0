"""The router's options: where the replicas are, how to hash prompts like them, how to pick one."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from sits.runtime.config import CacheConfig, ConfigError


class Policy(enum.StrEnum):
    """How a replica is picked for a request."""

    PRECISE = "precise"  # replicas' published KV state (cached prefix blocks) weighed against load
    APPROXIMATE = "approximate"  # the router's own routing history as the prefix index, against load
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True)
class ScoringWeights:
    """`score(replica) = prefix × matched − running × in_flight − waiting × waiting − kv × kv_usage`.

    Attributes:
        prefix: weight of the matched fraction of the prompt's full blocks (0..1).
        running: cost per request the router has in flight on the replica.
        waiting: cost per request queued on the replica (its published figure).
        kv: cost of the replica's KV use by running requests (0..1).
        imbalance: the load guard, in requests: when the best-scored replica has this many more in
            flight than the least loaded one, the least loaded one gets the request.
    """

    prefix: float = 1.0
    running: float = 0.08
    waiting: float = 0.15
    kv: float = 0.3
    imbalance: int = 6

    @classmethod
    def parse(cls, text: str) -> ScoringWeights:
        """`prefix=1,running=0.1,...` (any subset); raises ConfigError."""
        values: dict[str, float | int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, raw = item.partition("=")
            name = name.strip()
            if not sep or name not in cls.__dataclass_fields__:
                raise ConfigError(f"--weights takes name=value pairs of {', '.join(cls.__dataclass_fields__)}, "
                                  f"got {item!r}")
            try:
                values[name] = int(raw) if name == "imbalance" else float(raw)
            except ValueError:
                raise ConfigError(f"--weights {name} must be a number, got {raw!r}") from None
            if values[name] < 0:
                raise ConfigError(f"--weights {name} must be >= 0, got {raw}")
        return cls(**values)  # type: ignore[arg-type]


@dataclass
class RouterConfig:
    """Everything `sits router` is started with.

    Attributes:
        replicas: base URLs of the replicas (http://host:port).
        state_store: where replicas publish their KV state and the tenant table (`redis://...`);
            `memory://` routes by load and the router's own history only.
        deployment: the replicas' --deployment (the key namespace in the store).
        tenants_file: the replicas' --tenants (None: open access, as replicas without it).
        policy: see Policy.
        weights: the precise / approximate score.
        model, chat_template: the replicas' --model and --chat-template (None: the embedded model),
            so prompts are tokenized exactly as the replicas do.
        served_model_name: the replicas' base model id; other model ids are LoRA adapters, whose
            name goes into the prefix hash as it does on the replicas.
        block_size: the replicas' --block-size, in tokens.
        health_interval_s: how often each replica's /health is probed (a dead replica leaves the
            pool after one failed probe or one refused connection).
        kv_poll_interval_s: how often the replicas' KV state is read from the store.
        history_blocks: bound of the routing history (block hashes remembered, all replicas).
        recent_s: in `precise`, the router's own choices of the last seconds count as cached (the
            replica publishes its blocks only once a request has finished with them).
        canary_weight: percent of requests for canary-track replicas while one is up (`canary.py`).
        canary_tenants: tenants whose requests all go to the canary while one is up.
        discover: NAMESPACE/SERVICE of Services whose ready endpoints are the replicas (in addition
            to `replicas`); kube_api: the Kubernetes API for it (None: in-cluster).
        replica_metrics_port: the replicas' `sits serve --metrics-port`, where their /metrics (their
            state-store name and track) is read; None: on their API port.
    """

    replicas: list[str]
    state_store: str = "memory://"
    deployment: str = "default"
    tenants_file: str | None = None
    policy: Policy = Policy.PRECISE
    weights: ScoringWeights = field(default_factory=ScoringWeights)
    model: str | None = None
    chat_template: str | None = None
    served_model_name: str | None = None
    block_size: int = CacheConfig.block_size
    host: str = "127.0.0.1"
    port: int = 8080
    health_interval_s: float = 1.0
    kv_poll_interval_s: float = 0.5
    history_blocks: int = 200_000
    recent_s: float = 30.0
    canary_weight: int = 0
    canary_tenants: tuple[str, ...] = ()
    discover: tuple[str, ...] = ()
    kube_api: str | None = None
    replica_metrics_port: int | None = None

    def validate(self) -> None:
        if not self.replicas and not self.discover:
            raise ConfigError("give at least one --replica URL or --discover NAMESPACE/SERVICE")
        for url in self.replicas:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError(f"--replica must be an http(s)://host:port URL, got {url!r}")
        if len(set(self.replicas)) != len(self.replicas):
            raise ConfigError("--replica URLs must be distinct")
        if self.block_size < 1:
            raise ConfigError(f"--block-size must be >= 1, got {self.block_size}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be 0..65535, got {self.port}")
        if self.replica_metrics_port is not None and not 1 <= self.replica_metrics_port <= 65535:
            raise ConfigError(f"--replica-metrics-port must be 1..65535, got {self.replica_metrics_port}")
        if self.discover and self.kube_api is None and "KUBERNETES_SERVICE_HOST" not in os.environ:
            raise ConfigError("--discover outside a pod needs --kube-api URL")
        if not 0 <= self.canary_weight <= 100:
            raise ConfigError(f"--canary-weight must be 0..100 percent, got {self.canary_weight}")
        if self.health_interval_s <= 0 or self.kv_poll_interval_s <= 0:
            raise ConfigError("health and KV poll intervals must be positive")
