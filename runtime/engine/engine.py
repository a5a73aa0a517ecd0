"""The synchronous engine: requests in, one `step()` at a time, `RequestOutput`s out.

    step = schedule → run the model and sample → update sequences → detokenize → outputs

With async scheduling (`EngineConfig.async_scheduling`, on by default for one CUDA device) a step
schedules and launches step N+1 on the device first, then processes step N's sampled tokens while
the device computes: N+1's decode inputs come from N's sampled ids on the device, so the GPU never
idles on the host's scheduling, batch building, detokenization or output snapshots. A stop found
in N's tokens (EOS, stop token or string) then costs one token of compute in N+1, never an output
token; while a request with penalties, bad_words or a response_format runs, steps are processed
before the next is scheduled (a penalty needs every output token on the host; a grammar matcher or
a bad word needs the previous token before it can build the next step's mask: `structured_output.py`,
`token_masks.py`).

`LLMEngine` is single-threaded: call every method from one thread (`AsyncEngine` runs it on its
own background thread and funnels requests to it).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from sits.runtime.config import ConfigError, EngineConfig
from sits.runtime.engine.bad_words import resolve_bad_words
from sits.runtime.engine.cache_sizing import check_fits_one_sequence, num_blocks_for_budget
from sits.runtime.engine.engine_setup import (
    checkpoint_head_dim,
    prepare_execution,
    quantize,
    use_activation_dtype,
)
from sits.runtime.engine.errors import DuplicateRequestError, InvalidRequestError, PromptTooLongError
from sits.runtime.engine.eviction import EvictionPolicy
from sits.runtime.engine.host_tier import build_host_tier
from sits.runtime.engine.kv_cache import KVCacheManager
from sits.runtime.engine.kv_cache_fp8 import configure_kv_cache_dtype, prepare_kv_cache_scales
from sits.runtime.engine.nvtx import nvtx_range
from sits.runtime.engine.output_processor import OutputProcessor
from sits.runtime.engine.pending_output import PendingOutput
from sits.runtime.engine.request import (
    FinishReason,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    SamplingParamsError,
)
from sits.runtime.engine.runner import ModelRunner
from sits.runtime.engine.sampler import Sampler
from sits.runtime.engine.scheduler import Scheduler
from sits.runtime.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from sits.runtime.engine.scheduling_policy import SchedulingPolicy, WaitingQueue
from sits.runtime.engine.sequence import RequestState, Sequence, SequenceStatus, child_sequence_id
from sits.runtime.engine.stats import EngineStats
from sits.runtime.engine.structured_output import StructuredOutputs
from sits.runtime.engine.validated import ValidatedSamplingParams
from sits.runtime.lora.manager import lora_binding, setup_lora

if TYPE_CHECKING:  # the models package is imported only when a model is loaded
    from sits.runtime.models.loading import LoadedModel

class LLMEngine:
    """Continuous-batching generation over one loaded model.

    Args:
        loaded: the model, tokenizer and shape (`sits.runtime.models.loading.LoadedModel`).
        config: cache, scheduler and model limits.
        eviction_policy: which cached KV block to give up first (LRU by default), or a factory
            called with the number of blocks once the cache is sized (the tenancy layer's
            shard-aware score policy needs it).
        scheduling_policy: preemption order and the default admission order (FCFS by default).
        waiting_queue: replaces the admission order (the tenancy layer's fair queue).
        shared_cache_salt: the prefix-cache salt of prompts marked for the shared-prefix pool
            (hits under it on another tenant's blocks are counted as shared, not cross-tenant).
        step_observer: called with each step's batch once scheduled (a step that runs the model), before it
            runs; reads it, never changes it (`sits.runtime.engine.step_trace`).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        *,
        eviction_policy: EvictionPolicy | Callable[[int], EvictionPolicy] | None = None,
        scheduling_policy: SchedulingPolicy | None = None,
        waiting_queue: WaitingQueue | None = None,
        runner_factory: Callable[..., ModelRunner] = ModelRunner,
        shared_cache_salt: str | None = None,
        host_eviction_policy: EvictionPolicy | Callable[[int], EvictionPolicy] | None = None,
        step_observer: Callable[[SchedulerOutput], None] | None = None,
    ) -> None:
        config.validate()
        self._step_observer = step_observer  # sees each scheduled step's batch (step_trace.py); never changes it
        self.config = config
        self.loaded_model = loaded
        self.tokenizer = loaded.tokenizer
        self.model_name: str = config.model.served_model_name or loaded.name
        self.max_model_len: int = config.model.max_model_len or loaded.config.max_position_embeddings
        positions = getattr(loaded.model, "max_positions", self.max_model_len)
        if self.max_model_len > positions:
            raise ConfigError(
                f"--max-model-len {self.max_model_len} exceeds the {positions} positions the model was "
                "loaded for; load it with this --max-model-len"
            )
        self.vocab_size: int = loaded.config.vocab_size
        self.eos_token_ids = frozenset(loaded.config.eos_token_ids) | frozenset(
            getattr(self.tokenizer, "eos_token_ids", ())
        )
        quantize(loaded, config.model.quantization, config.model.fp8_mode)
        use_activation_dtype(loaded, config.model.activation_dtype)
        sampler = Sampler(self.eos_token_ids, loaded.device, seed=config.model.seed)
        self.runner = runner_factory(loaded.model, loaded.device, loaded.dtype, config.cache.block_size, sampler)
        self.lora = setup_lora(self.runner, loaded.model, loaded.config, config.lora, self.model_name)
        self.kv_cache = self._build_kv_cache(eviction_policy, host_eviction_policy, shared_cache_salt)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len, self.eos_token_ids,
                                   scheduling_policy, waiting_queue, speculative=config.speculative)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.structured_outputs = StructuredOutputs(self.tokenizer, self.vocab_size)
        # The one index of the requests in the engine; each owns its sequences and their state.
        self._requests: dict[str, RequestState] = {}
        self._num_unscheduled = 0  # requests never scheduled yet (first_scheduled_time is stamped)
        # with penalties, bad_words or a response_format: sampling needs all their tokens (no step ahead)
        self._num_history = 0
        self._arrival_counter = itertools.count()
        self.last_step_num_tokens = 0  # 0: the last step found nothing it could run
        self.async_scheduling = _resolve_async_scheduling(config, loaded)
        self._in_flight: tuple[SchedulerOutput, PendingOutput] | None = None  # launched, not yet processed
        self._counters = {"finished": 0, "aborted": 0, "prompt_tokens": 0, "generation_tokens": 0, "steps": 0}

    def _build_kv_cache(self, eviction_policy: EvictionPolicy | Callable[[int], EvictionPolicy] | None,
                        host_eviction_policy: EvictionPolicy | Callable[[int], EvictionPolicy] | None,
                        shared_cache_salt: str | None) -> KVCacheManager:
        """Size the KV cache (profiling the runner on CUDA unless num_blocks is set), allocate it on
        the runner, prepare execution (CUDA graphs, compilation) and build its manager."""
        config, loaded = self.config, self.loaded_model
        configure_kv_cache_dtype(self.runner, config.cache, getattr(loaded.model, "backend", None))
        profile = None
        if loaded.device.type == "cuda" and config.cache.num_blocks is None:
            profile = self.runner.profile_memory(
                config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs, self.max_model_len
            )
        num_blocks = num_blocks_for_budget(config.cache, self.runner.kv_shape, loaded.device, profile)
        check_fits_one_sequence(num_blocks, config.cache.block_size, self.max_model_len)
        self.runner.allocate_kv_cache(num_blocks)
        prepare_kv_cache_scales(self.runner, config.cache, self.tokenizer, self.vocab_size, self.max_model_len)
        prepare_execution(self.runner, loaded, config, self.max_model_len)
        if eviction_policy is not None and not isinstance(eviction_policy, EvictionPolicy):
            eviction_policy = eviction_policy(num_blocks)
        self.runner.host_tier = build_host_tier(config.cache, self.runner.kv_shape, loaded.device,
                                                host_eviction_policy)
        return KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                              eviction_policy, shared_cache_salt=shared_cache_salt, host_tier=self.runner.host_tier)

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: EngineConfig, *, progress: bool = True, **hooks: Any) -> LLMEngine:
        """Load the model `config.model` names (and pick its attention back end), then build the engine.

        `hooks`: eviction_policy, scheduling_policy, waiting_queue, shared_cache_salt, step_observer (see the
        class).
        """
        from sits.runtime.attention.registry import BackendUnavailableError, select_backend
        from sits.runtime.models import loading

        config.validate()
        if config.parallel.tensor_parallel_size > 1:
            from sits.runtime.parallel.executor import TensorParallelExecutor
            from sits.runtime.parallel.recipe import ModelRecipe

            executor = TensorParallelExecutor.start(ModelRecipe.from_engine_config(config), config.parallel,
                                                    progress=progress)
            try:
                return cls(executor.loaded, config, runner_factory=executor.make_runner, **hooks)
            except BaseException:
                executor.shutdown()
                raise
        device, dtype = loading.resolve_device_dtype(config.model)
        head_dim = checkpoint_head_dim(config, progress)
        try:
            backend = select_backend(config.attention_backend, device, dtype, head_dim)
        except BackendUnavailableError as exc:
            raise ConfigError(f"--attention-backend: {exc}") from exc
        loaded = loading.load_model(config.model, backend, progress=progress)
        return cls(loaded, config, **hooks)

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, config: EngineConfig, **hooks: Any) -> LLMEngine:
        """An engine over an already loaded model (tests share one model across engines)."""
        return cls(loaded, config, **hooks)

    # -- requests --------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams, tenant: str = "default") -> None:
        """Raise (a ValueError subclass, a 400 at the edge) if the request can never be served.

        The one check of a request that did not come through the server's input processor
        (`sits.runtime.engine.validated`); one that did is only asserted (`_check_invariants`).
        """
        params.validate(vocab_size=self.vocab_size)
        resolve_bad_words(params, self.tokenizer, self.vocab_size)  # bad_words as token ids, once
        self._check_engine_support(params)
        if not prompt_token_ids:
            raise PromptTooLongError("the prompt is empty; it needs at least one token")
        bad = next((t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad!r} is out of range (vocabulary size {self.vocab_size})")
        wanted = params.max_tokens or 1
        if len(prompt_token_ids) + wanted > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt_token_ids)} tokens and {wanted} more were requested "
                f"({len(prompt_token_ids) + wanted} in all)"
            )
        self._check_tenant_room(len(prompt_token_ids), params, tenant)

    def _check_engine_support(self, params: SamplingParams) -> None:
        """What this engine's configuration refuses, and the output grammar compiled (a 400 naming its
        field; a cache hit once compiled, as it is when the server compiled it)."""
        if params.prompt_logprobs is not None and self.config.parallel.tensor_parallel_size > 1:
            raise SamplingParamsError("prompt_logprobs", "prompt logprobs (echo with logprobs, or prompt_logprobs) "
                                      "are not available with tensor parallelism")
        if params.structured_output is not None:
            self.structured_outputs.cache.compile(params.structured_output)

    def _check_tenant_room(self, prompt_tokens: int, params: SamplingParams, tenant: str) -> None:
        """The tenant's room in the KV cache now: only the engine knows it when the request arrives
        (a live table update may have shrunk it since the server looked)."""
        wanted = params.max_tokens or 1
        room = self.kv_cache.max_tokens_for(tenant)
        if prompt_tokens + wanted > room:
            raise PromptTooLongError(
                f"tenant {tenant!r} can hold at most {room} tokens in the KV cache (its kvCacheShare plus the "
                f"blocks no tenant is guaranteed); the prompt has {prompt_tokens} tokens and {wanted} "
                "more were requested"
            )

    def _check_request(self, prompt_token_ids: list[int], params: SamplingParams, tenant: str) -> None:
        """Each request is checked once: by the server's input processor (ValidatedSamplingParams, only
        asserted here), else here (`validate_request`)."""
        if isinstance(params, ValidatedSamplingParams):
            self._check_invariants(prompt_token_ids, params, tenant)
        else:
            self.validate_request(prompt_token_ids, params, tenant)

    def _check_invariants(self, prompt_token_ids: list[int], params: ValidatedSamplingParams, tenant: str) -> None:
        """A request the server's input processor checked: cheap asserts, then what only the engine knows."""
        assert prompt_token_ids and params.max_tokens is not None, "validated requests carry a prompt and max_tokens"
        assert len(prompt_token_ids) + params.max_tokens <= self.max_model_len, "validated requests fit the context"
        self._check_engine_support(params)
        self._check_tenant_room(len(prompt_token_ids), params, tenant)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        tenant: str = "default",
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        stream_text: bool = True,
        lora: str | None = None,
    ) -> None:
        """Queue a request; its n completions are scheduled as n sequences sharing the prompt.

        `lora` names the LoRA adapter (`--lora-modules`) the request runs with; None: the base model.

        `stream_text=False` (a caller that reads the text only once the request finished, like a
        non-streaming API call): the text is decoded when the request finishes, in one go, unless
        stop strings need it earlier; snapshots before the last carry token ids but no text.

        Raises:
            PromptTooLongError: empty prompt, or prompt + max_tokens (1 if None) > max_model_len.
            InvalidRequestError: a token id outside the vocabulary, a duplicate id, an unknown LoRA adapter.
            SamplingParamsError: a sampling parameter out of range.
        """
        if request_id in self._requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already in the engine")
        prompt_token_ids = list(prompt_token_ids)
        self._check_request(prompt_token_ids, params, tenant)
        slot, lora_key = lora_binding(self.lora, lora)  # InvalidRequestError for an adapter not served
        arrival_time = time.time() if arrival_time is None else arrival_time
        # A sequence longer than its tenant's room in the cache could never finish: it stops there.
        longest = min(self.max_model_len, self.kv_cache.max_tokens_for(tenant))
        max_tokens = min(params.max_tokens or self.max_model_len, longest - len(prompt_token_ids))
        seq_ids = [child_sequence_id(request_id, i, params.n) for i in range(params.n)]
        order = next(self._arrival_counter)
        sequences = [
            Sequence(seq_id=seq_id, request_id=request_id, index=index, prompt_token_ids=prompt_token_ids,
                     params=_child_params(params, index), max_tokens=max_tokens, arrival_time=arrival_time,
                     tenant=tenant, priority=priority, cache_salt=cache_salt, lora_name=lora_key, lora_slot=slot,
                     sibling_ids=tuple(s for s in seq_ids if s != seq_id), arrival_order=order)
            for index, seq_id in enumerate(seq_ids)
        ]
        if params.structured_output is not None:
            self.structured_outputs.add(sequences, params.structured_output)
        self.output_processor.add_request(
            request_id, prompt_token_ids, params, tenant, RequestMetrics(arrival_time=arrival_time), stream_text
        )
        for seq in sequences:
            self.scheduler.add_request(seq)
        self._requests[request_id] = RequestState(request_id, sequences, needs_history=params.needs_output_tokens)
        self._num_unscheduled += 1
        self._num_history += params.needs_output_tokens
        self._counters["prompt_tokens"] += len(prompt_token_ids)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests now: their blocks are freed before this returns.

        Unknown or finished ids are ignored. Returns the final snapshot of each aborted request
        (unfinished completions with finish_reason ABORT), for callers that stream them.
        """
        ids = dict.fromkeys((request_ids,) if isinstance(request_ids, str) else request_ids)
        finals = []
        for request in [self._requests[i] for i in ids if i in self._requests]:
            self._release(request, aborted=True)
            final = self.output_processor.abort(request.request_id)
            if final is not None:
                finals.append(final)
        return finals

    def _release(self, request: RequestState, aborted: bool = False) -> None:
        """The one call that frees a request: its sequences still running or waiting are finished
        (aborted: their blocks freed now, their rows at the next step), its matchers dropped, and
        it leaves the index. The output processor's record is the caller's (abort or final output)."""
        del self._requests[request.request_id]
        self._num_unscheduled -= not request.scheduled
        self._num_history -= request.needs_history
        if aborted:
            self.scheduler.finish_requests([seq.seq_id for seq in request.sequences if not seq.finished],
                                           SequenceStatus.FINISHED_ABORTED)
            self._counters["aborted"] += 1
        self.structured_outputs.release(request.sequences)
        self._counters["finished"] += 1

    def stop_completions(self, request_id: str, indices: Iterable[int]) -> list[RequestOutput]:
        """Finish completions that a stop string ended in a client that decodes the text
        (`OutputProcessor(detokenize=False)`): their sequences stop now and their blocks are freed.
        Returns their snapshot (the request's final one once no completion runs); unknown ids are ignored."""
        request = self._requests.get(request_id)
        if request is None:
            return []
        chosen = [request.sequences[i] for i in indices if 0 <= i < len(request.sequences)]
        self.scheduler.finish_requests([seq.seq_id for seq in chosen if not seq.finished],
                                       SequenceStatus.FINISHED_STOPPED)
        output = self.output_processor.end(request_id, [seq.index for seq in chosen], FinishReason.STOP)
        if output is None:
            return []
        if output.finished:
            self._release(request)
        return [output]

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # -- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return snapshots of the requests that got tokens (deltas filled).

        With async scheduling the step is launched on the device and the snapshots returned are
        those of the previous step, processed while this one computes.
        """
        previous, self._in_flight = self._in_flight, None
        outputs: list[RequestOutput] = []
        drained = previous is not None and self._num_history > 0
        if drained:  # a penalty needs every output token on the host before sampling: no step ahead
            outputs = self._complete(*previous)
        with nvtx_range("schedule"):
            scheduler_output = self.scheduler.schedule()
        if self._num_unscheduled:
            self._mark_scheduled(scheduler_output)
        # 0 tells the caller that nothing could run (it backs off); recording a step is progress too.
        self.last_step_num_tokens = scheduler_output.num_batched_tokens or (
            previous[0].num_batched_tokens if previous is not None else 0)
        if not scheduler_output.is_empty:
            self._counters["steps"] += 1
            if self._step_observer is not None:
                self._step_observer(scheduler_output)
        if not self.async_scheduling:
            runner_output = self.runner.execute(scheduler_output)
            return self._complete(scheduler_output, runner_output) if not scheduler_output.is_empty else []
        pending = self.runner.launch(scheduler_output)
        if not scheduler_output.is_empty:
            self._in_flight = (scheduler_output, pending)
        if previous is not None and not drained:
            outputs = self._complete(*previous)
        return outputs

    def _complete(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput | PendingOutput
                  ) -> list[RequestOutput]:
        """Record a step's sampled tokens: update the sequences (the scheduler decides which stopped:
        `stopping.py`), detokenize, finish what a stop string ended, release finished requests."""
        if isinstance(runner_output, PendingOutput):
            runner_output = runner_output.result()
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        if runner_output.prompt_logprobs:  # before the updates: a request's first snapshot carries them
            self.output_processor.add_prompt_logprobs(runner_output.prompt_logprobs)
        outputs, stopped = self.output_processor.process(updates)
        if stopped:  # stop strings are decided on the text
            self.scheduler.finish_requests(stopped, SequenceStatus.FINISHED_STOPPED)
        self._counters["generation_tokens"] += sum(len(u.new_token_ids) for u in updates)
        for output in outputs:
            if output.finished and (request := self._requests.get(output.request_id)) is not None:
                self._release(request)
        return outputs

    def _mark_scheduled(self, scheduler_output: SchedulerOutput) -> None:
        """Stamp first_scheduled_time on requests scheduled for the first time."""
        started = set()
        for scheduled in scheduler_output.scheduled:
            request = self._requests.get(scheduled.sequence.request_id)
            if request is not None and not request.scheduled:
                request.scheduled = True
                self._num_unscheduled -= 1
                started.add(request.request_id)
        if started:
            self.output_processor.mark_scheduled(started, time.time())

    def shutdown(self) -> None:
        """Stop what outlives steps: a tensor-parallel runner's worker processes (idempotent)."""
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def stats(self) -> EngineStats:
        """The engine's figures now: the scheduler's, with this engine's request counters added.
        Built only when asked (a scrape, a caller), on the engine's thread between steps."""
        c = self._counters
        return dataclasses.replace(
            self.scheduler.stats(), num_requests=len(self._requests), num_finished=c["finished"],
            num_aborted=c["aborted"], num_prompt_tokens=c["prompt_tokens"],
            num_generation_tokens=c["generation_tokens"], num_steps=c["steps"], cpu_seconds=time.process_time())


def _resolve_async_scheduling(config: EngineConfig, loaded: LoadedModel) -> bool:
    """EngineConfig.async_scheduling, with None (auto) on for one CUDA device without speculation only."""
    if config.async_scheduling is not None:
        return config.async_scheduling
    return loaded.device.type == "cuda" and config.parallel.tensor_parallel_size == 1 and config.speculative is None


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index`'s params: n = 1, and a seed of seed + index so completions differ."""
    seed = params.seed + index if params.seed is not None else None
    return dataclasses.replace(params, n=1, seed=seed)
