"""The decoder carries its residual stream from layer to layer and fuses every add into the next norm.

Each `LlamaDecoderLayer` takes (hidden, residual) and returns (mlp_out, residual); the next layer's input norm
(or the model's final norm) adds mlp_out to the stream in its fused add + norm, and the first layer's input norm
starts the stream (the embedding rows cast to the stream's dtype). The arithmetic is unchanged: the forward is
compared bit for bit with the layer-by-layer forward written out here from the `KernelOps` primitives (a norm,
attention, the fused add + norm, the MLP, then a separate add), on a 4-layer random Llama, prefill and decode,
float32 and bfloat16 (float32 stream and bf16 stream) with the torch ops, float16 with the Triton kernels
(Triton's interpreter on a CPU). The launch count test counts what one decode step runs outside attention.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.models.config import LlamaConfig
from sits.runtime.models.kernel_ops import TORCH_OPS, KernelOps
from sits.runtime.models.llama import LlamaForCausalLM
from sits.runtime.models.random_model import random_loaded_model
from tests.support.model_driver import PagedKVCache, PagedSequence, build_metadata

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LAYERS = 4
SMALL = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                    eos_token_ids=[2])
BLOCK_SIZE = 4


def small_model(backend, dtype: torch.dtype) -> LlamaForCausalLM:
    """The seeded random model in `dtype` on DEVICE, with norm weights that are not all ones."""
    model = random_loaded_model(SMALL, backend, "cpu", torch.float32, seed=11).model
    with torch.no_grad():
        generator = torch.Generator().manual_seed(5)
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.copy_(1.0 + 0.5 * torch.randn(param.shape, generator=generator))
    return model.to(device=DEVICE, dtype=dtype)


def reference_forward(model: LlamaForCausalLM, ops: KernelOps, input_ids, positions, kv_caches, metadata):
    """The unfused layout, from the primitives: each layer norms the stream, adds attention in the fused add +
    norm, then adds the MLP output with a separate add; the final norm reads the stream. [N, hidden] model dtype."""
    hidden = model.model.embed_tokens(input_ids)
    if model.residual_dtype is not None:
        hidden = hidden.to(model.residual_dtype)
    for layer, kv_cache in zip(model.model.layers, kv_caches, strict=True):
        first, second = layer.input_layernorm, layer.post_attention_layernorm
        attention = layer.self_attn(ops.rms_norm(hidden, first.weight, first.eps), positions, model.cos_sin_cache,
                                    kv_cache, metadata)
        normed, hidden = ops.add_rms_norm(attention, hidden, second.weight, second.eps)
        hidden = hidden + layer.mlp(normed)
    return ops.rms_norm(hidden, model.model.norm.weight, model.model.norm.eps)


@torch.inference_mode()
def compare_steps(model: LlamaForCausalLM, ops: KernelOps) -> int:
    """Prefill two prompts (one step), then 3 batched decode steps, through the model's forward and through
    `reference_forward`, each with its own KV cache; asserts every step's hidden states are bit-identical.
    Returns how many steps were compared."""
    prompts = [[5, 17, 99, 3, 250, 42, 8], [7, 7, 130, 64, 1]]
    runs: dict[str, tuple[PagedKVCache, list[PagedSequence]]] = {
        name: (PagedKVCache(model, num_blocks=16, block_size=BLOCK_SIZE), [PagedSequence(list(p)) for p in prompts])
        for name in ("carried", "reference")
    }
    forwards: dict[str, Callable] = {"carried": model, "reference": lambda *a: reference_forward(model, ops, *a)}
    steps = 0
    for new_tokens in ([len(p) for p in prompts], [1, 1], [1, 1], [1, 1]):
        hidden = {}
        for name, (cache, seqs) in runs.items():
            chunks = list(zip(seqs, new_tokens, strict=True))
            positions, metadata, _ = build_metadata(cache, chunks, DEVICE)
            ids = [seq.token_ids[seq.num_cached + j] for seq, new in chunks for j in range(new)]
            hidden[name] = forwards[name](torch.tensor(ids, device=DEVICE), positions, cache.caches, metadata)
            for seq, new in chunks:
                seq.num_cached += new
                if seq.num_cached == len(seq.token_ids):  # the next step's input: any token will do
                    seq.token_ids.append(37 * len(seq.token_ids) % SMALL.vocab_size)
        assert hidden["carried"].dtype == next(model.parameters()).dtype
        assert torch.equal(hidden["carried"], hidden["reference"]), f"step {steps} differs"
        steps += 1
    return steps


@pytest.mark.parametrize(("dtype", "stream"), [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, None),  # the stream in the model dtype
])
def test_torch_ops_forward_is_bit_identical_to_the_unfused_layout(dtype, stream):
    model = small_model(TorchAttentionBackend(), dtype)
    model.residual_dtype = stream
    assert compare_steps(model, TORCH_OPS) == 4


def test_triton_forward_is_bit_identical_to_the_unfused_layout():
    """float16 (what Triton's interpreter computes correctly; bfloat16 too on a GPU), float32 stream."""
    pytest.importorskip("triton")
    from sits.runtime.attention.triton import TritonAttentionBackend

    backend = TritonAttentionBackend()
    if backend.unsupported_reason(DEVICE, torch.float16, SMALL.head_dim) is not None:
        pytest.skip(backend.unsupported_reason(DEVICE, torch.float16, SMALL.head_dim))
    dtypes = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
    for dtype in dtypes:
        model = small_model(backend, dtype)
        assert compare_steps(model, backend.kernel_ops()) == 4


@torch.inference_mode()
def test_layers_return_the_mlp_output_and_the_float32_stream():
    model = small_model(TorchAttentionBackend(), torch.bfloat16)
    outputs = []
    hooks = [layer.register_forward_hook(lambda _, args, out: outputs.append((args[1], *out)))
             for layer in model.model.layers]
    try:
        cache = PagedKVCache(model, num_blocks=4, block_size=BLOCK_SIZE)
        positions, metadata, _ = build_metadata(cache, [(PagedSequence([3, 4, 5]), 3)], DEVICE)
        model(torch.tensor([3, 4, 5], device=DEVICE), positions, cache.caches, metadata)
    finally:
        for hook in hooks:
            hook.remove()
    assert [residual_in is None for residual_in, _, _ in outputs] == [True] + [False] * (LAYERS - 1)
    assert all(mlp_out.dtype == torch.bfloat16 and residual.dtype == torch.float32 for _, mlp_out, residual in outputs)


# -- launches ----------------------------------------------------------------------------------

# aten ops that launch nothing on a GPU (metadata, views, allocation).
NO_LAUNCH = {"view", "_unsafe_view", "reshape", "t", "transpose", "split", "split_with_sizes", "slice", "select",
             "detach", "alias", "expand", "unsqueeze", "squeeze", "as_strided", "permute", "empty", "empty_like",
             "empty_strided", "lift_fresh"}
GEMMS = {"linear", "mm", "addmm"}  # one GEMM launch each (which one runs depends on the device and dtype)


class CountingOps(KernelOps):
    """Counts the calls of each `KernelOps` op (one kernel each with the Triton ops) around another ops object."""

    def __init__(self, inner: KernelOps, depth: list[int], counts: Counter) -> None:
        self.inner, self.depth, self.counts = inner, depth, counts

    def _call(self, name: str, *args):
        self.counts[f"ops.{name}"] += 1
        self.depth[0] += 1
        try:
            return getattr(self.inner, name)(*args)
        finally:
            self.depth[0] -= 1

    def rms_norm(self, *args):
        return self._call("rms_norm", *args)

    def add_rms_norm(self, *args):
        return self._call("add_rms_norm", *args)

    def stream_rms_norm(self, *args):
        return self._call("stream_rms_norm", *args)

    def silu_mul(self, *args):
        return self._call("silu_mul", *args)


class OutsideOps(TorchDispatchMode):
    """Records the launching aten ops that run outside a counted op (depth 0)."""

    def __init__(self, depth: list[int], counts: Counter) -> None:
        super().__init__()
        self.depth, self.counts = depth, counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.depth[0] == 0 and name not in NO_LAUNCH:
            self.counts["gemm" if name in GEMMS else f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))


def count_decode_step(model: LlamaForCausalLM, batch: int) -> Counter:
    """What one decode step of `batch` sequences runs outside attention: one entry per KernelOps call
    (`ops.*`), per attention back-end call (`attention.*`), per GEMM (`gemm`) and per other launching aten op
    (`aten.*`)."""
    depth, counts = [0], Counter()
    ops = CountingOps(model.model.norm.ops, depth, counts)
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops
    backend = model.backend
    for method in ("rope_and_cache_write", "forward"):
        bound = getattr(backend, method)

        def counted(*args, _bound=bound, _name=method, **kwargs):
            counts[f"attention.{_name}"] += 1
            depth[0] += 1
            try:
                return _bound(*args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(backend, method, counted)
    try:
        cache = PagedKVCache(model, num_blocks=4 * batch, block_size=BLOCK_SIZE)
        seqs = [PagedSequence([3 + i, 4, 5, 6]) for i in range(batch)]
        with torch.inference_mode():
            positions, metadata, _ = build_metadata(cache, [(s, 3) for s in seqs], DEVICE)
            model(torch.tensor([t for s in seqs for t in s.token_ids[:3]], device=DEVICE), positions, cache.caches,
                  metadata)
            for seq in seqs:
                seq.num_cached = 3
            positions, metadata, _ = build_metadata(cache, [(s, 1) for s in seqs], DEVICE)
            ids = torch.tensor([s.token_ids[3] for s in seqs], device=DEVICE)
            counts.clear()
            with OutsideOps(depth, counts):
                model(ids, positions, cache.caches, metadata)
    finally:
        for method in ("rope_and_cache_write", "forward"):
            delattr(backend, method)
        for module in model.modules():
            if hasattr(module, "ops"):
                module.ops = ops.inner
    return counts


def test_a_decode_step_runs_two_norms_a_layer_plus_one_and_no_separate_add():
    model = small_model(TorchAttentionBackend(), torch.bfloat16)  # a float32 stream: the cast is fused too
    counts = count_decode_step(model, batch=2)
    launches = sum(n for name, n in counts.items() if not name.startswith("attention."))
    print(f"\nRESULT one decode step of a {LAYERS}-layer bf16 model, outside attention: {launches} launches "
          f"({', '.join(f'{name} {n}' for name, n in sorted(counts.items()))})")
    assert counts == Counter({
        "aten.embedding": 1,
        "ops.stream_rms_norm": 1,  # layer 0's input norm, the stream's float32 cast fused in
        "ops.add_rms_norm": 2 * LAYERS,  # the other input norms, every post-attention norm, the final norm
        "gemm": 4 * LAYERS,  # qkv, o, gate_up, down
        "ops.silu_mul": LAYERS,
        "attention.rope_and_cache_write": LAYERS,
        "attention.forward": LAYERS,
    })
