"""sits.kernels.grid_barrier under Triton's interpreter (programs run one after another): a lone program passes its
barriers and leaves the counter at zero; programs that wait for others that cannot run give up and say so."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from sits.kernels.grid_barrier import grid_barrier, grid_barrier_reset
from tests.kernels.helpers import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="the interpreter's one-at-a-time programs")


@triton.jit
def _two_barriers(counter, flag, spin_limit):
    programs = tl.num_programs(0)
    grid_barrier(counter, programs, flag, spin_limit)
    grid_barrier(counter, 2 * programs, flag, spin_limit)
    grid_barrier_reset(counter, 3 * programs)


def _run(programs: int, spin_limit: int) -> tuple[int, int]:
    """(counter, flag) after one launch of `programs` programs."""
    counter, flag = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    _two_barriers[(programs,)](counter, flag, spin_limit)
    return int(counter.item()), int(flag.item())


@pytest.mark.parametrize("spin_limit", [0, 1, 100])
def test_a_barrier_reached_is_never_flagged_even_with_no_poll_left(spin_limit):
    assert _run(1, spin_limit) == (0, 0)


def test_programs_waiting_for_others_give_up_flag_the_launch_and_reset_the_counter():
    assert _run(3, 5) == (0, 1)
