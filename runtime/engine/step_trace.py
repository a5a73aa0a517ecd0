"""A served engine's steps, one JSON line each: what every step ran and when it returned.

`sits bench serve` tells how a served run went from the client's side; `benchmarks/bench_step_trace.py`
traces the offline engine. Neither sees the steps of a served engine, which is where a run's throughput and
its ITL tail are decided (how many prompt tokens shared a step with how many decodes). With
`SITS_ENGINE_STEP_TRACE=DIR` in `sits serve`'s environment, the engine process writes
`DIR/engine-<pid>-steps.jsonl`, one line per step that ran the model:

    {"t_s": 12.3456, "decodes": 250, "prompt_tokens": 768, "new_sequences": 1, "context_tokens": 331520,
     "waiting": 3}

- `t_s`: seconds since the trace opened (monotonic clock) when `LLMEngine.step()` returned. With async
  scheduling a call launches one step and completes the one before, so the gap between two lines is the
  device time of the step completed in the later call, as `bench_step_trace.py` reads it;
- `decodes`: sequences that decoded a token; `prompt_tokens`: prompt tokens computed (prefill chunks);
  `new_sequences`: sequences whose first chunk ran; `context_tokens`: the tokens of context the decodes
  attended over (their KV read); `waiting`: sequences still queued after scheduling.

The composition is noted by `observe` (the engine's `step_observer` hook, called once per scheduled step)
and written by `stamp` when the step call that completed it returns: the same call without async scheduling,
the next one with it (`attach` tells which), so each line's gap times the step that line describes. Lines are buffered and flushed at `close` (the loop's end):
writing costs a few microseconds a step. Off unless the variable is set.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sits.runtime.engine.scheduler_output import SchedulerOutput

STEP_TRACE_ENV = "SITS_ENGINE_STEP_TRACE"


@dataclass(frozen=True)
class StepComposition:
    """What one step ran (see the module docstring for each field)."""

    decodes: int
    prompt_tokens: int
    new_sequences: int
    context_tokens: int = 0

    @classmethod
    def of(cls, output: SchedulerOutput) -> StepComposition:
        decodes = prompt = new = context = 0
        for scheduled in output.scheduled:
            if scheduled.start_position >= scheduled.sequence.num_prompt_tokens:
                decodes += 1
                context += scheduled.start_position + len(scheduled.token_ids)
            else:
                prompt += len(scheduled.token_ids)
                new += scheduled.start_position == 0
        return cls(decodes, prompt, new, context)


def step_class(decodes: int, prompt_tokens: int) -> str:
    """A step's class in the step reports: decode only, prefill only, or decodes beside <= N prompt tokens."""
    if prompt_tokens == 0:
        return "decode only"
    if decodes == 0:
        return "prefill only"
    return f"decodes + <= {1 << max(prompt_tokens - 1, 0).bit_length()} prompt tokens"


class StepTrace:
    """The trace file of one engine process (the loop thread is its only user)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("w", buffering=1 << 16)
        self._start = time.monotonic()
        self._pending: StepComposition | None = None  # scheduled in the step call under way
        self._launched: StepComposition | None = None  # async scheduling: scheduled in the previous call
        self._async = False
        self._waiting: Callable[[], int] | None = None

    @classmethod
    def from_env(cls) -> StepTrace | None:
        """The trace `SITS_ENGINE_STEP_TRACE=DIR` asks for (the folder is created), else None."""
        directory = os.environ.get(STEP_TRACE_ENV)
        if not directory:
            return None
        Path(directory).mkdir(parents=True, exist_ok=True)
        return cls(Path(directory) / f"engine-{os.getpid()}-steps.jsonl")

    def attach(self, engine) -> None:
        """Follow `engine` (an LLMEngine whose step_observer is `observe`): its async scheduling (a step completes
        in the call after the one that scheduled it) and its queue (`waiting` on each line)."""
        self._async = bool(engine.async_scheduling)
        self._waiting = lambda: len(engine.scheduler.waiting)

    def observe(self, output: SchedulerOutput) -> None:
        """The engine's step_observer: note the composition of the step just scheduled."""
        self._pending = StepComposition.of(output)

    def stamp(self) -> None:
        """A step call returned: write the step it completed, if that ran the model."""
        step, self._pending = self._pending, None
        if self._async:
            step, self._launched = self._launched, step
        if step is None or not (step.decodes or step.prompt_tokens):
            return
        line = {"t_s": round(time.monotonic() - self._start, 6), **asdict(step)}
        if self._waiting is not None:
            line["waiting"] = self._waiting()
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()


def read_step_trace(path: Path) -> list[dict]:
    """The lines of a trace file as dicts, in order."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


__all__ = ["STEP_TRACE_ENV", "StepComposition", "StepTrace", "read_step_trace", "step_class"]
