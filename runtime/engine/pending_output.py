"""A launched step's sampled tokens on their way to the host.

`ModelRunner.launch` queues a step's forward and sampling on the device and returns at once with a
`PendingOutput`: on CUDA the sampled ids (and logprobs, when asked) are copied into pinned host
memory with a non-blocking copy followed by a CUDA event, so the host can schedule and prepare the
next step, or process the previous step's outputs, while the device computes. A step that scored
prompt tokens (prompt logprobs) copies those scores the same way. `result()` waits
for the event (by then usually long passed) and turns the host copies into a `ModelRunnerOutput`.
On a CPU everything already ran when `launch` returned, and `result()` only reads the tensors.
"""

from __future__ import annotations

import torch

from sits.runtime.engine.prompt_logprobs import PromptLogprobsOutput
from sits.runtime.engine.sampler import SamplerOutput
from sits.runtime.engine.scheduler_output import ModelRunnerOutput


class PendingOutput:
    """The sampled tokens of one launched step.

    Args:
        seq_ids: the sampled sequences, in the sampler's row order (empty: the step sampled nothing).
        sampled: the sampler's output on the device, or None when nothing was sampled.
        prompt_logprobs: the step's prompt scores on the device, or None when it scored none.
    """

    def __init__(self, seq_ids: list[str], sampled: SamplerOutput | None = None,
                 prompt_logprobs: PromptLogprobsOutput | None = None) -> None:
        self.seq_ids = seq_ids
        self._sampled = sampled
        self._prompt_logprobs = prompt_logprobs
        self._event: torch.cuda.Event | None = None
        self._result: ModelRunnerOutput | None = None
        if sampled is None and prompt_logprobs is None:
            self._result = ModelRunnerOutput()
            return
        parts = [part for part in (sampled, prompt_logprobs) if part is not None]
        if parts[0].tensors()[0].device.type == "cuda":
            for part in parts:
                tensors = part.tensors()
                host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
                for copy, tensor in zip(host, tensors, strict=True):
                    copy.copy_(tensor, non_blocking=True)
                if part is sampled:
                    self._sampled = sampled.with_tensors(host)
                else:
                    self._prompt_logprobs = part.with_tensors(host)
            self._event = torch.cuda.Event()
            self._event.record()

    @classmethod
    def nothing(cls) -> PendingOutput:
        """A step that sampled no token (empty, or only prefill chunks short of their prompt's end)."""
        return cls([])

    def ready(self) -> bool:
        """Whether `result()` would return without waiting for the device."""
        return self._result is not None or self._event is None or self._event.query()

    def result(self) -> ModelRunnerOutput:
        """The step's sampled tokens by seq_id (waits for the device if it is still computing)."""
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            tokens = self._sampled.to_tokens() if self._sampled is not None else []
            prompt = self._prompt_logprobs.to_chunks() if self._prompt_logprobs is not None else {}
            self._result = ModelRunnerOutput(sampled=dict(zip(self.seq_ids, tokens, strict=True)),
                                             prompt_logprobs=prompt)
            self._sampled = self._prompt_logprobs = None
        return self._result
