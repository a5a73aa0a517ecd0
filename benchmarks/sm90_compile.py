"""Compiling a Triton kernel for the H200 (sm_90a) without a GPU, and ptxas's report on it.

Shared by the benchmarks/compile_*_sm90.py scripts (each names its kernel's launches). A kernel is
compiled as a real launch specializes it (`aligned`: the pointers and integers Triton would see as
multiples of 16), then the ptxas bundled with Triton assembles the PTX for sm_90a and reports registers
and spill bytes (CompiledKernel.n_regs needs a GPU, hence ptxas); shared memory comes from Triton's
metadata, and "wgmma" says whether a dot became Hopper's warpgroup MMA. Run without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Sequence

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def ptxas_report(ptx: str, arch: str = "sm_90a") -> dict:
    """Registers and spill bytes of the PTX's kernel, from `ptxas -arch=ARCH -v`."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas-blackwell")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        report = subprocess.run([ptxas, f"-arch={arch}", "-v", f.name, "-o", "/dev/null"], capture_output=True,
                                text=True, check=False).stderr
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return {"regs": int(regs.group(1)) if regs else None,
            "spill_stores": int(spills.group(1)) if spills else None,
            "spill_loads": int(spills.group(2)) if spills else None}


def compile_sm90(fn, types: dict[str, str], constexprs: dict, aligned: Iterable[str], config: triton.Config,
                 capability: int = 90) -> dict:
    """`fn` (a JITFunction) compiled for sm_90a (or `capability`: 80 is the A100) with `config`'s warps,
    stages (and maxnreg).

    Args:
        types: the non-constexpr arguments' Triton types ("*bf16", "i32", "fp32"); arguments not named
            here and not in `constexprs` are "i32".
        constexprs: the compile-time arguments' values (a constexpr with a default, e.g. USE_PDL, takes it unless given).
        aligned: arguments specialized as multiples of 16.
    Returns:
        shared_bytes, wgmma, griddepcontrol (how many grid-dependency instructions the PTX holds: programmatic
        dependent launch, sits.kernels.pdl), evict_first / evict_last (how many L2 evict-first / evict-last cache
        policies it creates: a load's eviction_policy, l2_prefetch's evict_last), bulk_prefetches (bulk L2 prefetch
        instructions, sits.kernels.l2_prefetch), regs, spill_stores, spill_loads.
    """
    constexprs = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default} | dict(constexprs)
    signature = {name: types.get(name, "i32") for name in fn.arg_names if name not in constexprs}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if getattr(config, "maxnreg", None):
        options["maxnreg"] = config.maxnreg
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", capability, 32), options=options)
    ptx = compiled.asm["ptx"]
    arch = "sm_90a" if capability == 90 else f"sm_{capability}"
    return {"shared_bytes": compiled.metadata.shared, "wgmma": "wgmma" in ptx,
            "griddepcontrol": ptx.count("griddepcontrol."), "evict_first": ptx.count("L2::evict_first"),
            "evict_last": ptx.count("L2::evict_last"), "bulk_prefetches": ptx.count("cp.async.bulk.prefetch"),
            **ptxas_report(ptx, arch)}


def report_rows(launches: Sequence, describe: Callable[..., dict], compile_launch: Callable[..., dict],
                json_path: str | None) -> list[dict]:
    """For each launch (a tuple of arguments): describe(*launch), then compile_launch(*launch)'s figures
    or the error it raised; each row printed as a JSON line, all written to json_path when given."""
    rows = []
    for launch in launches:
        row = describe(*launch)
        try:
            row.update(compile_launch(*launch))
        except Exception as error:  # noqa: BLE001 - report every launch
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return rows
