"""The real tenant eviction policy, recording what it evicts (for eviction-order tests)."""

from __future__ import annotations

from sits.runtime.tenancy.kv_policy import TenantEvictionPolicy


class RecordingPolicy(TenantEvictionPolicy):
    """The real policy, remembering the blocks it gave up, in order."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.victims: list[int] = []

    def pop_victim(self, requester):
        block = super().pop_victim(requester)
        if block is not None:
            self.victims.append(block.block_id)
        return block
