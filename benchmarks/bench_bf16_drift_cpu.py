"""How far bf16 drifts from float32 on real weights, and which activation roundings cost it (CPU,
SmolLM2-135M-Instruct, the GPU parity prompts of tests/gpu/test_real_model_parity.py).

    PYTHONSAFEPATH=1 python benchmarks/bench_bf16_drift_cpu.py              # peers (minutes)
    PYTHONSAFEPATH=1 python benchmarks/bench_bf16_drift_cpu.py --roundings  # our bf16 engine's roundings
    PYTHONSAFEPATH=1 python benchmarks/bench_bf16_drift_cpu.py --operands   # which bf16 operands cost it
    PYTHONSAFEPATH=1 python benchmarks/bench_bf16_drift_cpu.py --split-steps  # float32 activations at decode only
    PYTHONSAFEPATH=1 python benchmarks/bench_bf16_drift_cpu.py --quantized    # fp8 / int8 weights, which half costs

Greedy is the argmax of each system's own logits with EOS masked for 48 tokens, as in the GPU parity test
(transformers' `generate` is not used: its processors may pick another token). Everything is compared with
the float32 SITS engine's answers.

Peers: transformers in bf16 and float32, and the float32 engine with bf16-rounded weights: identical answers
of 8 and each answer's common prefix.

--roundings: our engine in bf16 with the torch back end, batched, prefix caching off, one activation rounding
changed at a time (the model edited in place between variants): identical answers / 8, mean common prefix,
and teacher-forced over prompt + float32 answer (one prefill each): argmax agreement (EOS masked), mean KL
from float32, mean and max |Δ logprob| of the answer tokens. The roundings:
  residual  the residual stream between sublayers in float32 (`LlamaForCausalLM.residual_dtype`) or bf16
  attention attention on float32 copies (softmax probabilities not rounded to bf16 for P·V)
  norm      RMSNorm's output rounded once (normalized row times weight in float32) instead of twice
  silu      SiLU·mul in float32, rounded once, instead of SiLU rounded and the product rounded
  gemm_out  o_proj / down_proj write float32 into the float32 stream (not rounded to bf16 first)
  gemm_out_all  every projection writes float32 (bf16 operands, float32 accumulation and output, as cuBLAS
            can): RoPE from float32 q / k, SiLU·mul from float32 gate / up; only GEMM and attention operands
            (norm outputs, q / k / v, P, attention and SiLU·mul outputs) and the KV cache are rounded to bf16

--operands: the other way round. The float32 engine with its weights rounded to bf16 (8/8 identical: the peers
above), then one group of bf16 operand roundings at a time (forward hooks, the rest float32): what a precision mode
would have to keep in float32 to reach 7/8. The groups:
  gemm_in   every projection's input (qkv, o, gate_up, down, lm_head) rounded to bf16: the norms', attention's
            and SiLU·mul's outputs as bf16 tensor-core GEMMs read them
  kv        the K and V the attention reads (the new ones and the cache) rounded to bf16: a bf16 KV cache
  q         the attention's queries rounded to bf16

--quantized: what weight quantization costs on these weights, and whether its greedy misses come from the format
or from our kernels: the engine with fp8 weights (w8a8: per-channel e4m3 weights times per-token e4m3 activations;
weight-only), and int8 weight-only (group-wise), in bf16 and float32 activations (on the CPU the kernels' PyTorch
references, which the kernel tests hold the GPU kernels to), beside the float32 engine with only its projections'
inputs rounded to e4m3 per token (forward hooks: the activation half of w8a8 alone). Teacher-forced against the
float32 engine, as --roundings reports.

--split-steps: whether float32 activations could be kept where they are nearly free, in decode-only steps (the
projections read the same weights; the small-M kernels take float32 rows in one launch), and bf16 activations where
they cost twice the tensor-core work, in steps with prompt tokens. Our engine in bf16 three ways, batched: bf16
activations, float32 activations, and that split: identical answers / 8 and each answer's common prefix.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(next(i for i, p in enumerate(sys.path) if "site-packages" in p), str(Path(__file__).parents[1]))

from benchmarks.bench_torch_bf16_cpu import prefill_logprobs  # noqa: E402
from sits.kernels.reference import quantize_fp8_per_token_reference  # noqa: E402
from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from sits.runtime.engine.engine import LLMEngine  # noqa: E402
from sits.runtime.models.kernel_ops import KernelOps  # noqa: E402
from tests.gpu import test_real_model_parity as parity  # noqa: E402

# name: the roundings kept in float32 (the rest as the engine does by default in bf16, before this change)
VARIANTS: dict[str, frozenset[str]] = {
    "all bf16 (the residual stream in bf16)": frozenset(),
    "residual stream float32": frozenset({"residual"}),
    "attention P float32": frozenset({"attention"}),
    "RMSNorm output rounded once": frozenset({"norm"}),
    "SiLU·mul rounded once": frozenset({"silu"}),
    "residual float32 + norm once + SiLU·mul once": frozenset({"residual", "norm", "silu"}),
    "residual float32 + o/down GEMM outputs float32": frozenset({"residual", "gemm_out"}),
    "residual + attention + norm + SiLU·mul float32": frozenset({"residual", "attention", "norm", "silu"}),
    "only GEMM / attention operands and the KV cache in bf16": frozenset(
        {"residual", "attention", "norm", "silu", "gemm_out", "gemm_out_all"}),
}


def transformers_greedy(dtype: torch.dtype, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    path = parity.gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    answers = []
    with torch.inference_mode():
        for prompt in prompts:
            ids, cache, out = torch.tensor([prompt]), None, []
            for _ in range(parity.NEW_TOKENS):
                step = model(ids, past_key_values=cache, use_cache=True)
                cache = step.past_key_values
                logits = step.logits[0, -1].float()
                logits[parity.EOS_IDS] = float("-inf")
                out.append(int(logits.argmax()))
                ids = torch.tensor([[out[-1]]])
            answers.append(out)
    return answers


class RoundOnceOps(KernelOps):
    """KernelOps with RMSNorm's output and/or SiLU·mul computed in float32 and rounded once."""

    def __init__(self, norm: bool, silu: bool) -> None:
        self.norm, self.silu = norm, silu

    def rms_norm(self, x, weight, eps):
        if not self.norm:
            return super().rms_norm(x, weight, eps)
        xf = x.float()
        return (weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(weight.dtype)

    def silu_mul(self, gate_up):
        if not self.silu:
            return super().silu_mul(gate_up)
        gate, up = gate_up.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(gate_up.dtype)


def float32_linear(module: torch.nn.Linear):
    """The projection with bf16 operands, float32 accumulation and a float32 output."""
    bias = None if module.bias is None else module.bias.float()
    return lambda x: F.linear(x.to(module.weight.dtype).float(), module.weight.float(), bias)


def apply_variant(model, knobs: frozenset[str]) -> None:
    """Set `model` (bf16, torch back end) to the variant's roundings, whatever the previous variant set."""
    model.residual_dtype = torch.float32 if "residual" in knobs else None
    ops = RoundOnceOps("norm" in knobs, "silu" in knobs)
    backend = model.backend
    backend.__dict__.pop("forward", None)
    if "attention" in knobs:
        base = backend.forward
        dtype = model.model.embed_tokens.weight.dtype  # operands rounded to it, as the kernels' loads are
        backend.forward = lambda q, k, v, kc, vc, metadata, scale: base(
            *(t.to(dtype).float() for t in (q, k, v, kc, vc)), metadata, scale).to(dtype)
    for layer in [*model.model.layers, model.model]:
        for norm in ("input_layernorm", "post_attention_layernorm", "norm"):
            if hasattr(layer, norm):
                getattr(layer, norm).ops = ops
        if hasattr(layer, "mlp"):
            layer.mlp.ops = ops
            for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
                linear.__dict__.pop("forward", None)
                if "gemm_out" in knobs:
                    linear.forward = float32_linear(linear)
            for linear in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
                linear.__dict__.pop("forward", None)
                if "gemm_out_all" in knobs:
                    linear.forward = float32_linear(linear)


# name: the operands rounded to bf16 in the float32 engine with bf16-rounded weights (--operands)
OPERAND_VARIANTS: dict[str, frozenset[str]] = {
    "nothing (float32 compute, bf16 weights)": frozenset(),
    "GEMM inputs": frozenset({"gemm_in"}),
    "K / V (a bf16 KV cache)": frozenset({"kv"}),
    "K / V and q": frozenset({"kv", "q"}),
    "GEMM inputs, K / V and q": frozenset({"gemm_in", "kv", "q"}),
}


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def apply_operands(model, knobs: frozenset[str], handles: list) -> None:
    """Set the float32 `model` (torch back end) to round `knobs`' operands to bf16, undoing the previous variant
    (its hook handles, given and emptied)."""
    for handle in handles:
        handle.remove()
    handles.clear()
    backend = model.backend
    backend.__dict__.pop("forward", None)
    if knobs & {"kv", "q"}:
        base = backend.forward

        def forward(q, k, v, k_cache, v_cache, metadata, scale):
            if "q" in knobs:
                q = _bf16(q)
            if "kv" in knobs:
                k, v, k_cache, v_cache = (_bf16(t) for t in (k, v, k_cache, v_cache))
            return base(q, k, v, k_cache, v_cache, metadata, scale)

        backend.forward = forward
    if "gemm_in" in knobs:
        linears = [model.lm_head]
        for layer in model.model.layers:
            linears += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
        handles += [linear.register_forward_pre_hook(lambda _m, args: (_bf16(args[0]), *args[1:]))
                    for linear in linears]


def operands(free_running: bool) -> None:
    """The float32 engine with bf16-rounded weights, one group of bf16 operands at a time (OPERAND_VARIANTS)."""
    reference_engine = parity.engine("cpu", "float32", "torch", "none", True)
    prompts = parity.prompts(reference_engine.tokenizer)
    answers = [tokens for tokens, _ in parity.generate(reference_engine, prompts, one_at_a_time=False)]
    float32 = answer_logprobs(reference_engine.loaded_model.model, prompts, answers)
    reference_engine.shutdown()
    engine = cpu_engine("float32")
    model = engine.loaded_model.model
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    print("| float32 engine, bf16 weights: operands in bf16 | identical / 8 | mean common prefix | teacher-forced "
          "argmax | mean KL | answer \\|Δ logprob\\| mean / max |")
    print("|---|---|---|---|---|---|")
    handles: list = []
    for name, knobs in OPERAND_VARIANTS.items():
        apply_operands(model, knobs, handles)
        print_row(name, engine, prompts, answers, float32, free_running)
    engine.shutdown()


def print_row(name: str, engine, prompts, answers, float32: torch.Tensor, free_running: bool) -> None:
    """One variant's table row: identical answers and common prefixes (when free-running), then teacher-forced."""
    identical, mean_prefix = "-", "-"
    if free_running:
        same, prefixes = against([t for t, _ in parity.generate(engine, prompts, one_at_a_time=False)], answers)
        identical, mean_prefix = str(same), f"{sum(prefixes) / len(prefixes):.1f} {prefixes}"
    model = engine.loaded_model.model
    print(f"| {name} | {identical} | {mean_prefix} | {teacher_forced(model, prompts, answers, float32)} |", flush=True)


def against(outputs: list[list[int]], reference: list[list[int]]) -> tuple[int, list[int]]:
    """(how many answers equal the reference's, each answer's common prefix with it)."""
    pairs = list(zip(outputs, reference, strict=True))
    return sum(o == r for o, r in pairs), [parity.common_prefix(o, r) for o, r in pairs]


def cpu_engine(dtype: str = "bfloat16") -> LLMEngine:
    """The parity engine on the CPU in `dtype`, torch back end, with prefix caching off (variants change the model
    in place: no cached block may outlive the variant that computed it)."""
    config = EngineConfig(
        model=ModelConfig(model=str(parity.gguf_path()), device="cpu", dtype=dtype, max_model_len=512),
        cache=CacheConfig(block_size=16, num_blocks=512, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024),
        attention_backend="torch", enforce_eager=True,
    )
    return LLMEngine.from_config(config, progress=False)


def answer_logprobs(model, prompts: list[list[int]], answers: list[list[int]]) -> torch.Tensor:
    """log-softmax rows predicting every answer token (prompt + answer in one prefill each), [8 * 48, vocab]."""
    return prefill_logprobs(model, [p + a for p, a in zip(prompts, answers, strict=True)], [len(p) for p in prompts])


def teacher_forced(model, prompts, answers, float32: torch.Tensor) -> str:
    """Argmax agreement (EOS masked), KL and answer-token |Δ logprob| against float32's log-softmax rows."""
    tokens = torch.tensor([t for a in answers for t in a])
    ours = answer_logprobs(model, prompts, answers)
    masked = ours.clone()
    masked[:, parity.EOS_IDS] = float("-inf")
    agree = int((masked.argmax(-1) == tokens).sum())
    kl = (float32.exp() * (float32 - ours)).sum(-1).mean()
    delta = (float32 - ours).gather(1, tokens[:, None]).abs()
    return f"{agree}/{len(tokens)} ({agree / len(tokens):.2%}) | {kl:.2e} | {delta.mean():.4f} / {delta.max():.4f}"


def roundings(free_running: bool, only: list[int] | None) -> None:
    reference_engine = parity.engine("cpu", "float32", "torch", "none", True)
    prompts = parity.prompts(reference_engine.tokenizer)
    answers = [tokens for tokens, _ in parity.generate(reference_engine, prompts, one_at_a_time=False)]
    float32 = answer_logprobs(reference_engine.loaded_model.model, prompts, answers)
    reference_engine.shutdown()
    engine = cpu_engine()
    model = engine.loaded_model.model
    print("| bf16 engine, torch back end: kept in float32 | identical / 8 | mean common prefix | teacher-forced "
          "argmax | mean KL | answer \\|Δ logprob\\| mean / max |")
    print("|---|---|---|---|---|---|")
    for index, (name, knobs) in enumerate(VARIANTS.items()):
        if only is not None and index not in only:
            continue
        apply_variant(model, knobs)
        print_row(name, engine, prompts, answers, float32, free_running)
    engine.shutdown()


def split_steps() -> None:
    """bf16 activations, float32 activations, and float32 only in decode-only steps (bf16 where a step has prompt
    tokens: the prompt's K / V and the first token come from bf16 activations), each against the float32 engine."""
    reference_engine = parity.engine("cpu", "float32", "torch", "none", True)
    prompts = parity.prompts(reference_engine.tokenizer)
    reference = [tokens for tokens, _ in parity.generate(reference_engine, prompts, one_at_a_time=False)]
    reference_engine.shutdown()
    engine = cpu_engine()
    model = engine.loaded_model.model
    forward = model.forward
    modes = {"bf16 activations": (None, None), "float32 activations": (torch.float32, torch.float32),
             "bf16 in steps with prompt tokens, float32 in decode-only steps": (None, torch.float32)}
    for name, (prompt_steps, decode_steps) in modes.items():
        def per_step(input_ids, positions, kv_caches, metadata, _prompt=prompt_steps, _decode=decode_steps):
            model.use_activation_dtype(_prompt if metadata.num_prefill_tokens else _decode)
            return forward(input_ids, positions, kv_caches, metadata)

        model.forward = per_step
        same, prefixes = against([t for t, _ in parity.generate(engine, prompts, one_at_a_time=False)], reference)
        print(f"{name}: {same}/{len(reference)} identical to the float32 engine over {parity.NEW_TOKENS} tokens, "
              f"common prefixes {prefixes} (mean {sum(prefixes) / len(prefixes):.1f})", flush=True)
    model.forward = forward
    model.use_activation_dtype(None)
    engine.shutdown()


# name: (engine dtype, --quantization, --fp8-mode); "activations" is the float32 engine with hooks (--quantized)
QUANTIZED: dict[str, tuple[str, str, str]] = {
    "fp8 w8a8, bf16 activations (the GPU parity step's configuration)": ("bfloat16", "fp8", "w8a8"),
    "fp8 weight-only, bf16 activations": ("bfloat16", "fp8", "weight-only"),
    "int8 weight-only, bf16 activations": ("bfloat16", "int8", "auto"),
    "fp8 w8a8, float32 activations": ("float32", "fp8", "w8a8"),
    "fp8 weight-only, float32 activations": ("float32", "fp8", "weight-only"),
    "float32 engine, projection inputs rounded to e4m3 per token": ("float32", "activations", ""),
}


def quantized_engine(dtype: str, quantization: str, fp8_mode: str) -> LLMEngine:
    """The parity engine on the CPU (torch back end, prefix caching off) with weights quantized at load; with
    quantization "activations", the float32 engine whose projections (not lm_head, as fp8 skips it) read their input
    rounded to e4m3 per token: x -> quantize -> dequantize, the activation half of w8a8 with float32 weights."""
    activations = quantization == "activations"
    config = EngineConfig(
        model=ModelConfig(model=str(parity.gguf_path()), device="cpu", dtype=dtype,
                          quantization="none" if activations else quantization, fp8_mode=fp8_mode or "auto",
                          max_model_len=512),
        cache=CacheConfig(block_size=16, num_blocks=512, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024),
        attention_backend="torch", enforce_eager=True,
    )
    engine = LLMEngine.from_config(config, progress=False)
    if activations:
        def e4m3_per_token(_module, args):
            rows = args[0].reshape(-1, args[0].shape[-1])
            x_fp8, scale = quantize_fp8_per_token_reference(rows)
            return ((x_fp8.float() * scale).to(args[0].dtype).reshape(args[0].shape), *args[1:])

        for layer in engine.loaded_model.model.model.layers:
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj):
                linear.register_forward_pre_hook(e4m3_per_token)
    return engine


def quantized() -> None:
    """Each QUANTIZED configuration against the float32 engine: identical answers, prefixes, teacher-forced."""
    reference_engine = parity.engine("cpu", "float32", "torch", "none", True)
    prompts = parity.prompts(reference_engine.tokenizer)
    answers = [tokens for tokens, _ in parity.generate(reference_engine, prompts, one_at_a_time=False)]
    float32 = answer_logprobs(reference_engine.loaded_model.model, prompts, answers)
    reference_engine.shutdown()
    print("| configuration | identical / 8 | mean common prefix | teacher-forced argmax | mean KL | answer \\|Δ logprob\\| "
          "mean / max |")
    print("|---|---|---|---|---|---|")
    for name, (dtype, quantization, fp8_mode) in QUANTIZED.items():
        engine = quantized_engine(dtype, quantization, fp8_mode)
        print_row(name, engine, prompts, answers, float32, True)
        engine.shutdown()


def peers() -> None:
    reference_engine = parity.engine("cpu", "float32", "torch", "none", True)
    prompts = parity.prompts(reference_engine.tokenizer)
    reference = [tokens for tokens, _ in parity.generate(reference_engine, prompts, one_at_a_time=False)]
    rounded = parity.engine("cpu", "float32", "torch", "none", True)
    with torch.no_grad():
        for param in rounded.loaded_model.model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    systems = {
        "float32 engine, weights rounded to bf16": [t for t, _ in parity.generate(rounded, prompts, False)],
        "transformers bf16": transformers_greedy(torch.bfloat16, prompts),
        "transformers float32": transformers_greedy(torch.float32, prompts),
    }
    for name, answers in systems.items():
        same, prefixes = against(answers, reference)
        print(f"{name}: {same}/{len(reference)} identical to the float32 engine over {parity.NEW_TOKENS} tokens, "
              f"common prefixes {prefixes}")


def main() -> int:
    """Peers, or with --roundings our engine's variants; prints the comparison and the time taken."""
    start = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--roundings", action="store_true", help="our bf16 engine, one rounding changed at a time")
    parser.add_argument("--operands", action="store_true",
                        help="the float32 engine with bf16 weights, one group of bf16 operands at a time")
    parser.add_argument("--split-steps", action="store_true",
                        help="float32 activations in decode-only steps, bf16 where a step has prompt tokens")
    parser.add_argument("--quantized", action="store_true",
                        help="fp8 (w8a8, weight-only) and int8 weights, and e4m3 activations alone, against float32")
    parser.add_argument("--teacher-forced-only", action="store_true",
                        help="with --roundings or --operands: skip generation")
    parser.add_argument("--only", type=lambda text: [int(i) for i in text.split(",")],
                        help="with --roundings: these variants (indices into VARIANTS, comma-separated)")
    args = parser.parse_args()
    if args.roundings:
        roundings(free_running=not args.teacher_forced_only, only=args.only)
    elif args.operands:
        operands(free_running=not args.teacher_forced_only)
    elif args.split_steps:
        split_steps()
    elif args.quantized:
        quantized()
    else:
        peers()
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
