"""Prefix-cache block hashes: a chain of blake2b digests over full blocks of tokens.

`hash(block i) = blake2b(hash(block i-1) ‖ block_size ‖ tokens of block i ‖ extra_keys)`, so a
block's hash names its whole prefix, not just its own tokens. A 256-bit cryptographic hash makes a
collision (which would hand one request another's KV, possibly another tenant's) practically
impossible, unlike Python's `hash()`. The chain root is a fixed constant so hashes are stable
across processes and replicas (the tenancy layer may mirror them to a shared store).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes
DIGEST_SIZE = 32
ROOT_HASH: BlockHash = hashlib.blake2b(b"sits/prefix-cache/v1", digest_size=DIGEST_SIZE).digest()


def hash_block(
    parent: BlockHash | None, tokens: Sequence[int], extra_keys: tuple[str, ...] = ()
) -> BlockHash:
    """The hash of one full block given its parent's hash (None for the first block).

    Args:
        parent: hash of the previous block of the same sequence, or None for block 0.
        tokens: the block's token ids (block_size of them).
        extra_keys: strings that must also match for a hit, e.g. the tenant's cache salt.
    """
    digest = hashlib.blake2b(parent if parent is not None else ROOT_HASH, digest_size=DIGEST_SIZE)
    digest.update(len(tokens).to_bytes(4, "little"))
    digest.update(array("q", tokens).tobytes())
    for key in extra_keys:
        encoded = key.encode("utf-8")
        # Length-prefixed, so ("ab", "c") and ("a", "bc") hash differently.
        digest.update(len(encoded).to_bytes(4, "little"))
        digest.update(encoded)
    return digest.digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    num_full_blocks: int,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> None:
    """Append the hashes of blocks len(hashes) .. num_full_blocks-1 of token_ids, in place.

    Incremental: a sequence pays for each block's hash once, however often it is asked. The salt
    and the LoRA adapter's key (its name; for an adapter loaded at runtime, its name and a load id,
    `LoraManager.cache_keys`) go into the first block only; the chain carries them to every later
    block, so KV computed under one adapter (or the base model) is never a hit for another.
    """
    num_full_blocks = min(num_full_blocks, len(token_ids) // block_size)
    first_extra = first_block_extra_keys(cache_salt, lora_name)
    for index in range(len(hashes), num_full_blocks):
        parent = hashes[index - 1] if index > 0 else None
        extra = first_extra if index == 0 else ()
        start = index * block_size
        hashes.append(hash_block(parent, token_ids[start : start + block_size], extra))


def first_block_extra_keys(cache_salt: str | None, lora_name: str | None) -> tuple[str, ...]:
    """The extra keys of a sequence's first block: its salt, and with an adapter two keys (salt or
    "", then the adapter), which no single salt can hash like (keys are length-prefixed)."""
    if lora_name is None:
        return (cache_salt,) if cache_salt else ()
    return (cache_salt or "", f"lora:{lora_name}")
