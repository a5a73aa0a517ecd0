"""Reading an HF checkpoint directory: `config.json` and `*.safetensors` (sharded or not)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open


class CheckpointError(ValueError):
    """The directory is not a usable checkpoint; the message names the missing or broken file."""


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def read_hf_config(directory: Path) -> dict[str, Any]:
    """config.json as a dict, with generation_config.json's eos ids merged into eos_token_id."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory} is not a model directory: config.json is missing")
    config = read_json(config_path)
    generation_path = directory / "generation_config.json"
    if generation_path.is_file():
        extra = read_json(generation_path).get("eos_token_id")
        if extra is not None:
            ids = _as_list(config.get("eos_token_id"))
            config["eos_token_id"] = ids + [i for i in _as_list(extra) if i not in ids]
    return config


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files, in the order the shard index lists them (or sorted)."""
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (directory / f).is_file()]
        if missing:
            raise CheckpointError(f"{directory}: shard(s) listed in the index are missing: {', '.join(missing)}")
        return [directory / f for f in files]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        bins = list(directory.glob("*.bin"))
        hint = " (PyTorch .bin checkpoints are not supported; convert them to safetensors)" if bins else ""
        raise CheckpointError(f"{directory} holds no *.safetensors weights{hint}")
    return files


def count_tensors(files: list[Path]) -> int:
    total = 0
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                total += len(f.keys())
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
    return total


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file, read lazily (memory-mapped, on the CPU)."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, f.get_tensor(name)
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
