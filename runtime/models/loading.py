"""Loading a model for serving: an HF directory, a GGUF file, an `hf://org/name` Hub repository, or the
embedded SmolLM2-135M-Instruct.

Every source ends up as an HF-style directory (config.json, tokenizer files, safetensors); a GGUF
file is converted once into a cache directory (`sits.runtime.models.gguf_cache`); an hf:// repository
is fetched into the Hugging Face cache by huggingface_hub (only here). The model is built
on the meta device and materialised directly in the target dtype and device, so no memory is spent
on a random initialisation that the checkpoint overwrites.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from sits.runtime.attention.backend import AttentionBackend
from sits.runtime.config import ModelConfig, read_chat_template
from sits.runtime.models.config import LlamaConfig, UnsupportedModelError
from sits.runtime.models.embedded import embedded_gguf_path
from sits.runtime.models.errors import ModelLoadError
from sits.runtime.models.hf_checkpoint import (
    CheckpointError,
    count_tensors,
    iter_safetensors,
    read_hf_config,
    safetensors_files,
)
from sits.runtime.models.llama import LlamaForCausalLM
from sits.runtime.models.progress import LoadProgress
from sits.runtime.models.tokenizer import Tokenizer

__all__ = ["LoadedModel", "ModelLoadError", "build_random_model", "load_model", "read_model_config",
           "resolve_device_dtype"]

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HF_SCHEME = "hf://"
HF_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
HF_REVISION = re.compile(r"^[\w./-]+$")  # a branch, tag or commit hash
# What loading reads: config.json, generation_config.json, tokenizer*.json, special_tokens_map.json,
# the safetensors index, the weights and a chat template; top level only (original/, onnx/... hold other formats)
HF_ALLOW_PATTERNS = ["*.json", "*.safetensors", "chat_template.jinja"]
HF_IGNORE_PATTERNS = ["*/*"]


@dataclass
class LoadedModel:
    """A model ready to run, with what the engine and server need to know about it.

    Attributes:
        model: the decoder, in eval mode, on `device` in `dtype`.
        tokenizer: its tokenizer and chat template.
        config: its shape.
        name: the default served model name (e.g. "SmolLM2-135M-Instruct").
        source: where it came from (a path, or "embedded:<path>").
        device, dtype: where and how it runs.
    """

    model: LlamaForCausalLM
    tokenizer: Tokenizer
    config: LlamaConfig
    name: str
    source: str
    device: torch.device
    dtype: torch.dtype


def resolve_device_dtype(model_config: ModelConfig) -> tuple[torch.device, torch.dtype]:
    """The device and dtype "auto" stands for: cuda if available else cpu; float32 on CPU, bfloat16 on CUDA.

    Raises:
        ModelLoadError: cuda was asked for on a machine without it, or an unknown dtype/device.
    """
    if model_config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif model_config.device in ("cpu", "cuda"):
        device = torch.device(model_config.device)
    else:
        raise ModelLoadError(f"--device must be auto, cpu or cuda, got {model_config.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was requested but no CUDA GPU is available")
    if model_config.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif model_config.dtype in DTYPES:
        dtype = DTYPES[model_config.dtype]
    else:
        raise ModelLoadError(f"--dtype must be auto, float32, float16 or bfloat16, got {model_config.dtype!r}")
    return device, dtype


def read_model_config(model_config: ModelConfig, *, progress: bool = True) -> LlamaConfig:
    """The checkpoint's shape, without loading its weights (e.g. to pick an attention back end by head_dim).

    A GGUF file is converted into the cache first (what load_model would do anyway).
    Raises:
        ModelLoadError: as load_model.
    """
    if model_config.load_format == "dummy":
        return _dummy_shape(model_config)
    directory, _, source = _resolve_source(model_config.model, progress)
    try:
        return LlamaConfig.from_hf_dict(read_hf_config(directory))
    except (CheckpointError, UnsupportedModelError) as exc:
        raise ModelLoadError(f"cannot load {source}: {exc}") from exc


def load_model(model_config: ModelConfig, backend: AttentionBackend, *, progress: bool = True) -> LoadedModel:
    """Load the checkpoint `model_config.model` names (None: the embedded SmolLM2-135M-Instruct).

    Raises:
        ModelLoadError: the path does not exist or is not a checkpoint, the checkpoint is broken,
            or its architecture is not supported.
        ConfigError: `model_config.chat_template` names no readable file or does not compile.
    """
    device, dtype = resolve_device_dtype(model_config)
    if model_config.load_format == "dummy":
        return _dummy_model(model_config, backend, device, dtype)
    # read before the weights, so a broken --chat-template fails at once (and not as a ModelLoadError)
    override = read_chat_template(model_config.chat_template) if model_config.chat_template is not None else None
    directory, name, source = _resolve_source(model_config.model, progress)
    try:
        hf_config = read_hf_config(directory)
        config = LlamaConfig.from_hf_dict(hf_config)
        files = safetensors_files(directory)
        tokenizer = _with_chat_template(_load_tokenizer(directory, config), override, source)
        max_positions = max(config.max_position_embeddings, model_config.max_model_len or 0)
        if max_positions > config.max_position_embeddings:
            logger.warning("max_model_len %d exceeds the model's context (%d tokens); quality may drop",
                           max_positions, config.max_position_embeddings)
        model = _empty_model(config, backend, device, dtype, max_positions)
        total = count_tensors(files)
        with LoadProgress(total, f"Loading {name}", "tensor", enabled=progress) as bar:
            model.load_weights(_counted(iter_safetensors(files), bar))
    except (CheckpointError, UnsupportedModelError) as exc:
        raise ModelLoadError(f"cannot load {source}: {exc}") from exc
    except ValueError as exc:  # load_weights: missing / misshapen tensors
        raise ModelLoadError(f"cannot load {source}: {exc}") from exc
    model.eval()
    logger.debug("loaded %s from %s: %d layers, hidden %d, %s on %s",  # the command's summary says it once
                name, source, config.num_hidden_layers, config.hidden_size, dtype, device)
    return LoadedModel(model, tokenizer, config, model_config.served_model_name or name, source, device, dtype)


def _dummy_shape(model_config: ModelConfig) -> LlamaConfig:
    from sits.runtime.models.presets import preset_config

    try:
        return preset_config(model_config.config_name or "")
    except ValueError as exc:
        raise ModelLoadError(f"--config: {exc}") from exc


def _dummy_model(model_config: ModelConfig, backend: AttentionBackend, device: torch.device,
                 dtype: torch.dtype) -> LoadedModel:
    """`--load-format dummy`: seeded random weights of the `--config` shape with the token-id tokenizer."""
    from sits.runtime.models.random_model import random_loaded_model

    if model_config.chat_template is not None:
        raise ModelLoadError("--chat-template does not apply to --load-format dummy: its chats render as token "
                             "ids (see docs/bench-serve.md)")
    shape = _dummy_shape(model_config)
    name = model_config.config_name or "dummy"
    loaded = random_loaded_model(shape, backend, device, dtype, model_config.seed,
                                 max(shape.max_position_embeddings, model_config.max_model_len or 0), name)
    loaded.name = model_config.served_model_name or name
    logger.info("dummy weights: %s shape (%d layers, hidden %d, vocabulary %d), seed %d, %s on %s; prompts and "
                "outputs are token ids as text", name, shape.num_hidden_layers, shape.hidden_size, shape.vocab_size,
                model_config.seed, dtype, device)
    return loaded


def build_random_model(
    config: LlamaConfig,
    backend: AttentionBackend,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    max_positions: int | None = None,
) -> LlamaForCausalLM:
    """A model of this shape with seeded random weights (tests, benchmarks such as a Llama-3-8B shape).

    Weights are N(0, 0.02²) like HF's initialiser, norms near 1 and biases small, drawn on `device`
    from a generator seeded with `seed` (the same seed gives the same weights on the same device type).
    """
    device = torch.device(device)
    model = _empty_model(config, backend, device, dtype, max_positions or config.max_position_embeddings)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator, device=device))
            elif name.endswith(".bias"):
                param.copy_(0.02 * torch.randn(param.shape, generator=generator, device=device))
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def _empty_model(config, backend, device, dtype, max_positions) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend, max_positions=max_positions)
    # What Module.to_empty does, with torch.empty: its empty_like of a meta tensor runs torch's Python
    # reference op, whose first use imports sympy (half a CPU-second in every process that loads a model).
    return model.to(dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def _counted(tensors, bar):
    for item in tensors:
        yield item
        bar.update(1)


def _load_tokenizer(directory: Path, config: LlamaConfig) -> Tokenizer:
    if not (directory / "tokenizer.json").is_file():
        raise CheckpointError(f"{directory} has no tokenizer.json (only fast tokenizers are supported)")
    try:
        return Tokenizer.from_directory(directory, extra_eos_token_ids=config.eos_token_ids)
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise CheckpointError(f"cannot read the tokenizer in {directory}: {exc}") from exc


def _with_chat_template(tokenizer: Tokenizer, override: tuple[str, str] | None, source: str) -> Tokenizer:
    """The tokenizer with `override` ((text, origin) of `--chat-template`) in place of the model's
    template, logging which template serves chats."""
    if override is not None:
        text, origin = override
        logger.info("chat template: --chat-template %s, in place of the model's%s", origin,
                    "" if tokenizer.chat_template is not None else " (it has none)")
        return tokenizer.with_chat_template(text)
    if tokenizer.chat_template is not None:
        logger.info("chat template: the model's own (%s)", source)
    else:
        logger.info("chat template: none (%s has none; chat requests are refused, --chat-template sets one)",
                    source)
    return tokenizer


def _resolve_source(model: str | None, progress: bool) -> tuple[Path, str, str]:
    """(HF-style directory, default served name, human-readable source) for ModelConfig.model."""
    if model is None:
        gguf_path = embedded_gguf_path()
        return cached_checkpoint_dir(gguf_path, progress=progress), gguf_model_name(gguf_path), f"embedded:{gguf_path}"
    if model.startswith(HF_SCHEME):
        return hf_snapshot_dir(model), model[len(HF_SCHEME):].partition("@")[0].rsplit("/", 1)[-1], model
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {model!r} does not exist (expected an HF directory or a .gguf file)")
    if path.is_dir():
        return path, path.resolve().name, str(path)
    if path.suffix.lower() == ".gguf":
        return cached_checkpoint_dir(path, progress=progress), gguf_model_name(path), str(path)
    raise ModelLoadError(f"model path {model!r} is neither a directory (config.json + *.safetensors) nor a .gguf file")


def hf_snapshot_dir(uri: str) -> Path:
    """The local directory of `hf://org/name[@revision]`, downloaded by huggingface_hub's snapshot_download.

    Only the files loading reads are fetched, into the Hugging Face cache (HF_HOME / HF_HUB_CACHE);
    HF_TOKEN opens private and gated repositories; with HF_HUB_OFFLINE=1 only the cache is read.
    Raises:
        ModelLoadError: a malformed URI, huggingface_hub missing, or the repository not obtainable.
    """
    repo_id, at, revision = uri[len(HF_SCHEME):].partition("@")
    if not HF_REPO_ID.match(repo_id) or (at and not HF_REVISION.match(revision)):
        raise ModelLoadError(f"model {uri!r} is not a Hugging Face repository: expected hf://org/name "
                             "or hf://org/name@revision")
    try:
        from huggingface_hub import constants as hub
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import (
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise ModelLoadError(f"loading {uri} needs huggingface_hub: pip install huggingface_hub") from None
    try:
        return Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=HF_ALLOW_PATTERNS,
                                      ignore_patterns=HF_IGNORE_PATTERNS))
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if hub.HF_HUB_OFFLINE else "the Hub could not be reached"
        raise ModelLoadError(f"cannot load {uri}: it is not in the Hugging Face cache ({hub.HF_HUB_CACHE}) and "
                             f"{why}; download it there first (hf download {repo_id})") from None
    except GatedRepoError:
        raise ModelLoadError(f"cannot load {uri}: the repository is gated; accept its terms on the Hub and set "
                             "HF_TOKEN to a token of that account") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"cannot load {uri}: no such repository on the Hub, or it is private "
                             "(set HF_TOKEN to a token that can read it)") from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"cannot load {uri}: the repository has no revision {revision!r}") from None
    except Exception as exc:  # other HTTP answers, a full disk, the HTTP client's network errors (types vary)
        raise ModelLoadError(f"cannot download {uri}: {type(exc).__name__}: {exc}") from exc


def cached_checkpoint_dir(gguf_path: Path, progress: bool) -> Path:
    """The HF-style directory converted from a GGUF file (the gguf package is imported only here)."""
    from sits.runtime.models import gguf_cache

    return gguf_cache.cached_checkpoint_dir(gguf_path, progress=progress)


def gguf_model_name(path: Path) -> str:
    """The file name without extension and quantization suffix: 'SmolLM2-135M-Instruct.Q4_1.gguf' → 'SmolLM2-135M-Instruct'."""
    stem = Path(path).name[: -len(".gguf")] if str(path).lower().endswith(".gguf") else Path(path).stem
    return re.sub(r"[.\-_](?:[QqIi]\d\w*|[Ff](?:16|32)|BF16|bf16)$", "", stem) or stem
