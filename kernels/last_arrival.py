"""Which program of a launch arrives last on a counter: the in-launch reduction step that the decode attention's
fused merge (sits.kernels.attention_decode) and the split-K / stream-K small-M GEMMs share.

    last_arrival(counter_ptr, num_valid) -> True in exactly one of the num_valid programs that call it

Each of num_valid programs stores its partial result, then calls this once on a counter that is 0 before the
launch; the one that finds every other already counted reduces the partials (loading them with .cg) and the
counter is 0 again after the launch, ready for the next one (a CUDA graph replays it unchanged).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["last_arrival"]


@triton.jit
def last_arrival(counter_ptr, num_valid):
    """True in exactly one of the num_valid programs that call this once per launch on one counter
    (the last to arrive), which also resets the counter to 0 for the next launch.

    Ordering (the PTX memory model; Triton runs a scalar atomic in one thread and hands its result
    to the others through shared memory behind a barrier):
    * release: the caller's partial stores come first in program order; the barrier orders every
      thread's stores before the atomic, and the atomic's release (acq_rel, gpu scope) is cumulative,
      so it publishes them all at gpu scope before the count can be seen.
    * acquire: the last arrival reads the count num_valid - 1 with acquire semantics; the increments
      before it are read-modify-writes of the same counter, so they all lie in one release sequence
      that it reads from, and every other program's release happens before its later loads; the barrier
      after the atomic keeps all its threads' loads after the acquire, and the caller loads with .cg (L2,
      never a stale L1 line).
    * reset: every program of this launch has incremented by then and none touches the counter
      again, so a plain store of 0 suffices; the next launch on the stream sees it (kernel boundary).
    """
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    last = arrived == num_valid - 1
    if last:
        tl.store(counter_ptr, 0)
    return last
