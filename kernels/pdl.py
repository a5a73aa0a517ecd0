"""Programmatic dependent launch (PDL) for the decode path's kernels.

On Hopper (SM 9.0) and later, a kernel launched with PDL may be scheduled while the kernel before it in the
stream is still finishing, so its launch latency and start-up hide behind that kernel's tail. A decode step
at batch 1 is ~10 kernels a layer of a few microseconds each, so the gaps between them are a visible share
of the step.

    pdl_launch_options(device) -> {} or {"USE_PDL": mode, "launch_pdl": True}: a launch's extra keywords
    gemm_pdl_launch_options(w) -> the same for a decode GEMM over weight w, plus PF_TOTAL in the prefetch modes
    pdl_prefetch_rows(...)     a decode GEMM's first statement: its weight rows' first bytes queued for L2
    pdl_wait(USE_PDL)          the first statement of each kernel that takes USE_PDL (no-op when false)
    pdl_gemm_wait(USE_PDL)     a decode GEMM's wait (after its `pdl_prefetch_rows`)
    pdl_gemm_loop_done(USE_PDL)  a decode GEMM's trigger, once past its K loop (prefetch modes only)

Ordering: a kernel launched this way waits at its first statement for the previous grid to finish and
flush its memory (`griddepcontrol.wait`), before it reads or writes anything (a decode GEMM may first queue
its weight, which no kernel of a step writes, for L2: a hint that reads nothing into the program). So every
memory effect keeps
the stream's order, and a chain of such kernels waits transitively: a kernel cannot finish before its own
wait has returned. Kernels that are not SITS's (cuBLAS, PyTorch's) launch as before and wait for the whole
grid before them; a PDL kernel after one of them starts when it completes. Inside CUDA graphs the launches
become programmatic edges.

When the next grid may launch (SITS_PDL's value):
  * "1" / "true" / "on" / "yes" (PDL_AT_EXIT): when every program of this grid has exited (the implicit
    trigger). The next grid's launch and start-up overlap this grid's memory flush, and its waiting
    programs never hold a multiprocessor this grid could use.
  * "early" (PDL_EARLY): right after the wait (`griddepcontrol.launch_dependents`), so the next grid's
    programs are resident and waiting while this one runs. Measured on an H200 (2026-12-02, batch 1,
    Llama-3-8B shape): the decode step went from 4.77 to 5.56 ms; kept for measurement only.
  * "prefetch" (PDL_PREFETCH): the decode GEMMs (the small-M direct and split-K kernels) start by queueing the
    first bytes of their programs' weight rows for L2 (`pdl_prefetch_rows`: bulk prefetches, a hint with no
    completion) and only then wait; a weight does not depend on the grid before, so its bytes may move while
    that grid finishes. Each GEMM lets the next grid launch once its programs are past their K loop
    (`pdl_gemm_loop_done`), so the next grid's start overlaps its epilogue. Other kernels launch the next
    grid at exit. The prefetch's total over a grid is SITS_PDL_PREFETCH_MB (default 24 MB, half the H200's
    L2), spread evenly over its programs.
  * "prefetch-eager" (PDL_PREFETCH_EAGER): the same, and every kernel that is not a GEMM lets the next grid
    launch at its first statement, before its own wait. A run of small kernels (RoPE + KV write, decode
    attention, its merge) then launches the GEMM after them at once: its weight prefetch runs beside the
    attention, which leaves HBM mostly idle at batch 1. The chain stays ordered: each kernel's wait returns
    only once the grid before it has finished, and that grid finished only after its own wait.

Off unless SITS_PDL is set. Measured on an H200 (2026-12-02), neither of the first two modes shortened a decode
step: inside a replayed CUDA graph the kernels already follow each other within a microsecond
(docs/cuda-graphs.md; the GPU profile steps `prof1-pdl`, `prof1-pdlearly`, `prof32-pdl`,
`prof1-pdlpf`, `prof1-pdlpfeager` of benchmarks/gpu_profile_run.sh measure them again).
Never under Triton's interpreter.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sits.kernels.launch_utils import is_interpreter

PDL_ENV = "SITS_PDL"
PREFETCH_ENV = "SITS_PDL_PREFETCH_MB"
DEFAULT_PREFETCH_MB = 24.0
PDL_MIN_CAPABILITY = (9, 0)
# the kernels' USE_PDL constexpr
PDL_OFF, PDL_AT_EXIT, PDL_EARLY, PDL_PREFETCH, PDL_PREFETCH_EAGER = 0, 1, 2, 3, 4
_ON_VALUES = ("1", "true", "on", "yes")
_NAMED_MODES = {"early": PDL_EARLY, "prefetch": PDL_PREFETCH, "prefetch-eager": PDL_PREFETCH_EAGER}
_PREFETCH_ALIGN = 16  # the bulk prefetch's address and size granule (bytes)


def pdl_mode() -> int:
    """The mode SITS_PDL asks for: PDL_AT_EXIT for "1", "true", "on" or "yes", PDL_EARLY for "early",
    PDL_PREFETCH for "prefetch", PDL_PREFETCH_EAGER for "prefetch-eager", else PDL_OFF (the default)."""
    value = os.environ.get(PDL_ENV, "").strip().lower()
    if value in _NAMED_MODES:
        return _NAMED_MODES[value]
    return PDL_AT_EXIT if value in _ON_VALUES else PDL_OFF


def prefetch_total_bytes() -> int:
    """The bytes a GEMM grid may queue for L2 before its wait in the prefetch modes: SITS_PDL_PREFETCH_MB
    (a number of MB, 0 for none; default 24) in bytes. Raises ValueError on a negative or unreadable value."""
    raw = os.environ.get(PREFETCH_ENV, "").strip()
    try:
        mb = float(raw) if raw else DEFAULT_PREFETCH_MB
    except ValueError:
        raise ValueError(f"{PREFETCH_ENV} must be a number of MB, got {raw!r}") from None
    if not mb >= 0:
        raise ValueError(f"{PREFETCH_ENV} must be 0 or more, got {raw!r}")
    return int(mb * 1e6)


def pdl_requested() -> bool:
    """Whether SITS_PDL asks for programmatic dependent launch in either mode."""
    return pdl_mode() != PDL_OFF


def pdl_supported(device: torch.device) -> bool:
    """Whether `device` can launch with PDL: a CUDA GPU of SM 9.0 or later, not Triton's interpreter."""
    if is_interpreter() or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= PDL_MIN_CAPABILITY


def pdl_launch_options(device: torch.device) -> dict:
    """The extra keywords of a launch on `device`: USE_PDL (the kernel's constexpr: PDL_AT_EXIT or PDL_EARLY)
    and Triton's launch_pdl when PDL is requested and supported, else none (the kernel's USE_PDL default,
    False: PDL_OFF)."""
    mode = pdl_mode()
    if mode != PDL_OFF and pdl_supported(device):
        return {"USE_PDL": mode, "launch_pdl": True}
    return {}


def gemm_pdl_launch_options(w: torch.Tensor) -> dict:
    """`pdl_launch_options` for a GEMM streaming the weight w [N, K] (row-major, any row stride), plus in the
    prefetch modes PF_TOTAL: the bytes its grid queues for L2 before the wait (`prefetch_total_bytes`), 0
    where w's rows do not start on the bulk prefetch's 16-byte granule."""
    options = pdl_launch_options(w.device)
    if options.get("USE_PDL", PDL_OFF) in (PDL_PREFETCH, PDL_PREFETCH_EAGER):
        aligned = w.data_ptr() % _PREFETCH_ALIGN == 0 and w.stride(0) * w.element_size() % _PREFETCH_ALIGN == 0
        options["PF_TOTAL"] = prefetch_total_bytes() if aligned else 0
    return options


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the grid before this one to finish and flush (no-op when USE_PDL is false: PDL_OFF). With
    PDL_EARLY, then let the next grid launch at once; with PDL_PREFETCH_EAGER, let it launch first. The first
    statement of a kernel that is not a decode GEMM: nothing may be read or written before it."""
    if USE_PDL:
        if USE_PDL == 4:  # PDL_PREFETCH_EAGER
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if USE_PDL == 2:  # PDL_EARLY
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_gemm_wait(USE_PDL: tl.constexpr):
    """A GEMM's wait: as `pdl_wait`, without the launch at the first statement in PDL_PREFETCH_EAGER (a GEMM
    lets the next grid launch after its K loop instead: `pdl_gemm_loop_done`)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if USE_PDL == 2:  # PDL_EARLY
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_gemm_loop_done(USE_PDL: tl.constexpr):
    """In the prefetch modes, let the next grid launch: called by a GEMM's programs once past their K loop."""
    if USE_PDL >= 3:  # PDL_PREFETCH, PDL_PREFETCH_EAGER
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_prefetch_rows(row_ptrs, row_elems, USE_PDL: tl.constexpr, PF_TOTAL: tl.constexpr):
    """In the prefetch modes, queue for L2 the first bytes of each of a program's weight rows, before its wait.

    row_ptrs: [ROWS] pointers to each row's first element this program reads (16-byte aligned: the host's
    `gemm_pdl_launch_options` sets PF_TOTAL to 0 otherwise); row_elems: how many elements each row has from
    there (a scalar, a multiple of 8 at 2-byte elements). Each row gets min(row_elems, PF_TOTAL / (programs x
    ROWS)) elements' bytes, rounded down to 16 bytes, as one bulk prefetch (sm_90: a hint, no completion).
    """
    if USE_PDL >= 3 and PF_TOTAL > 0:  # PDL_PREFETCH, PDL_PREFETCH_EAGER, with a budget
        programs = tl.num_programs(0) * tl.num_programs(1)
        elem_bytes: tl.constexpr = row_ptrs.dtype.element_ty.primitive_bitwidth // 8
        per_row = PF_TOTAL // (programs * row_ptrs.shape[0])
        nbytes = tl.minimum(row_elems * elem_bytes, per_row) // 16 * 16
        sizes = tl.zeros(row_ptrs.shape, dtype=tl.int32) + nbytes.to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [row_ptrs, sizes], dtype=tl.int32, is_pure=False, pack=1,
        )
