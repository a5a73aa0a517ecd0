"""The runtime pod's side of LoRA adapters: `sits serve` flags, and the volumes their URIs need (pure).

- `pvc://claim/path`: the claim mounted read-only at `/mnt/lora/<name>` with `path` as its subPath
  (the base model's volume when it is the same claim, one volume per other claim);
- `hf://org/name[@revision]`: passed through; the runtime downloads it into HF_HOME with the base
  model's hub helper, so the pod gets the same HF cache emptyDir a hub base model gets;
- `file:///path`: a directory inside the image, nothing to mount.
"""

from __future__ import annotations

from typing import Any

from sits.operator.spec_lora import LoraAdapterSpec, LoraSpec

LORA_DIR = "/mnt/lora"
HF_SCHEME = "hf://"
PVC_SCHEME = "pvc://"


def _claim_and_path(uri: str) -> tuple[str, str]:
    """(claim, path inside it without empty segments) of a pvc:// URI."""
    claim, _, path = uri[len(PVC_SCHEME):].partition("/")
    return claim, "/".join(part for part in path.split("/") if part)


def adapter_path(adapter: LoraAdapterSpec) -> str:
    """Where the runtime finds the adapter: a directory in the pod, or the hf:// URI it downloads."""
    if adapter.uri.startswith(PVC_SCHEME):
        return f"{LORA_DIR}/{adapter.name}"
    if adapter.uri.startswith(HF_SCHEME):
        return adapter.uri
    return adapter.uri[len("file://"):]  # file:///path -> /path inside the image


def lora_args(lora: LoraSpec) -> list[str]:
    """`--enable-lora --lora-modules name=path ... --max-loras N --max-lora-rank R`; none without adapters."""
    if not lora.adapters:
        return []
    modules = [f"{adapter.name}={adapter_path(adapter)}" for adapter in lora.adapters]
    return ["--enable-lora", "--lora-modules", *modules,
            "--max-loras", str(lora.slots), "--max-lora-rank", str(lora.max_lora_rank)]


def lora_downloads_from_hub(lora: LoraSpec) -> bool:
    """Some adapter comes from the Hugging Face Hub (the pod needs a writable HF_HOME)."""
    return any(adapter.uri.startswith(HF_SCHEME) for adapter in lora.adapters)


def build_lora_volumes(lora: LoraSpec, base_uri: str, base_volume: str) -> tuple[list[dict[str, Any]],
                                                                                 list[dict[str, Any]]]:
    """(volumes, volumeMounts) for the pvc:// adapters. `base_volume` is the volume already holding the
    base model's claim when `base_uri` is pvc:// (reused for adapters on that claim)."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    claim_volumes: dict[str, str] = {}
    if base_uri.startswith(PVC_SCHEME):
        claim_volumes[_claim_and_path(base_uri)[0]] = base_volume
    for adapter in lora.adapters:
        if not adapter.uri.startswith(PVC_SCHEME):
            continue
        claim, path = _claim_and_path(adapter.uri)
        if claim not in claim_volumes:
            claim_volumes[claim] = f"lora-{len(volumes)}"
            volumes.append({"name": claim_volumes[claim],
                            "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mount: dict[str, Any] = {"name": claim_volumes[claim], "mountPath": adapter_path(adapter), "readOnly": True}
        if path:
            mount["subPath"] = path
        mounts.append(mount)
    return volumes, mounts
