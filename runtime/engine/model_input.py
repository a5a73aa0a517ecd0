"""The flat batch of one step: token ids, positions, cache slots and attention metadata.

Sequences on the prefill path (several new tokens, or the very first token of a sequence) come
first, single-token decodes after them, as `AttentionMetadata` documents. `InputBatch`
(`input_batch.py`) builds it on the host, packs it into one host buffer (pinned on CUDA) and sends
it to the device with one non-blocking copy; the tensors are views of that one device buffer, so
building a step costs one transfer and never waits for the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sits.runtime.attention.backend import AttentionMetadata
from sits.runtime.engine.grammar_mask import StepGrammarMask
from sits.runtime.engine.logit_bias import StepLogitBias
from sits.runtime.engine.prompt_logprobs import StepPromptLogprobs
from sits.runtime.engine.scheduler_output import ScheduledSequence
from sits.runtime.engine.sequence import Sequence as EngineSequence
from sits.runtime.engine.spec_verify import SpecRow
from sits.runtime.engine.token_masks import StepTokenMask


@dataclass
class ModelInput:
    """What the model and the sampler consume for one step.

    Attributes:
        input_ids: [num_tokens] int64.
        positions: [num_tokens] int64.
        metadata: the attention layout (slot mapping, block tables, cu_seqlens, lengths).
        logits_indices: [num_samples] int64, the flat row of each sampling sequence's last token.
        sample_sequences: the sequences sampled this step, in logits_indices order.
        logit_bias: the biases of the sampled rows whose requests gave logit_bias; None when none did.
        grammar_mask: the allowed tokens of the sampled rows under a response_format; None when none is.
        token_mask: the allowed ids and banned tokens of the sampled rows whose requests gave
            allowed_token_ids or bad_words; None when none did (or nothing is banned this step).
        prompt_logprobs: the rows that score prompt tokens of requests asking for prompt logprobs;
            None when the step runs none (`prompt_logprobs.py`).
        lora_slots: each sequence's LoRA adapter slot (0: none), in batch order; None without LoRA.
        spec_rows: the rows that verify speculative drafts (`spec_verify.py`); None when none do.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_sequences: list[EngineSequence]
    logit_bias: StepLogitBias | None = None
    grammar_mask: StepGrammarMask | None = None
    token_mask: StepTokenMask | None = None
    prompt_logprobs: StepPromptLogprobs | None = None
    lora_slots: list[int] | None = None
    spec_rows: list[SpecRow] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode_only(self) -> bool:
        """Every sequence decodes one token (the batches CUDA graphs replay)."""
        return self.metadata.num_prefills == 0


def is_decode(scheduled: ScheduledSequence) -> bool:
    """One new token after a non-empty context: the decode path."""
    return scheduled.num_new_tokens == 1 and scheduled.start_position > 0


def build_model_input(
    scheduled: Sequence[ScheduledSequence], block_size: int, device: torch.device | str
) -> ModelInput:
    """Lay out one step's scheduled sequences as the model's flat batch, with no state kept.

    The runner keeps an `InputBatch` across steps instead (block tables updated incrementally);
    this one-off form serves memory profiling and tests.

    Args:
        scheduled: the step's sequences in any order (reordered: prefills first, then decodes).
        block_size: tokens per KV block (slot = block_id * block_size + offset).
        device: where the tensors go.
    """
    from sits.runtime.engine.input_batch import InputBatch  # it builds ModelInputs: imported late

    return InputBatch(block_size, device, rows=max(1, len(scheduled)), persistent=False).prepare(scheduled)
