"""Model runners of a tensor-parallel replica.

`TensorParallelModelRunner` is the engine's runner on rank 0: before its own shard runs a step it
sends the step's batch to the workers, so every rank enters the same collectives in the same order;
it samples alone. `ShardModelRunner` is a worker's runner: the same batch, its own shard and KV
cache, no sampling. Both size their KV cache by the K/V heads their shard holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sits.runtime.engine.cache_sizing import KVShape, MemoryProfile
from sits.runtime.engine.model_input import ModelInput
from sits.runtime.engine.runner import ModelRunner
from sits.runtime.engine.sampler import Sampler
from sits.runtime.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from sits.runtime.parallel.commands import AllocateKVCache, ProfileMemory, WorkerFailedError
from sits.runtime.parallel.tp import local_kv_heads

if TYPE_CHECKING:
    from sits.runtime.parallel.executor import TensorParallelExecutor


def local_kv_shape(model: torch.nn.Module, dtype: torch.dtype) -> KVShape:
    """This rank's cache geometry: the checkpoint's layers and head size, its own K/V heads."""
    config = model.config
    return KVShape(config.num_hidden_layers, local_kv_heads(model), config.head_dim, dtype)


class ShardModelRunner(ModelRunner):
    """A worker's runner: runs each broadcast batch through its shard; rank 0 samples."""

    cuda_graphs_supported = False  # until every rank captures and replays its graphs in step

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, block_size: int) -> None:
        super().__init__(model, device, dtype, block_size, Sampler((), device))
        self.kv_shape = local_kv_shape(model, dtype)

    @torch.inference_mode()
    def run_step(self, model_input: ModelInput) -> None:
        """The forward and, when rank 0 samples, the LM head (whose all-gather rank 0 waits on)."""
        hidden = self._forward(model_input)
        if model_input.logits_indices.numel():
            self.model.compute_logits(hidden[model_input.logits_indices])


class TensorParallelModelRunner(ModelRunner):
    """The engine's runner on rank 0 of a tensor-parallel replica.

    Args:
        model, device, dtype, block_size, sampler: as for ModelRunner; `model` is rank 0's shard.
        executor: the replica's workers and channels.
    """

    cuda_graphs_supported = False  # until every rank captures and replays its graphs in step

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        sampler: Sampler,
        executor: TensorParallelExecutor,
    ) -> None:
        super().__init__(model, device, dtype, block_size, sampler)
        self.executor = executor
        self.kv_shape = local_kv_shape(model, dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Every rank allocates num_blocks blocks of its own K/V heads (the block ids are shared)."""
        self.executor.call(AllocateKVCache(num_blocks, str(self.kv_shape.dtype).removeprefix("torch.")))
        super().allocate_kv_cache(num_blocks)

    def profile_memory(self, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> MemoryProfile:
        """The tightest profile over all ranks, so the block count fits on every GPU."""
        self.executor.send(ProfileMemory(max_num_batched_tokens, max_num_seqs, max_model_len))
        profiles = [super().profile_memory(max_num_batched_tokens, max_num_seqs, max_model_len)]
        profiles += self.executor.replies()
        return MemoryProfile(
            total=min(p.total for p in profiles),
            free=min(p.free for p in profiles),
            activation_peak=max(p.activation_peak for p in profiles),
        )

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """ModelRunner.execute across the replica.

        Raises:
            WorkerFailedError: a worker died or failed (before or during this step).
        """
        self.executor.check_healthy()
        try:
            return super().execute(scheduler_output)
        except WorkerFailedError:
            raise
        except Exception as exc:  # a collective broken by a dead peer surfaces as the worker's failure
            failure = self.executor.worker_failure(wait_s=2.0)
            if failure is None:
                raise
            raise failure from exc

    def _forward(self, model_input: ModelInput) -> torch.Tensor:
        self.executor.broadcast_step(model_input)
        return super()._forward(model_input)

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        self.executor.shutdown()
