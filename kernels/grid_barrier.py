"""A barrier across every program of one launch, for persistent kernels whose programs are all resident at once.

    grid_barrier(counter_ptr, target, flag_ptr, spin_limit)   inside a @triton.jit kernel

Each program calls it once per barrier with the same counter (int32, zero before the launch): it adds 1 on
arrival and polls until the count reaches `target` (P programs at their n-th barrier: n * P). The kernel resets
the counter before it ends (`grid_barrier_reset`, once every program has left its last barrier), so a CUDA graph
replays the launch unchanged.

Programs that are not all resident at once would wait forever; a launch should be cooperative
(`launch_cooperative_grid=True`: CUDA refuses a grid that cannot be) or checked against the occupancy. As a last
guard the polls give up after `spin_limit` and set flag_ptr to 1: the results are then wrong, and the caller must
treat a set flag as a failed launch. Triton's interpreter runs programs one after another, so there only a launch
of one program passes a barrier.

Ordering (the PTX memory model, as sits.kernels.last_arrival): a CTA barrier puts every thread's stores before the
arrival's release atomic (Triton runs a scalar atomic in one thread); the poll that sees the target reads with
acquire semantics from the release sequence of every program's arrival; a CTA barrier after it puts every thread's
later loads after that acquire. Loads of what other programs wrote before the barrier should bypass L1 (.cg).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["grid_barrier", "grid_barrier_reset"]


@triton.jit
def grid_barrier(counter_ptr, target, flag_ptr, spin_limit):
    """Arrive on counter_ptr, then wait until it reads `target` (or spin_limit polls have passed: flag_ptr set)."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < target) & (spins < spin_limit):
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    tl.debug_barrier()
    if seen < target:  # gave up (a poll that reached the target on the last allowed try did not)
        tl.store(flag_ptr, 1)


@triton.jit
def grid_barrier_reset(counter_ptr, arrivals):
    """The launch's last call: every program adds 1 after leaving its last barrier; the one that completes
    `arrivals` (the launch's barriers times P, plus P) sets the counter back to 0 for the next launch."""
    if tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == arrivals - 1:
        tl.atomic_xchg(counter_ptr, 0)
