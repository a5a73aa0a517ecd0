"""Validated configuration of the engine and the server.

Every value a user can set on `sits serve` lands in one of these dataclasses; `validate()`
raises `ConfigError` naming the option, so a bad flag is a one-line error, never a traceback.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass, field
from pathlib import Path

from sits.runtime.lora.config import LoraConfig, LoraConfigError
from sits.runtime.parallel.config import ParallelConfig

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
QUANTIZATIONS = ("none", "fp8", "int8")
# --activation-dtype: auto keeps the activations in --dtype; float32 keeps them in float32 beside half-precision
# weights (runtime/models/mixed_linear.py)
ACTIVATION_DTYPES = ("auto", "float32")
FP8_MODES = ("auto", "w8a8", "weight-only")  # --fp8-mode (sits.runtime.models.quantize)
LOAD_FORMATS = ("auto", "dummy")
# --kv-cache-dtype: "auto" is the model's dtype; "fp8" (vLLM also spells it "fp8_e4m3") is e4m3 with
# per-layer, per-KV-head scales (docs/fp8-kv-cache.md).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# --kv-cache-scales of an fp8 cache: "static" is 1.0 per head (vLLM's default without checkpoint
# scales); "calibrate" measures each head's amax on a calibration pass at start-up.
KV_CACHE_SCALES = ("static", "calibrate")


class ConfigError(ValueError):
    """An option has an invalid value; the message names the option as the CLI spells it."""


@dataclass
class ModelConfig:
    """Which checkpoint to load, and how.

    Attributes:
        model: an HF directory (config.json + *.safetensors), a .gguf file, or None for the
            embedded SmolLM2-135M-Instruct.
        served_model_name: the OpenAI "model" id; defaults to the checkpoint's name.
        dtype: "auto" is float32 on CPU and bfloat16 on CUDA.
        device: "auto" is cuda when available, else cpu.
        max_model_len: prompt + output tokens per sequence; None takes the checkpoint's context.
        quantization: weight quantization applied after load (GPU engine).
        fp8_mode: with fp8, "w8a8", "weight-only" or "auto" (weight-only without fp8 tensor cores).
        seed: seed for random weights and for requests that give none.
        chat_template: `--chat-template`: a jinja2 file, or the template text itself, that replaces
            the model's own chat template (read with `read_chat_template`); None keeps the model's.
        load_format: "auto" reads the checkpoint `model` names; "dummy" (vLLM's name) builds seeded
            random weights of the named shape `config_name` with the token-id tokenizer, no checkpoint.
        config_name: `--config`: a shape of `sits.runtime.models.presets` (e.g. "llama-3-8b"); only
            with load_format "dummy".
        activation_dtype: "auto" runs the activations in `dtype`; "float32" keeps them in float32 between the
            kernels of a bfloat16 / float16 model (weights and KV cache stay in `dtype`; each projection
            multiplies the two half-precision parts of its float32 input, see mixed_linear.py).
    """

    model: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    quantization: str = "none"
    seed: int = 0
    fp8_mode: str = "auto"
    chat_template: str | None = None
    load_format: str = "auto"
    config_name: str | None = None
    activation_dtype: str = "auto"

    def validate(self) -> None:
        if self.chat_template is not None:
            read_chat_template(self.chat_template)
        self._validate_load_format()
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.fp8_mode not in FP8_MODES:
            raise ConfigError(f"--fp8-mode must be one of {', '.join(FP8_MODES)}, got {self.fp8_mode!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be positive, got {self.max_model_len}")
        self._validate_activation_dtype()

    def _validate_activation_dtype(self) -> None:
        if self.activation_dtype not in ACTIVATION_DTYPES:
            raise ConfigError(f"--activation-dtype must be one of {', '.join(ACTIVATION_DTYPES)}, "
                              f"got {self.activation_dtype!r}")
        if self.activation_dtype != "auto" and self.quantization != "none":
            raise ConfigError(f"--activation-dtype {self.activation_dtype} needs unquantized weights: "
                              f"--quantization {self.quantization} multiplies its own activation format")

    def _validate_load_format(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.load_format == "dummy":
            if self.config_name is None:
                raise ConfigError("--load-format dummy needs --config NAME (the model shape of the random weights)")
            if self.model is not None:
                raise ConfigError("--model and --load-format dummy cannot be used together: dummy weights have "
                                  "the shape --config names, no checkpoint")
            from sits.runtime.models.presets import PRESETS

            if self.config_name not in PRESETS:
                raise ConfigError(f"--config: unknown model config {self.config_name!r}; known: {', '.join(PRESETS)}")
        elif self.config_name is not None:
            raise ConfigError("--config NAME needs --load-format dummy (random weights of that shape)")


# A value with none of these characters is meant as a file name (vLLM's rule for --chat-template).
JINJA_CHARS = "{}\n"


def read_chat_template(value: str) -> tuple[str, str]:
    """The `--chat-template` value as (template text, where it came from, for the startup log).

    As vLLM reads it: the contents of the file `value` names if there is one, else `value` itself as
    the template, with backslash escapes such as `\\n` decoded (so a shell can pass it on one line).
    The template is compiled here, so a broken one stops the server before the model loads.
    Raises:
        ConfigError: no such file and `value` does not look like a template, the file cannot be read,
            or the template does not compile.
    """
    try:
        text, origin = Path(value).expanduser().read_text(encoding="utf-8"), f"file {value}"
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, or a NUL in the name
        if not any(char in value for char in JINJA_CHARS):
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError(f"--chat-template {value!r} is neither a readable file ({reason}) "
                              "nor a jinja2 template") from None
        try:  # backslashreplace first keeps non-Latin-1 text intact through unicode_escape
            text = codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
        except UnicodeDecodeError:  # a stray backslash (e.g. "\\N" alone): take the text as it is
            text = value
        origin = f"inline, {len(text)} characters"
    import jinja2  # here, not at the top: the config stays light for commands that never render chats

    from sits.runtime.models.chat_template import ChatTemplateError, compile_template

    try:
        compile_template(text)
    except ChatTemplateError as exc:
        cause = exc.__cause__
        where = f" at line {cause.lineno}" if isinstance(cause, jinja2.TemplateSyntaxError) else ""
        message = cause.message if isinstance(cause, jinja2.TemplateSyntaxError) else str(exc)
        raise ConfigError(f"--chat-template ({origin}) does not compile{where}: {message}") from None
    return text, origin


@dataclass
class CacheConfig:
    """The paged KV cache.

    Attributes:
        block_size: tokens per KV block.
        kv_cache_gb: KV cache budget on CPU, in GiB.
        gpu_memory_utilization: fraction of GPU memory the engine may use (weights + activations
            + KV cache) on CUDA.
        num_blocks: exact number of blocks; overrides both budgets (tests, tiny caches).
        enable_prefix_caching: reuse full blocks of earlier prompts.
        host_kv_cache_gb: host-memory tier under the prefix cache, in GiB (0: off). Evicted
            cached blocks are copied there and copied back on a prefix hit (pinned memory on CUDA).
        kv_cache_dtype: "auto" (the model's dtype) or "fp8" (float8 e4m3 with per-head scales;
            "fp8_e4m3" is accepted and stored as "fp8").
        kv_cache_scales: how an fp8 cache's scales are set: "static" (1.0) or "calibrate".
    """

    block_size: int = 16
    kv_cache_gb: float = 1.0
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    host_kv_cache_gb: float = 0.0
    kv_cache_dtype: str = "auto"
    kv_cache_scales: str = "static"

    @property
    def fp8(self) -> bool:
        """True when the cache is stored as float8 e4m3."""
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    def validate(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8_e4m3":
            self.kv_cache_dtype = "fp8"
        if self.kv_cache_scales not in KV_CACHE_SCALES:
            raise ConfigError(
                f"--kv-cache-scales must be one of {', '.join(KV_CACHE_SCALES)}, got {self.kv_cache_scales!r}")
        if self.kv_cache_scales != "static" and not self.fp8:
            raise ConfigError(f"--kv-cache-scales {self.kv_cache_scales} applies to an fp8 cache only: "
                              "add --kv-cache-dtype fp8")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ConfigError(f"--block-size must be a power of two up to 256, got {self.block_size}")
        if not 0.0 < self.kv_cache_gb <= 4096:
            raise ConfigError(f"--kv-cache-gb must be positive, got {self.kv_cache_gb}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"--num-blocks must be positive, got {self.num_blocks}")
        if not 0.0 <= self.host_kv_cache_gb <= 65536:
            raise ConfigError(f"--host-kv-cache-gb must be >= 0 (0 turns the host tier off), got {self.host_kv_cache_gb}")
        if self.host_kv_cache_gb > 0 and not self.enable_prefix_caching:
            raise ConfigError("--host-kv-cache-gb needs prefix caching (drop --no-enable-prefix-caching)")


@dataclass
class SchedulerConfig:
    """Continuous batching limits.

    Attributes:
        max_num_seqs: sequences running at once.
        max_num_batched_tokens: new tokens per step (prefill chunks + decodes).
        enable_chunked_prefill: split long prompts across steps, mixed with decodes.
        max_prefill_tokens_with_decodes: the decodes' latency budget: in a step that runs decodes,
            prompt tokens (prefill chunks of running and newly admitted sequences together) are
            capped at this many, so a long prompt is chunked instead of stalling every decode of
            the step; a step without decodes still takes max_num_batched_tokens. 0: no cap. Needs
            chunked prefill (without it a prompt is never split, so the cap does not apply).
        prefill_cap_min_decodes: the cap applies only to a step that runs at least this many
            decodes. A burst of new prompts with few decodes running (the start of a batch) still
            prefills at full speed, which is what its time to first token and the batch's
            throughput need; a large decode batch, where a stall costs many streams a token each,
            gets the bound. 0 or 1: any step with decodes.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_prefill_tokens_with_decodes: int = 0
    prefill_cap_min_decodes: int = 0

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"--max-num-batched-tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_prefill_tokens_with_decodes < 0:
            raise ConfigError("--max-prefill-tokens-with-decodes must be >= 0 (0: no cap), got "
                              f"{self.max_prefill_tokens_with_decodes}")
        if self.prefill_cap_min_decodes < 0:
            raise ConfigError(f"--prefill-cap-min-decodes must be >= 0, got {self.prefill_cap_min_decodes}")

    @property
    def prefill_cap_with_decodes(self) -> int | None:
        """Prompt tokens a step with decodes may schedule, None when uncapped."""
        if not self.enable_chunked_prefill or self.max_prefill_tokens_with_decodes == 0:
            return None
        return self.max_prefill_tokens_with_decodes


SPECULATIVE_METHODS = ("ngram",)

# The default piecewise-graph coverage reaches at least this many tokens a step: launched eagerly, a step's
# forward costs the host ~27 ms (Llama-3-8B on the H200's host), about the GPU work of 1,000-1,500 prompt
# tokens, so steps up to ~2,000 tokens are the ones the host would pace.
PIECEWISE_MIN_TOKENS = 2048


@dataclass
class SpeculativeConfig:
    """Speculative decoding (`--speculative-config`, vLLM's JSON): n-gram prompt lookup.

    Attributes:
        method: "ngram": drafts are the tokens that followed the latest earlier occurrence of the
            sequence's last n tokens in its own prompt + output.
        num_speculative_tokens: drafts proposed (and verified) per step at most (k).
        prompt_lookup_max, prompt_lookup_min: the longest and shortest n tried, longest first.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse the flag's JSON object; a ConfigError naming the flag for anything malformed."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"--speculative-config is not valid JSON: {error}") from None
        if not isinstance(values, dict):
            raise ConfigError("--speculative-config must be a JSON object, e.g. "
                              '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
        unknown = sorted(set(values) - {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"})
        if unknown:
            raise ConfigError(f"--speculative-config: unknown key(s) {', '.join(unknown)}")
        if "method" not in values:
            raise ConfigError('--speculative-config needs a "method" (only "ngram" is supported)')
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"--speculative-config: method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                              f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--speculative-config: {name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"--speculative-config: prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                              f"prompt_lookup_max ({self.prompt_lookup_max})")

    def describe(self) -> str:
        return (f"{self.method}, {self.num_speculative_tokens} speculative tokens, "
                f"prompt lookup n {self.prompt_lookup_max}..{self.prompt_lookup_min}")


@dataclass
class EngineConfig:
    """Everything the engine needs to start.

    Attributes:
        enforce_eager: never capture CUDA graphs (decode steps run eagerly too).
        cuda_graph_max_batch_size: the largest decode batch captured in a CUDA graph; None takes
            max_num_seqs (larger decode batches run eagerly).
        piecewise_graph_max_tokens: steps with prompt tokens of up to this many tokens replay CUDA graphs
            of the forward between its attention calls (`engine/piecewise_graphs.py`); None (auto):
            max_num_seqs plus the decodes' prompt-token budget, at least PIECEWISE_MIN_TOKENS, at most
            max_num_batched_tokens (`piecewise_max_tokens`); 0: such steps run eagerly.
        compile: torch.compile the model's non-attention parts (norms, MLPs).
        async_scheduling: schedule and prepare the next step, and process the previous step's
            outputs, while the device computes the current one; None (auto) turns it on for one
            CUDA device and off on a CPU, where the forward runs on the calling thread anyway.
        lora: multi-LoRA serving (`--enable-lora`, `--lora-modules`, ...).
        speculative: speculative decoding (`--speculative-config`); None: off. It runs with the
            synchronous engine only (async scheduling auto-resolves to off) and one device.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    attention_backend: str = "auto"
    enforce_eager: bool = False
    cuda_graph_max_batch_size: int | None = None
    piecewise_graph_max_tokens: int | None = None
    compile: bool = False
    async_scheduling: bool | None = None
    lora: LoraConfig = field(default_factory=LoraConfig)
    speculative: SpeculativeConfig | None = None

    def validate(self) -> None:
        self.model.validate()
        self._validate_speculative()
        self._validate_lora()
        self._validate_activation_dtype()
        self.cache.validate()
        self.scheduler.validate()
        self.parallel.validate()
        if self.parallel.tensor_parallel_size > 1 and self.compile:
            raise ConfigError("--compile does not run with --tensor-parallel-size > 1 yet (every rank would compile)")
        if self.parallel.tensor_parallel_size > 1 and self.cache.host_kv_cache_gb > 0:
            raise ConfigError("--host-kv-cache-gb does not run with --tensor-parallel-size > 1 yet")
        if self.parallel.tensor_parallel_size > 1 and self.cache.kv_cache_scales == "calibrate":
            raise ConfigError("--kv-cache-scales calibrate does not run with --tensor-parallel-size > 1 yet "
                              "(each rank's heads would need their own calibration pass); use static scales")
        if self.parallel.tensor_parallel_size > 1 and self.async_scheduling:
            raise ConfigError("--async-scheduling does not run with --tensor-parallel-size > 1 yet")
        if self.cuda_graph_max_batch_size is not None and self.cuda_graph_max_batch_size < 1:
            raise ConfigError(f"--cuda-graph-max-batch-size must be positive, got {self.cuda_graph_max_batch_size}")
        if self.piecewise_graph_max_tokens is not None and self.piecewise_graph_max_tokens < 0:
            raise ConfigError("--piecewise-graph-max-tokens must be >= 0 (0: off), got "
                              f"{self.piecewise_graph_max_tokens}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )

    @property
    def piecewise_max_tokens(self) -> int:
        """The largest step (tokens) the piecewise graphs hold; 0: none (see piecewise_graph_max_tokens)."""
        if self.piecewise_graph_max_tokens is not None:
            return self.piecewise_graph_max_tokens
        sched = self.scheduler
        beside_decodes = sched.max_num_seqs + (sched.prefill_cap_with_decodes or 0)
        return min(sched.max_num_batched_tokens, max(PIECEWISE_MIN_TOKENS, beside_decodes))

    def _validate_speculative(self) -> None:
        if self.speculative is None:
            return
        self.speculative.validate()
        if self.async_scheduling:
            raise ConfigError("--speculative-config does not run with --async-scheduling (verifying drafts "
                              "needs the previous step's tokens on the host); leave --async-scheduling off")
        if self.parallel.tensor_parallel_size > 1:
            raise ConfigError("--speculative-config does not run with --tensor-parallel-size > 1 yet")

    def _validate_lora(self) -> None:
        """LoRA's own options, and what it does not run with: its delta layers run eagerly beside
        plain (unsharded, unquantized) linear layers."""
        try:
            self.lora.validate()
        except LoraConfigError as error:
            raise ConfigError(str(error)) from None
        if not self.lora.enable_lora:
            return
        if self.parallel.tensor_parallel_size > 1:
            raise ConfigError("--enable-lora does not run with --tensor-parallel-size > 1 yet")
        if self.model.quantization != "none":
            raise ConfigError(f"--enable-lora does not run with --quantization {self.model.quantization} "
                              "(adapters need the unquantized weights' layers)")
        if self.compile:
            raise ConfigError("--enable-lora does not run with --compile (the adapters' layers run eagerly)")

    def _validate_activation_dtype(self) -> None:
        """What float32 activations beside half-precision weights do not run with yet."""
        if self.model.activation_dtype == "auto":
            return
        flag = f"--activation-dtype {self.model.activation_dtype}"
        if self.parallel.tensor_parallel_size > 1:
            raise ConfigError(f"{flag} does not run with --tensor-parallel-size > 1 yet")
        if self.lora.enable_lora:
            raise ConfigError(f"{flag} does not run with --enable-lora yet (the adapters' deltas are half precision)")
        if self.compile:
            raise ConfigError(f"{flag} does not run with --compile yet")


TOOL_CALL_PARSERS = ("hermes",)  # `<tool_call>{"name", "arguments"}</tool_call>` (Hermes, Qwen2.5)


@dataclass
class ServerConfig:
    """The HTTP server around the engine.

    Attributes:
        track: the `track` label on every metric (`stable` or `canary`), set by the operator.
        drain_timeout_s: on SIGTERM, how long in-flight requests may run before they are aborted.
        enable_auto_tool_choice: serve tool_choice "auto" (needs tool_call_parser), as vLLM's flag.
        tool_call_parser: how calls are read out of generated text for "auto" (TOOL_CALL_PARSERS).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    track: str = "stable"
    drain_timeout_s: float = 30.0
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be between 0 and 65535, got {self.port}")
        if self.track not in ("stable", "canary"):
            raise ConfigError(f"--track must be stable or canary, got {self.track!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                              f"got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)")

    @property
    def auto_tool_call_parser(self) -> str | None:
        """The parser that serves tool_choice "auto", or None when "auto" is refused."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None
