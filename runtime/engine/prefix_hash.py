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
) -> None:
    """Append the hashes of blocks len(hashes) .. num_full_blocks-1 of token_ids, in place.

    Incremental: a sequence pays for each block's hash once, however often it is asked. The salt
    goes into the first block only; the chain carries it to every later block.
    """
    num_full_blocks = min(num_full_blocks, len(token_ids) // block_size)
    for index in range(len(hashes), num_full_blocks):
        parent = hashes[index - 1] if index > 0 else None
        extra = (cache_salt,) if index == 0 and cache_salt else ()
        start = index * block_size
        hashes.append(hash_block(parent, token_ids[start : start + block_size], extra))
