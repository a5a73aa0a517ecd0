"""The decode attention kernel's split counters: persistent zeroed int32 buffers, one per device.

`paged_decode_attention(..., split_counters=...)` merges its split-KV partials inside the split
kernel: the last split of each (sequence, KV head) to finish, counted on that pair's counter, merges
and resets the counter to 0. The buffer must therefore outlive every launch (and every CUDA graph)
that uses it, and be zero between launches; a torch.zeros per call would add a memset launch, the
cost the fused merge removes.

`SplitCounters.get` hands out one buffer per device, allocated at the first use and grown (never
shrunk) when a larger decode batch comes, outside CUDA-graph capture only: the engine's capture runs
one eager forward at each batch size, largest first, before capturing it, so the buffer reaches the
largest batch before the first graph records its address. A buffer that a larger one replaces is
kept (graphs captured with it still replay on it; it stays zero); a capture that would need a larger
buffer gets None, and that launch merges with the separate kernel instead.
"""

from __future__ import annotations

import torch


class SplitCounters:
    """Per-device int32 counters for the decode kernel's fused merge (owned by one attention back end).

    Launches that share a buffer must run one after another (one stream), as a model's layers do.
    """

    def __init__(self) -> None:
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._replaced: list[torch.Tensor] = []  # still referenced by graphs captured before a growth

    def get(self, device: torch.device, num_seqs: int, num_kv_heads: int) -> torch.Tensor | None:
        """A zeroed [>= num_seqs * num_kv_heads] int32 buffer on `device`, or None while a CUDA graph is
        being captured and the buffer is smaller than that (a capture must not allocate it)."""
        need = max(1, num_seqs * num_kv_heads)
        buffer = self._buffers.get(device)
        if buffer is not None and buffer.numel() >= need:
            return buffer
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if buffer is not None:
            self._replaced.append(buffer)
        buffer = torch.zeros(need, dtype=torch.int32, device=device)
        self._buffers[device] = buffer
        return buffer

    def size(self, device: torch.device) -> int:
        """Counters allocated on `device` (0 before the first use)."""
        buffer = self._buffers.get(device)
        return 0 if buffer is None else buffer.numel()
