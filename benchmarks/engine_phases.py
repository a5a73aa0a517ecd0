"""The engine's step, phase by phase: perf_counter (or thread_time) around the engine's own calls.

    clock = PhaseClock(); instrument(engine, clock)
    engine.step(); phases = clock.take()      # {phase: seconds} of that step

The calls are wrapped on the instances (the engine runs unchanged). Phases:

    schedule   Scheduler.schedule
    inputs     the runner building the step's flat batch (block tables, positions, slots, copy)
    forward    the model forward: compute on a CPU; on a GPU the launches (eager kernels or a graph replay)
    logits     the LM head on the sampled rows
    sample     the Sampler, and the wait for the sampled ids to reach the host (on a GPU with async
               scheduling: the wait for the step launched in the previous call)
    update     Scheduler.update_from_output (+ finishing sequences)
    outputs    OutputProcessor.process (detokenization, stop strings, RequestOutput snapshots)
    other      the rest of LLMEngine.step (the step's time less the phases above)
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable

from sits.runtime.engine import runner as runner_module

PHASES = ("schedule", "inputs", "forward", "logits", "sample", "update", "outputs", "other")
MODEL_PHASES = ("forward", "logits")


class PhaseClock:
    """Accumulates seconds per phase within one engine step, on `clock` (perf_counter or thread_time)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.current: dict[str, float] = defaultdict(float)
        self.depth = 0

    def wrap(self, phase: str, function: Callable) -> Callable:
        @functools.wraps(function)
        def timed(*args, **kwargs):
            self.depth += 1
            start = self.clock()
            try:
                return function(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0 or phase in MODEL_PHASES:  # nested calls count once, model time always
                    self.current[phase] += self.clock() - start

        return timed

    def take(self) -> dict[str, float]:
        step, self.current = dict(self.current), defaultdict(float)
        return step


def instrument(engine, clock: PhaseClock) -> None:
    """Time the engine's calls by wrapping them on the instances (the engine runs unchanged)."""
    runner = engine.runner
    engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)
    engine.scheduler.update_from_output = clock.wrap("update", engine.scheduler.update_from_output)
    engine.output_processor.process = clock.wrap("outputs", engine.output_processor.process)
    if hasattr(runner, "prepare_input"):  # the persistent batch builds the step's inputs
        runner.prepare_input = clock.wrap("inputs", runner.prepare_input)
    else:  # a module function the runner calls
        original = runner_module.build_model_input
        runner_module.build_model_input = clock.wrap("inputs", original)
    runner._forward = clock.wrap("forward", runner._forward)
    runner.model.compute_logits = clock.wrap("logits", runner.model.compute_logits)
    sampler_class = runner.sampler.__class__
    method = "sample" if hasattr(sampler_class, "sample") else "__call__"  # the engine before launch()
    runner.sampler.__class__ = type("TimedSampler", (sampler_class,), {
        method: clock.wrap("sample", getattr(sampler_class, method))})
    if hasattr(runner, "launch"):  # the sampled ids reach the host when the engine asks for them
        launch = runner.launch

        def timed_launch(*args, **kwargs):
            pending = launch(*args, **kwargs)
            pending.result = clock.wrap("sample", pending.result)
            return pending

        runner.launch = timed_launch
