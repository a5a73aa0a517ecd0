"""Converting a GGUF file once into a cached HF-style directory, keyed by the file's hash.

Reading a GGUF's tokenizer metadata takes seconds and dequantizing takes more; the converted
directory (config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja, safetensors)
loads in well under a second. It lives under `$SITS_CACHE_DIR` (default `~/.cache/sits`) in
`gguf/<name>-<sha256 prefix>/`. A conversion is written to a temporary directory beside it and
renamed into place, so parallel processes never see half a directory: the first rename wins and
the others discard their copy. The file's hash is remembered beside them, in `gguf-digests/`, while
the file is unchanged (`file_digest`), so a later start does not read the whole file again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from sits.runtime.models.errors import ModelLoadError
from sits.runtime.models.gguf_checkpoint import GGUFCheckpoint, GGUFError
from sits.runtime.models.gguf_quants import UnsupportedQuantizationError
from sits.runtime.models.gguf_tokenizer import GGUFTokenizerError, build_tokenizer
from sits.runtime.models.progress import LoadProgress

logger = logging.getLogger(__name__)

SHARD_BYTES = 2 << 30  # split converted weights into safetensors files of at most ~2 GiB
_CONVERSION_VERSION = "2"  # bump when the converted layout changes, so old caches are not reused


def cache_root() -> Path:
    """`$SITS_CACHE_DIR`, else `~/.cache/sits`."""
    configured = os.environ.get("SITS_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "sits"


def file_digest(path: Path, chunk_bytes: int = 8 << 20) -> str:
    """sha256 of the file's bytes, hex.

    Remembered on disk while the file is unchanged (same resolved path, size and mtime_ns), under
    `cache_root()/gguf-digests/`, so later loads, in this process or another, do not read a
    multi-GB file again only to name its cache entry. A memo that cannot be written is skipped.
    """
    stat = path.stat()
    key = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    memo = cache_root() / "gguf-digests" / hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()
    with contextlib.suppress(OSError):
        remembered = memo.read_text(encoding="ascii").strip()
        if re.fullmatch(r"[0-9a-f]{64}", remembered):
            return remembered
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    _write_memo(memo, digest.hexdigest())
    return digest.hexdigest()


def _write_memo(memo: Path, text: str) -> None:
    """Write `text` to `memo` atomically (a reader sees all of it or none); errors are ignored."""
    with contextlib.suppress(OSError):
        memo.parent.mkdir(parents=True, exist_ok=True)
        scratch = memo.with_name(f".{memo.name}.{os.getpid()}")
        scratch.write_text(text, encoding="ascii")
        os.replace(scratch, memo)


def cached_checkpoint_dir(gguf_path: str | Path, *, progress: bool = True) -> Path:
    """The converted directory for this GGUF file, converting it first if it is not cached yet.

    Raises:
        ModelLoadError: the file cannot be read or converted.
    """
    gguf_path = Path(gguf_path)
    try:
        digest = file_digest(gguf_path)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {gguf_path}: {exc}") from exc
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", gguf_path.name.removesuffix(".gguf"))
    target = cache_root() / "gguf" / f"{stem}-{digest[:16]}-v{_CONVERSION_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{stem}-", dir=target.parent))
    try:
        logger.info("converting %s once into %s (later starts read it from there)", gguf_path.name, target)
        convert_gguf(gguf_path, scratch, progress=progress)
        os.chmod(scratch, 0o755)  # mkdtemp makes it private; the cache is shared like ~/.cache/huggingface
        try:
            os.rename(scratch, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            logger.debug("another process converted %s first; using its copy", gguf_path)
        _remove_older_conversions(target)
    except (GGUFError, GGUFTokenizerError, UnsupportedQuantizationError) as exc:
        raise ModelLoadError(f"cannot load {gguf_path}: {exc}") from exc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _remove_older_conversions(target: Path) -> None:
    """Delete conversions of the same file by an older converter version (each is a full copy of the weights)."""
    prefix = target.name.rsplit("-v", 1)[0] + "-v"
    for sibling in target.parent.glob(f"{prefix}*"):
        if sibling != target and sibling.is_dir():
            shutil.rmtree(sibling, ignore_errors=True)


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
    """Write the HF-style checkpoint of a GGUF file into out_dir (which must exist)."""
    checkpoint = GGUFCheckpoint.open(gguf_path)
    config = checkpoint.hf_config()
    tokenizer = build_tokenizer(checkpoint.metadata)
    tokenizer_config = dict(tokenizer.config)
    chat_template = tokenizer_config.pop("chat_template", None)
    tokenizer.tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    if chat_template:
        (out_dir / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    _write_weights(checkpoint, out_dir, gguf_path.name, progress)
    # config.json last: its presence marks a complete directory
    _write_json(out_dir / "config.json", config)


def _write_weights(checkpoint: GGUFCheckpoint, out_dir: Path, label: str, progress: bool) -> None:
    """Dequantized tensors as safetensors shards of at most SHARD_BYTES, each written once full."""
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0

    def flush() -> None:
        file_name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(out_dir / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))

    total = len(checkpoint.reader.tensors)
    with LoadProgress(total, f"Converting {label}", "tensor", enabled=progress) as bar:
        for name, tensor in checkpoint.iter_hf_tensors():
            size = tensor.numel() * tensor.element_size()
            if shard and shard_bytes + size > SHARD_BYTES:
                flush()
                shard, shard_bytes = {}, 0
            shard[name] = tensor
            shard_bytes += size
            bar.update(1)
    if shard:
        flush()
    _write_json(out_dir / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
