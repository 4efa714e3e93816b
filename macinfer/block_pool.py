"""The pool of fixed-size KV blocks and the per-sequence block tables built from it.

The KV cache is one big array per layer, cut into `num_blocks` blocks of
`block_size` token slots. This module only does the bookkeeping: which block ids
are free, who holds which, and how many blocks a sequence needs. The arrays
themselves live in `macinfer.paged_cache`.

Design choices (vLLM v1's `block_pool.py` / `kv_cache_manager.py`):
- Block 0 is the `null_block`: never handed out, it pads block tables of
  shorter sequences in a batch (its slots are always masked out).
- Free blocks sit in a FIFO free queue: allocation pops from the head, freeing
  appends to the tail. A sequence's blocks are freed tail-first, so its later
  blocks are reused before its prefix (the order a prefix cache wants).
- Every block has a `ref_cnt`; a block returns to the free queue when it drops
  to 0. Today one sequence owns each block (ref_cnt 1); the counter is there so
  prefix sharing can come without changing this interface.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from macinfer.sequence import Sequence


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt})"


class BlockPool:
    """Hands out KV blocks and records each sequence's block table.

    Args:
        num_blocks: blocks in the pool, the null block (id 0) included.
        block_size: token slots per block.

    Example:
        >>> pool = BlockPool(num_blocks=5, block_size=4)   # 4 usable blocks
        >>> [b.block_id for b in pool.get_new_blocks(2)]
        [1, 2]
        >>> pool.get_num_free_blocks()
        2
    """

    def __init__(self, num_blocks: int, block_size: int = 16):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # NOTE: pinned forever, so it is never freed or reused.
        self.free_block_queue: deque[KVCacheBlock] = deque(self.blocks[1:])
        # request_id -> the blocks that hold its KV, in token order.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    # -- low level --------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop n blocks from the head of the free queue (ref_cnt 0 -> 1)."""
        if n > len(self.free_block_queue):
            raise ValueError(f"cannot get {n} blocks: only {len(self.free_block_queue)} free")
        out = []
        for _ in range(n):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0, block
            block.ref_cnt = 1
            out.append(block)
        return out

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the queue tail, in order."""
        for block in blocks:
            assert block.ref_cnt > 0 and block is not self.null_block, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    # -- per sequence (check/act pairs) -------------------------------------------------
    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks seq must get so its KV can hold num_computed_tokens + num_new_tokens."""
        have = len(self.req_to_blocks.get(seq.request_id, ()))
        need = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, need - have)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= len(self.free_block_queue)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq's block table to fit num_new_tokens more tokens.

        Returns:
            False (and allocates nothing) if the free queue is too short.
        """
        n = self.num_new_blocks(seq, num_new_tokens)
        if n > len(self.free_block_queue):
            return False
        blocks = self.req_to_blocks.setdefault(seq.request_id, [])
        blocks.extend(self.get_new_blocks(n))
        seq.block_table = [b.block_id for b in blocks]
        return True

    def free(self, seq: Sequence) -> None:
        """Release all of seq's blocks, last block first (see module docstring)."""
        blocks = self.req_to_blocks.pop(seq.request_id, [])
        self.free_blocks(list(reversed(blocks)))
        seq.block_table = []

    # -- stats ------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use."""
        return 1.0 - len(self.free_block_queue) / self.num_usable_blocks
