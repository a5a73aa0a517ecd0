"""Programmatic dependent launch (PDL) for the decode path's kernels.

On Hopper (SM 9.0) and later, a kernel launched with PDL may be scheduled while the kernel before it in the
stream is still finishing, so its launch latency and start-up hide behind that kernel's tail. A decode step
at batch 1 is ~10 kernels a layer of a few microseconds each, so the gaps between them are a visible share
of the step.

    pdl_launch_options(device) -> {} or {"USE_PDL": mode, "launch_pdl": True}: a launch's extra keywords
    pdl_wait(USE_PDL)          the first statement of each kernel that takes USE_PDL (no-op when false)

Ordering: a kernel launched this way waits at its first statement for the previous grid to finish and
flush its memory (`griddepcontrol.wait`), before it reads or writes anything. So every memory effect keeps
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

Off unless SITS_PDL is set. Measured on an H200 (2026-12-02), neither mode shortened a decode step: inside a
replayed CUDA graph the kernels already follow each other within a microsecond (docs/cuda-graphs.md; the GPU
profile steps `prof1-pdl`, `prof1-pdlearly`, `prof32-pdl` of benchmarks/gpu_profile_run.sh measure it again).
Nor did having the decode GEMMs queue their weight for L2 before their wait, with the next grid launched after
their K loop (2026-12-03, benchmarks/RESULTS.md: batch 1 4.681 -> 4.673-4.806 ms, batch 32 6.558 -> 7.037 ms).
Never under Triton's interpreter.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sits.kernels.launch_utils import is_interpreter

PDL_ENV = "SITS_PDL"
PDL_MIN_CAPABILITY = (9, 0)
PDL_OFF, PDL_AT_EXIT, PDL_EARLY = 0, 1, 2  # the kernels' USE_PDL constexpr
_ON_VALUES = ("1", "true", "on", "yes")


def pdl_mode() -> int:
    """The mode SITS_PDL asks for: PDL_AT_EXIT for "1", "true", "on" or "yes", PDL_EARLY for "early", else
    PDL_OFF (the default)."""
    value = os.environ.get(PDL_ENV, "").strip().lower()
    if value == "early":
        return PDL_EARLY
    return PDL_AT_EXIT if value in _ON_VALUES else PDL_OFF


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


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the grid before this one to finish and flush (no-op when USE_PDL is false: PDL_OFF); with
    PDL_EARLY, then let the next grid launch at once. The first statement of a kernel: nothing may be read
    or written before it."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if USE_PDL == 2:  # PDL_EARLY
            tl.extra.cuda.gdc_launch_dependents()
