"""The values of the server's request-cost bounds: plain dataclasses, read by the command line.

They live apart from the code that enforces them (`grammar_compiler`, `http_limits`), so that
`sits serve` builds its flags and logs its first line without importing the web framework or the
grammar compiler.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds of the grammar compile (flags of `sits serve`; see docs/security.md).

    Attributes:
        max_depth: nesting levels a constraint may have (JSON containers of a schema; brackets of
            a regex or grammar).
        max_bytes: UTF-8 bytes of a constraint's text (schema JSON, regex, grammar, choices).
        compile_timeout_s: seconds a compile may run in a worker before it is killed (a 400).
        workers: worker processes (and grammar threads) at most.
        per_tenant: compiles one tenant may run at once (the others wait their turn).
        queue_per_tenant: compiles of one tenant that may wait for their turn; one more is a 429.
    """

    max_depth: int = 64
    max_bytes: int = 128 * 1024
    compile_timeout_s: float = 10.0
    workers: int = 2
    per_tenant: int = 1
    queue_per_tenant: int = 8

    def validate(self) -> None:
        """Raises ValueError naming the bound that is out of range."""
        for name in ("max_depth", "max_bytes", "workers", "per_tenant"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.queue_per_tenant < 0:
            raise ValueError(f"queue_per_tenant must be >= 0, got {self.queue_per_tenant}")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s must be positive, got {self.compile_timeout_s}")


def default_max_connections() -> int:
    """Three quarters of the process's descriptor limit (the rest: model files, Redis, logs), at most 8192."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 8192
    return max(16, min(8192, soft * 3 // 4))


@dataclass(frozen=True)
class HttpLimits:
    """Read timeouts and the connection cap of the HTTP server.

    Attributes:
        header_timeout_s: seconds to send a request's complete headers.
        body_min_rate: bytes per second a body must arrive at, after `header_timeout_s` of grace.
        max_connections: open connections at most (default: from the descriptor limit).
    """

    header_timeout_s: float = 15.0
    body_min_rate: float = 1024.0
    max_connections: int = field(default_factory=default_max_connections)

    def validate(self) -> None:
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be positive, got {self.header_timeout_s}")
        if not self.body_min_rate > 0:
            raise ValueError(f"body_min_rate must be positive, got {self.body_min_rate}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")
