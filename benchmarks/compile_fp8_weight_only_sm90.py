"""Compile every shipped config of the fp8 weight-only GEMM without a GPU: the H200 (sm_90a) and the A100 (sm_80).

    python benchmarks/compile_fp8_weight_only_sm90.py [--quick] [--json out.json]

sits.kernels.fp8_weight_only_gemm's kernel, each config of its decode-sized (split-K, plain and swapped
operands) and prefill-sized lists, compiled as a Llama-3-8B launch specializes it (bf16 activations, whole
K tiles): with the native e4m3 conversion for sm_90a, and with the integer decoding ("bits", the weight
read as uint8) for sm_80, where Triton has no e4m3 type. Then each schedule with a ragged K (EVEN_K off:
the masked loads). ptxas reports registers and spills (see sm90_compile.py). --quick: the first config of
each list (plain, swapped, prefill) instead of all. Run it without TRITON_INTERPRET: the interpreter does
not compile, and it runs a `return` inside a constexpr `if` of a called function as Python does, where the
compiler goes on past it (the bug this check was written for).
"""

from __future__ import annotations

import argparse

import triton
from compile_gemm_small_m_sm90 import short
from sm90_compile import compile_sm90, report_rows

from sits.kernels import fp8_weight_only_gemm as wo

_ALIGNED = ("x_ptr", "w_ptr", "w_scale_ptr", "c_ptr", "N", "K", "stride_xm", "stride_wn", "stride_cm")
_CAPABILITY = {"native": 90, "bits": 80}


def compile_one(config: triton.Config, decode: str, even_k: bool) -> dict:
    """One config with one decoding compiled for its GPU: registers, spills, shared memory, wgmma or not."""
    small = config in wo._SMALL_M_CONFIGS
    types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv" if decode == "native" else "*u8", "w_scale_ptr": "*fp32",
             "c_ptr": "*fp32" if small else "*bf16"}
    constexprs = dict(config.kwargs, ATOMIC=small, EVEN_K=even_k, E4M3_BITS=decode == "bits")
    aligned = _ALIGNED if even_k else tuple(a for a in _ALIGNED if a not in ("K", "stride_xm", "stride_wn"))
    return compile_sm90(wo._fp8_weight_only_kernel, types, constexprs, aligned, config, _CAPABILITY[decode])


def _describe(config: triton.Config, decode: str, even_k: bool) -> dict:
    small = config in wo._SMALL_M_CONFIGS
    return {"config": short(config), "split_k": config.kwargs.get("SPLIT_K", 1), "small_m": small,
            "decode": decode, "sm": _CAPABILITY[decode], "even_k": even_k}


def launches(quick: bool) -> list[tuple[triton.Config, str, bool]]:
    """Every config with both decodings and whole K tiles, then each first config with a ragged K."""
    plain = [c for c in wo._SMALL_M_CONFIGS if not c.kwargs["SWAP_AB"]]
    swapped = [c for c in wo._SMALL_M_CONFIGS if c.kwargs["SWAP_AB"]]
    firsts = [plain[0], swapped[0], wo._LARGE_M_CONFIGS[0]]
    configs = firsts if quick else [*plain, *swapped, *wo._LARGE_M_CONFIGS]
    whole = [(c, decode, True) for c in configs for decode in wo.DECODES]
    return whole + [(c, decode, False) for c in firsts for decode in wo.DECODES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the first config of each list, not all")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    report_rows(launches(args.quick), _describe, compile_one, args.json)


if __name__ == "__main__":
    main()
