"""Tensor parallelism under torchrun: the ranks torchrun starts are the replica, rank 0 drives it.

This file is also the program torchrun runs (`python test_tensor_parallel_torchrun.py OUT.json`):
rank 0 starts the executor in torchrun mode and drives the engine's runner, as `sits serve` does
under torchrun; every other rank runs the worker loop. The test runs it on two CPU ranks (gloo)
and compares the greedy tokens with one process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def torchrun_main(output_path: str) -> int:
    """What every torchrun rank runs; rank 0 writes the greedy tokens to output_path."""
    from sits.runtime.engine.sampler import Sampler
    from sits.runtime.parallel.config import ParallelConfig
    from sits.runtime.parallel.executor import TensorParallelExecutor
    from sits.runtime.parallel.ranks import torchrun_rank_info
    from sits.runtime.parallel.worker import run_torchrun_worker
    from tests.runtime.test_tensor_parallel import BLOCK_SIZE, NEW_TOKENS, PROMPTS, _recipe, runner_greedy

    parallel = ParallelConfig(tensor_parallel_size=2)
    if torchrun_rank_info().rank != 0:
        return run_torchrun_worker(_recipe(), parallel)
    cpu = torch.device("cpu")
    executor = TensorParallelExecutor.start(_recipe(), parallel, progress=False)
    try:
        runner = executor.make_runner(executor.loaded.model, cpu, torch.float32, BLOCK_SIZE, Sampler((), cpu))
        tokens = runner_greedy(runner, PROMPTS, NEW_TOKENS)
    finally:
        executor.shutdown()
    Path(output_path).write_text(json.dumps(tokens))
    return 0


@pytest.mark.timeout(180)
def test_tensor_parallel_under_torchrun_matches_a_single_process(tmp_path):
    from sits.runtime.engine.runner import ModelRunner
    from sits.runtime.engine.sampler import Sampler
    from sits.runtime.parallel.distributed import free_port
    from tests.runtime.test_tensor_parallel import BLOCK_SIZE, NEW_TOKENS, PROMPTS, _recipe, runner_greedy

    output = tmp_path / "tokens.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), __file__, str(output)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Its own session, so a timeout kills torchrun's agent and both ranks together.
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        log, _ = process.communicate(timeout=150)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, log[-4000:]

    cpu = torch.device("cpu")
    reference = ModelRunner(_recipe().load(cpu).model, cpu, torch.float32, BLOCK_SIZE, Sampler((), cpu))
    assert json.loads(output.read_text()) == runner_greedy(reference, PROMPTS, NEW_TOKENS)


if __name__ == "__main__":
    # torchrun runs this file as a script, without the repository root on sys.path (PYTHONSAFEPATH);
    # appended after the standard library so the `operator/` folder cannot shadow `operator`.
    sys.path.append(str(REPO_ROOT))
    sys.exit(torchrun_main(sys.argv[1]))
