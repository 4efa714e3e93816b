"""The pool of fixed-size KV blocks, the per-sequence block tables, and the prefix cache.

The KV cache is one big array per layer, cut into `num_blocks` blocks of
`block_size` token slots. This module only does the bookkeeping: which block ids
are free, who holds which, which hold a reusable prefix, and how many blocks a
sequence needs. The arrays themselves live in `macinfer.kv.paged_cache`.

Design choices (vLLM v1's `block_pool.py` / `kv_cache_manager.py`):
- Block 0 is the `null_block`: never handed out, it pads block tables of
  shorter sequences in a batch (its slots are always masked out).
- Free blocks sit in a free queue: allocation pops from the head, freeing
  appends to the tail, so the head is the least recently used. A sequence's
  blocks are freed tail-first, so its later blocks are reused before its prefix.
- Every block has a `ref_cnt`; a block returns to the free queue when it drops
  to 0. With prefix caching, several sequences hold the same prefix blocks.
- Prefix caching (`enable_caching`): once a block is full and computed it gets a
  `block_hash` (macinfer.prefix_cache.keys) and enters `cached_block_hash_to_block`.
  Freed, it keeps its hash and stays findable while it sits in the free queue;
  the hash is dropped (the block *evicted*) only when the block is popped for
  reuse. A hit takes the block out of the queue (O(1): the queue is ordered by
  an OrderedDict) and bumps its ref_cnt.

NOTE: a block with a hash is never written again: a sequence only writes at
positions >= num_computed_tokens, and a cache hit covers whole blocks strictly
before the last prompt token (at least one token is always recomputed so there
are logits to sample from), so new K/V always lands in the sequence's own blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Protocol

from macinfer.prefix_cache.keys import PrefixCacheStats, hash_blocks

if TYPE_CHECKING:
    from macinfer.core.sequence import Sequence


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set while the block holds a reusable full block

    def __repr__(self) -> str:
        cached = f", hash={self.block_hash.hex()[:8]}" if self.block_hash else ""
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Free blocks in eviction order (head = least recently used), O(1) removal anywhere."""

    def __init__(self, blocks: list[KVCacheBlock]):
        self._q: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return iter(self._q.values())

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._q

    def popleft(self) -> KVCacheBlock:
        return self._q.popitem(last=False)[1]

    def append(self, block: KVCacheBlock) -> None:
        self._q[block.block_id] = block

    def appendleft(self, block: KVCacheBlock) -> None:
        self._q[block.block_id] = block
        self._q.move_to_end(block.block_id, last=False)

    def remove(self, block: KVCacheBlock) -> None:
        del self._q[block.block_id]

    def move_to_end(self, block: KVCacheBlock) -> None:
        self._q.move_to_end(block.block_id)


class PrefixStore(Protocol):
    """A slower tier behind the in-memory prefix cache (macinfer.prefix_cache.disk.DiskPrefixStore)."""

    def num_leading(self, block_hashes: list[bytes]) -> int:
        """How many of block_hashes, from the first, the tier holds (an index check, no I/O)."""

    def load(self, blocks: list[tuple[bytes, list[int], int]]) -> int:
        """Write (hash, token ids, block id) entries' K/V into the pools, in order.

        Returns how many leading entries were loaded (stops at the first bad file).
        """


class BlockPool:
    """Hands out KV blocks, records each sequence's block table, and caches full blocks.

    Args:
        num_blocks: blocks in the pool, the null block (id 0) included.
        block_size: token slots per block.
        enable_caching: keep full blocks findable by hash (prefix caching).
        cache_root: the root of every hash chain (the model identity's hash).
        store: the prefix cache's persistent tier (macinfer.prefix_cache.disk), or None.
        on_evict: called with a block's hash when the block is evicted (state snapshots drop theirs).

    Example:
        >>> pool = BlockPool(num_blocks=5, block_size=4)   # 4 usable blocks
        >>> [b.block_id for b in pool.get_new_blocks(2)]
        [1, 2]
        >>> pool.get_num_free_blocks()
        2
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = False,
                 cache_root: bytes = b"", store: PrefixStore | None = None, on_evict=None):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # NOTE: pinned forever, so it is never freed or reused.
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])
        # request_id -> the blocks that hold its KV, in token order.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Prefix caching.
        self.enable_caching = enable_caching
        self.cache_root = cache_root
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.req_to_block_hashes: dict[str, list[bytes]] = {}  # the chain over a request's full blocks
        self.num_cached_block: dict[str, int] = {}  # leading blocks of a request already cached
        self.store = store  # the persistent tier, if any
        # Called with a hash when its block is evicted (macinfer.core.state_snapshots drops its state).
        self.on_evict = on_evict
        self.stats = PrefixCacheStats()

    # -- low level --------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop n blocks from the head of the free queue (ref_cnt 0 -> 1), evicting cached ones."""
        if n > len(self.free_block_queue):
            raise ValueError(f"cannot get {n} blocks: only {len(self.free_block_queue)} free")
        out = []
        for _ in range(n):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0, block
            self._evict(block)
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

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on cache hits; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    # -- the prefix cache -----------------------------------------------------------------
    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block.block_hash)
            block.block_hash = None
            self.stats.blocks_evicted += 1

    def _cache_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Give block its hash unless another block already holds those tokens."""
        if block.block_hash is not None or block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        self.stats.blocks_cached += 1
        return True

    def block_hashes(self, seq: Sequence, num_blocks: int | None = None) -> list[bytes]:
        """The hash chain over seq's full blocks (extended incrementally as tokens come)."""
        hashes = self.req_to_block_hashes.setdefault(seq.request_id, [])
        full = seq.num_tokens // self.block_size
        want = full if num_blocks is None else min(num_blocks, full)
        if len(hashes) < want:
            hash_blocks(self.cache_root, seq.token_ids[: want * self.block_size], self.block_size,
                        start=len(hashes), hashes=hashes, extra_keys=_extra_keys(seq))
        return hashes[:want]

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of seq in full blocks, and how many tokens it covers.

        Takes no references (allocate_slots does). Blocks found only in the
        persistent tier are loaded into free blocks first and then count as hits.

        NOTE: the last token is never covered: a prompt of 8 tokens with 4-token
        blocks may hit block 0 only, so tokens 4..7 are recomputed into a block of
        its own and their logits sampled (even if [4..7] is cached too).
        """
        if not self.enable_caching or seq.num_tokens < 2:
            return [], 0
        hashes = self.block_hashes(seq, (seq.num_tokens - 1) // self.block_size)
        hits: list[KVCacheBlock] = []
        for h in hashes:
            block = self.cached_block_hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
        if self.store is not None and len(hits) < len(hashes):
            hits += self._load_from_store(seq, hashes[len(hits):], hits)
        return hits, len(hits) * self.block_size

    def _load_from_store(self, seq: Sequence, hashes: list[bytes], hits: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """Bring the blocks the persistent tier holds into free blocks, cached (ref_cnt 0)."""
        n = self.store.num_leading(hashes)
        if n == 0:
            return []
        # Hits still in the free queue move to its tail, out of reach of the pops below.
        hits_free = [b for b in hits if b.ref_cnt == 0]
        for b in hits_free:
            self.free_block_queue.move_to_end(b)
        n = min(n, len(self.free_block_queue) - len(hits_free))
        if n <= 0:
            return []
        blocks = []
        for _ in range(n):
            block = self.free_block_queue.popleft()
            self._evict(block)
            blocks.append(block)
        start = len(hits) * self.block_size
        entries = [(h, seq.token_ids[start + i * self.block_size: start + (i + 1) * self.block_size], b.block_id)
                   for i, (h, b) in enumerate(zip(hashes, blocks))]
        loaded = self.store.load(entries)
        out = []
        for i, block in enumerate(blocks):
            # NOTE: hits must stay contiguous: after the first block not loaded (or whose
            # hash another block holds already), the rest are just free blocks.
            if i == len(out) and i < loaded and self._cache_block(block, hashes[i]):
                self.free_block_queue.append(block)  # most recently used; touched by allocate_slots
                out.append(block)
            else:
                self.free_block_queue.appendleft(block)  # nothing useful in it: reuse first
        self.stats.disk_loaded += len(out)
        return out

    def cache_full_blocks(self, seq: Sequence) -> None:
        """After a step: give a hash to every block of seq that is now full and computed.

        A sequence whose num_computed_tokens went back (a rollback) first loses the
        hashes of the blocks past that point, since it will write into them again.
        """
        blocks = self.req_to_blocks.get(seq.request_id)
        if not self.enable_caching or not blocks:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(blocks))
        start = self.num_cached_block.get(seq.request_id, 0)
        if num_full < start:
            for block in blocks[num_full:start]:
                if block.ref_cnt == 1:
                    self._evict(block)
            self.req_to_block_hashes[seq.request_id][num_full:] = []
            start = num_full
        hashes = self.block_hashes(seq, num_full)
        for i in range(start, num_full):
            self._cache_block(blocks[i], hashes[i])
        self.num_cached_block[seq.request_id] = num_full

    def persist(self, seq: Sequence) -> int:
        """Save the cached full blocks of seq's tokens (their longest cached prefix) to the store.

        Returns:
            Blocks newly written.
        """
        if self.store is None:
            return 0
        bs, entries, token_ids = self.block_size, [], seq.token_ids
        for i, h in enumerate(hash_blocks(self.cache_root, token_ids, bs, extra_keys=_extra_keys(seq))):
            block = self.cached_block_hash_to_block.get(h)
            if block is None:
                break
            entries.append((h, token_ids[i * bs: (i + 1) * bs], block.block_id))
        saved = self.store.save(entries) if entries else 0
        self.stats.disk_saved += saved
        return saved

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

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[KVCacheBlock] | None = None) -> bool:
        """Grow seq's block table to fit num_new_tokens more tokens.

        Args:
            computed_blocks: at admission, the cache hits from get_computed_blocks:
                they start the block table and num_new_tokens come after them.

        Returns:
            False (and allocates nothing) if the free queue is too short.
        """
        if computed_blocks is None:
            n = self.num_new_blocks(seq, num_new_tokens)
            if n > len(self.free_block_queue):
                return False
        else:
            assert seq.request_id not in self.req_to_blocks, seq
            num_hit_tokens = len(computed_blocks) * self.block_size
            n = self.num_blocks_for(num_hit_tokens + num_new_tokens) - len(computed_blocks)
            # Touching a free hit takes it out of the queue too.
            if n + sum(b.ref_cnt == 0 for b in computed_blocks) > len(self.free_block_queue):
                return False
            self.touch(computed_blocks)
            self.req_to_blocks[seq.request_id] = list(computed_blocks)
            self.num_cached_block[seq.request_id] = len(computed_blocks)
            if self.enable_caching:
                self.stats.queries += seq.num_tokens
                self.stats.hits += num_hit_tokens
        blocks = self.req_to_blocks.setdefault(seq.request_id, [])
        blocks.extend(self.get_new_blocks(n))
        seq.block_table = [b.block_id for b in blocks]
        return True

    def forked_blocks(self, parent: Sequence, num_tokens: int) -> list[KVCacheBlock]:
        """The blocks of parent's first num_tokens slots (whole blocks), for a fork to share.

        Takes no references (allocate_slots does, as for prefix-cache hits).
        """
        return self.req_to_blocks.get(parent.request_id, [])[: num_tokens // self.block_size]

    def free(self, seq: Sequence) -> None:
        """Release all of seq's blocks, last block first (see module docstring).

        Cached blocks keep their hash in the free queue until they are reused.
        """
        blocks = self.req_to_blocks.pop(seq.request_id, [])
        self.req_to_block_hashes.pop(seq.request_id, None)
        self.num_cached_block.pop(seq.request_id, None)
        self.free_blocks(list(reversed(blocks)))
        seq.block_table = []

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free seq's blocks past the first num_tokens slots (speculative rollback).

        The freed blocks hold only rejected drafts (no hash), so they go to the head
        of the free queue: reused first, so a rollback never pushes out a cached prefix.
        """
        blocks = self.req_to_blocks.get(seq.request_id)
        keep = self.num_blocks_for(num_tokens)
        if not blocks or len(blocks) <= keep:
            return
        for block in blocks[keep:]:
            assert block.ref_cnt == 1 and block.block_hash is None, block
            block.ref_cnt = 0
            self.free_block_queue.appendleft(block)
        del blocks[keep:]
        seq.block_table = [b.block_id for b in blocks]

    # -- stats ------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use."""
        return 1.0 - len(self.free_block_queue) / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a reusable full block right now (in use or free)."""
        return len(self.cached_block_hash_to_block)


def _extra_keys(seq: Sequence):
    """The extra keys of seq's blocks: its images' hashes where their tokens are (None: text only)."""
    return seq.mm.block_extra_keys if seq.mm is not None else None
