"""How many GPUs one replica spans, and the NCCL settings they talk with.

Kept free of torch so the CLI can build and validate it before anything heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The project's NCCL defaults. NVLink SHARP multicast (NVLS) is opt-in: multicast objects are a
# host-wide resource shared by every GPU job on the node, and a fault in them can take the node's
# GPUs out of service; the gain for 2-8 GPU all-reduces of decode-sized tensors is small.
DEFAULT_NCCL_SOCKET_NTHREADS = 8
DEFAULT_NCCL_MIN_NCHANNELS = 4


@dataclass
class ParallelConfig:
    """Tensor-parallel layout of one replica.

    Attributes:
        tensor_parallel_size: ranks the model is sharded over (the operator's gpusPerReplica).
        distributed_port: TCP port on 127.0.0.1 for the rendezvous of spawned workers; None picks a
            free one. Ignored under torchrun, which passes MASTER_ADDR / MASTER_PORT.
        nccl_socket_nthreads, nccl_min_nchannels, nccl_nvls_enable: NCCL_SOCKET_NTHREADS,
            NCCL_MIN_NCHANNELS and NCCL_NVLS_ENABLE. A variable already set in the environment wins.
        nccl_env: further NCCL_* variables (the SitsDeployment's `nccl.env`); the environment wins too.
        startup_timeout_s: how long the engine waits for its workers to load the model, in seconds.
    """

    tensor_parallel_size: int = 1
    distributed_port: int | None = None
    nccl_socket_nthreads: int = DEFAULT_NCCL_SOCKET_NTHREADS
    nccl_min_nchannels: int = DEFAULT_NCCL_MIN_NCHANNELS
    nccl_nvls_enable: bool = False
    nccl_env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 1800.0

    @property
    def enabled(self) -> bool:
        return self.tensor_parallel_size > 1

    def nccl_settings(self) -> dict[str, str]:
        """The NCCL environment this config asks for (before the process environment overrides it)."""
        settings = {
            "NCCL_SOCKET_NTHREADS": str(self.nccl_socket_nthreads),
            "NCCL_MIN_NCHANNELS": str(self.nccl_min_nchannels),
            "NCCL_NVLS_ENABLE": "1" if self.nccl_nvls_enable else "0",
        }
        settings.update({key: str(value) for key, value in self.nccl_env.items()})
        return settings

    def validate(self) -> None:
        from sits.runtime.config import ConfigError  # imported here: config.py may import this module

        if self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor-parallel-size must be positive, got {self.tensor_parallel_size}")
        if self.distributed_port is not None and not 0 < self.distributed_port <= 65535:
            raise ConfigError(f"--distributed-port must be between 1 and 65535, got {self.distributed_port}")
        if self.nccl_socket_nthreads < 1 or self.nccl_min_nchannels < 1:
            raise ConfigError("NCCL socket threads and minimum channels must be positive")
        bad = [key for key in self.nccl_env if not key.startswith("NCCL_")]
        if bad:
            raise ConfigError(f"nccl env may only set NCCL_* variables, got {', '.join(sorted(bad))}")
        if self.startup_timeout_s <= 0:
            raise ConfigError(f"the worker startup timeout must be positive, got {self.startup_timeout_s}")
