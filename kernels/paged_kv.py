"""Addressing a paged KV cache from Triton: which block and slot hold each token of a key tile.

Cache layout [num_blocks, PAGE_SIZE, kv_heads, head_dim]; token t of a sequence lives in block
block_table_row[t // PAGE_SIZE] at slot t % PAGE_SIZE.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_tile_blocks(block_table_row, tile_start, limit, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                      MASKED: tl.constexpr):  # fmt: skip
    """Block ids and slots ([BLOCK_N] each, int64) of tokens tile_start .. tile_start + BLOCK_N - 1.

    tile_start must be a multiple of min(BLOCK_N, PAGE_SIZE). A tile inside one page reads one
    table entry; a tile over several pages reads one entry per page (not one per token) and
    broadcasts it. With MASKED, pages at or past `limit` (tokens) are not read (block 0 instead).
    """
    if PAGE_SIZE % BLOCK_N == 0:
        block = tl.load(block_table_row + tile_start // PAGE_SIZE).to(tl.int64)
        slots = (tile_start % PAGE_SIZE + tl.arange(0, BLOCK_N)).to(tl.int64)
        blocks = tl.full([BLOCK_N], 0, tl.int64) + block
    else:
        pages = tl.arange(0, BLOCK_N // PAGE_SIZE)
        if MASKED:
            page_ids = tl.load(
                block_table_row + tile_start // PAGE_SIZE + pages,
                mask=tile_start + pages * PAGE_SIZE < limit,
                other=0,
            )
        else:
            page_ids = tl.load(block_table_row + tile_start // PAGE_SIZE + pages)
        in_page = tl.arange(0, PAGE_SIZE)
        blocks = tl.reshape(page_ids.to(tl.int64)[:, None] + tl.zeros([1, PAGE_SIZE], tl.int64), [BLOCK_N])
        slots = tl.reshape(tl.zeros([BLOCK_N // PAGE_SIZE, 1], tl.int64) + in_page[None, :], [BLOCK_N])
    return blocks, slots
