"""The model runner: owns the KV-cache tensors, runs the model on a step's batch, samples.

Decode-only steps replay a CUDA graph of their batch-size bucket once `setup_cuda_graphs` captured
them (`cuda_graphs.py`); steps with prompt tokens, up to a token count, replay the pieces of the
forward between attention calls, attention running eagerly (`setup_piecewise_graphs`,
`piecewise_graphs.py`); larger steps run eagerly. Sampling always runs eagerly.
The step's batch is built on the host and sent in one copy (`input_batch.py`); nothing in the
forward or the sampler syncs with the GPU: `launch` returns once the step is queued, and the
sampled ids reach the host through `PendingOutput.result()`, the step's one wait. A step that runs
prompt tokens of a request asking for prompt logprobs also scores those rows (`prompt_logprobs.py`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from sits.runtime.engine.cache_sizing import KVShape, MemoryProfile
from sits.runtime.engine.cuda_graphs import DecodeGraphs
from sits.runtime.engine.input_batch import InputBatch
from sits.runtime.engine.kv_cache_fp8 import FP8_KV_DTYPE, KVCacheScales, LayerKVCache
from sits.runtime.engine.model_input import ModelInput, build_model_input
from sits.runtime.engine.nvtx import nvtx_range
from sits.runtime.engine.pending_output import PendingOutput
from sits.runtime.engine.piecewise_graphs import PiecewiseGraphs
from sits.runtime.engine.request import SamplingParams
from sits.runtime.engine.sampler import Sampler
from sits.runtime.engine.scheduler_output import ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from sits.runtime.engine.sequence import Sequence
from sits.runtime.engine.spec_verify import verify_drafts

if TYPE_CHECKING:
    from sits.runtime.engine.host_tier import HostKVTier
    from sits.runtime.lora.layers import LoraStepState

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class ModelRunner:
    """Runs `model` over flat batches against a paged KV cache.

    Subclasses whose forward involves other processes (tensor parallelism) set
    `cuda_graphs_supported = False` until every rank captures and replays in step.

    Args:
        model: a decoder with `forward(input_ids, positions, kv_caches, metadata) -> [T, H]`,
            `compute_logits(hidden [N, H]) -> [N, V] float32` and a `config` (LlamaConfig).
        device, dtype: where the model lives and its dtype (the KV cache's too, unless
            `use_kv_cache_dtype` picks fp8 for it).
        block_size: tokens per KV block.
        sampler: picks tokens from the logits.
    """

    cuda_graphs_supported = True

    def __init__(
        self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, block_size: int, sampler: Sampler
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.sampler = sampler
        config = model.config
        self.kv_shape = KVShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype)
        self.kv_caches: KVCaches = []
        self.decode_graphs: DecodeGraphs | None = None
        self.piecewise_graphs: PiecewiseGraphs | None = None  # steps with prompt tokens, up to a size
        self.input_batch = InputBatch(block_size, self.device)
        self.lora: LoraStepState | None = None  # the adapters' per-step row index, with --enable-lora
        self.host_tier: HostKVTier | None = None  # --host-kv-cache-gb: its copies run before each forward
        self.kv_scales: KVCacheScales | None = None  # an fp8 cache's per-layer, per-head scales

    def use_kv_cache_dtype(self, dtype: torch.dtype) -> None:
        """Store K/V as `dtype` (the model's, or float8_e4m3fn with per-layer, per-head scales, 1.0 until
        calibrated); call before sizing and allocating the cache."""
        self.kv_shape = dataclasses.replace(self.kv_shape, dtype=dtype)
        self.kv_scales = None
        if dtype == FP8_KV_DTYPE:
            self.kv_scales = KVCacheScales(self.kv_shape.num_layers, self.kv_shape.num_kv_heads, self.device)

    def enable_lora(self, step: LoraStepState) -> None:
        """Serve LoRA adapters: each step's batch carries its sequences' adapter slots, and `step`
        gets them before the forward (the hooked layers read it; `sits.runtime.lora`)."""
        self.lora = step
        self.input_batch.lora_enabled = True

    @property
    def num_blocks(self) -> int:
        return int(self.kv_caches[0][0].shape[0]) if self.kv_caches else 0

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate one (k_cache, v_cache) pair per layer: [num_blocks, block_size, kv_heads, head_dim]."""
        self.kv_caches = self.new_caches(num_blocks)
        logger.debug(  # `sits serve` / `sits generate` log the cache once, with the scheduler's limits
            "KV cache: %d blocks × %d tokens (%.2f GiB, %s)",
            num_blocks, self.block_size, num_blocks * self.kv_shape.bytes_per_block(self.block_size) / (1 << 30),
            str(self.kv_shape.dtype).removeprefix("torch."),
        )

    def new_caches(self, num_blocks: int, dtype: torch.dtype | None = None) -> KVCaches:
        """One zeroed `LayerKVCache` per layer, [num_blocks, block_size, kv_heads, head_dim] each, in the
        cache's dtype (or `dtype`: a scratch cache in the model's dtype has no scales)."""
        dtype = dtype or self.kv_shape.dtype
        shape = (num_blocks, self.block_size, self.kv_shape.num_kv_heads, self.kv_shape.head_dim)
        scales = self.kv_scales if dtype == FP8_KV_DTYPE else None
        return [
            LayerKVCache(torch.zeros(shape, dtype=dtype, device=self.device),
                         torch.zeros(shape, dtype=dtype, device=self.device),
                         *(scales.layer(layer) if scales is not None else (None, None)))
            for layer in range(self.kv_shape.num_layers)
        ]

    def setup_cuda_graphs(self, batch_sizes: list[int], max_model_len: int, capture: bool = True) -> None:
        """Capture the decode forward for these batch sizes (after allocate_kv_cache).

        capture=False keeps the static padded buffers but runs them eagerly (CPU tests of the padding).
        """
        if not self.kv_caches:
            raise RuntimeError("allocate the KV cache before capturing CUDA graphs")
        bounds_for = self._decode_graph_bounds if hasattr(self.model, "backend") else None
        graphs = DecodeGraphs(self.model, self.kv_caches, batch_sizes, max_model_len, self.block_size, capture,
                              bounds_for)
        graphs.capture()
        self.decode_graphs = graphs

    def _decode_graph_bounds(self, size: int, width: int) -> list[int]:
        """The context bounds of the decode graphs of `size` rows: the attention back end's choice."""
        return self.model.backend.decode_graph_bounds(size, width, self.kv_shape.num_kv_heads, self.device)

    def setup_piecewise_graphs(self, token_sizes: list[int], capture: bool = True) -> None:
        """Capture the forward's pieces between attention calls for steps of up to max(token_sizes) tokens
        (after allocate_kv_cache; `piecewise_graphs.py`). capture=False runs the static buffers and the
        attention holes eagerly (CPU tests)."""
        if not self.kv_caches:
            raise RuntimeError("allocate the KV cache before capturing CUDA graphs")
        graphs = PiecewiseGraphs(self.model, self.model.backend, self.kv_caches, token_sizes, capture)
        graphs.capture()
        self.piecewise_graphs = graphs

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step to the end: build the batch, run the model, sample, bring the tokens back."""
        return self.launch(scheduler_output).result()

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """Queue one step on the device and return without waiting for it (async scheduling).

        Builds the batch (a pending token of the previous step comes from that step's sampled ids
        on the device), runs the model and samples the sequences that reached their end; the
        sampled ids start their copy to the host, which `PendingOutput.result()` waits for.
        """
        self.input_batch.release(scheduler_output.finished)  # their rows; the rest went with them
        self.input_batch.release(scheduler_output.preempted)
        if self.host_tier is not None:  # this step's evictions out, its host hits in, before the forward
            self.host_tier.run_transfers(self.kv_caches)
        if scheduler_output.is_empty:
            return PendingOutput.nothing()
        model_input = self.prepare_input(scheduler_output)
        with nvtx_range("decode" if model_input.is_decode_only else "prefill"):
            hidden = self._forward(model_input)
        prompt_logprobs = None
        if model_input.prompt_logprobs is not None:
            with nvtx_range("prompt_logprobs"):
                prompt_logprobs = model_input.prompt_logprobs.compute(hidden, self.model.compute_logits,
                                                                      self.model.config.vocab_size)
        if not model_input.sample_sequences:
            return PendingOutput([], None, prompt_logprobs)
        with nvtx_range("sample"):
            last = hidden
            if len(model_input.sample_sequences) < model_input.num_tokens:  # else every row samples, in order
                last = hidden.index_select(0, model_input.logits_indices)
            logits = self.model.compute_logits(last)
            if model_input.grammar_mask is not None:  # structured outputs: disallowed tokens to -inf
                model_input.grammar_mask.apply(logits)
            sampled = self.sampler.sample(logits, model_input.sample_sequences, model_input.logit_bias,
                                          model_input.token_mask)
        accepted = None
        if model_input.spec_rows:  # speculative drafts: keep those the target agrees with (waits for them)
            with nvtx_range("verify"):
                accepted = verify_drafts(hidden, model_input.spec_rows, model_input.sample_sequences,
                                         self.model.compute_logits, self.sampler, sampled.token_ids)
        self.input_batch.record_sampled(sampled.token_ids)
        pending = PendingOutput([seq.seq_id for seq in model_input.sample_sequences], sampled, prompt_logprobs)
        if accepted is not None:
            pending.result().accepted_drafts.update(accepted)
        return pending

    def prepare_input(self, scheduler_output: SchedulerOutput) -> ModelInput:
        """The step's flat batch on the device (block tables kept across steps in `input_batch`)."""
        return self.input_batch.prepare(scheduler_output.scheduled)

    def _forward(self, model_input: ModelInput) -> torch.Tensor:
        """[num_tokens, hidden] hidden states of the batch: a graph replay for decode-only batches, the
        piecewise graphs for other steps up to their largest bucket, else the eager forward."""
        if self.lora is not None:  # no decode graphs with LoRA: every step runs eagerly
            self.lora.begin_step(model_input.lora_slots, model_input.metadata.query_lens_list)
        if self.decode_graphs is not None and self.decode_graphs.can_run(model_input):
            return self.decode_graphs.run(model_input)
        if self.piecewise_graphs is not None and self.piecewise_graphs.can_run(model_input):
            return self.piecewise_graphs.run(model_input)
        return self.model(model_input.input_ids, model_input.positions, self.kv_caches, model_input.metadata)

    @torch.inference_mode()
    def profile_memory(self, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> MemoryProfile:
        """CUDA memory after a forward of the largest batch the scheduler can build.

        The batch is max_num_batched_tokens prompt tokens (split into sequences of at most
        max_model_len), and the sampler runs over min(max_num_seqs, tokens) rows with top-p on,
        so the activation peak covers the worst step.
        """
        if self.device.type != "cuda":
            raise ValueError("memory profiling needs a CUDA device")
        lengths = []
        remaining = max_num_batched_tokens
        while remaining > 0:
            lengths.append(min(remaining, max_model_len))
            remaining -= lengths[-1]
        scheduled, next_block = [], 0
        for index, length in enumerate(lengths):
            blocks = list(range(next_block, next_block + -(-length // self.block_size)))
            next_block += len(blocks)
            seq = Sequence(f"profile-{index}", "profile", 0, [0] * length,
                           SamplingParams(temperature=1.0, top_p=0.9), 1, 0.0)
            scheduled.append(ScheduledSequence(seq, [0] * length, 0, blocks, samples=True))
        caches = self.new_caches(next_block)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        model_input = build_model_input(scheduled, self.block_size, self.device)
        hidden = self.model(model_input.input_ids, model_input.positions, caches, model_input.metadata)
        rows = min(max_num_seqs, hidden.shape[0])
        logits = self.model.compute_logits(hidden[-rows:])
        probe = Sampler((), self.device)
        probe(logits, [scheduled[0].sequence] * rows)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - baseline
        del caches, hidden, logits, model_input
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return MemoryProfile(total=total, free=free, activation_peak=peak)
