"""Tenancy options of `sits serve`, validated: each error names the flag as the CLI spells it."""

from __future__ import annotations

from dataclasses import dataclass

from sits.runtime.config import ConfigError
from sits.runtime.tenancy.eviction import DEFAULT_ALPHA
from sits.runtime.tenancy.state_store import DEPLOYMENT_NAME


@dataclass
class TenancyConfig:
    """How the server names, limits and isolates tenants.

    Attributes:
        tenants_file: --tenants; None serves everyone as the `default` tenant without keys.
        state_store: --state-store, `memory://` or `redis://host:port/db`.
        deployment: --deployment, the key namespace in the state store (`sits:{deployment}:...`).
        trusted_gateway_header: --trusted-gateway-header; when set, the tenant is taken from this
            header instead of an API key (only behind a gateway that authenticates and sets it).
        eviction_alpha: --eviction-alpha, weight of priority in the eviction score.
        eviction_ttl_s: --eviction-ttl, seconds a cached block may stay unused before it goes
            first; 0 disables the TTL.
        tenant_poll_interval_s: how often the stored tenant table is checked for updates.
        state_flush_interval_s: how often batched state-store writes are sent.
    """

    tenants_file: str | None = None
    state_store: str = "memory://"
    deployment: str = "default"
    trusted_gateway_header: str | None = None
    eviction_alpha: float = DEFAULT_ALPHA
    eviction_ttl_s: float = 3600.0
    tenant_poll_interval_s: float = 2.0
    state_flush_interval_s: float = 0.5

    def validate(self) -> None:
        if not DEPLOYMENT_NAME.match(self.deployment):
            raise ConfigError(f"--deployment must be letters, digits, '.', '_' or '-', got {self.deployment!r}")
        if self.trusted_gateway_header is not None and not self.trusted_gateway_header.strip():
            raise ConfigError("--trusted-gateway-header must name a header")
        if self.trusted_gateway_header is not None and self.tenants_file is None:
            raise ConfigError("--trusted-gateway-header needs --tenants (the tenants the gateway may name)")
        if not 0.0 <= self.eviction_alpha <= 100.0:
            raise ConfigError(f"--eviction-alpha must be between 0 and 100, got {self.eviction_alpha}")
        if self.eviction_ttl_s < 0:
            raise ConfigError(f"--eviction-ttl must be >= 0 seconds (0: off), got {self.eviction_ttl_s}")
        if self.tenant_poll_interval_s <= 0 or self.state_flush_interval_s <= 0:
            raise ConfigError("tenant poll and state flush intervals must be positive")
