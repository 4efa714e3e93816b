"""Recurrent-state snapshots at block boundaries: the prefix cache for hybrid / SSM models.

A cached KV block is only usable by a model with state layers if the recurrent state after
the same tokens is known too: the state cannot be rebuilt from K/V. So the engine keeps
copies of a sequence's state (one slot's worth of arrays, macinfer.kv.state_cache) at a few
block boundaries, keyed by the hash of the block ending there. Block hashes chain the whole
prefix (macinfer.prefix_cache.keys), so the hash names the exact tokens the state consumed.

Which boundaries (StateScheduler picks them; a prefill chunk is capped to end there, which costs a
forward: none before 64 tokens, and spare ones only in prompts of 256+ tokens):
  - the end of a prompt's last full block strictly before its last token: the same prompt
    again, or a second chat turn extending it, starts there;
  - 1, 2 and 4 blocks before that (*spare* snapshots, first to be dropped): a prompt that
    shares all but a short tail (a system prompt, another question) starts close to the split;
  - where an admitted prompt's cached blocks ended (a prefix another request shared, such
    as a system prompt followed by different questions): the next one with it starts there;
  - while decoding, each block boundary the sequence crosses replaces its one *pending*
    snapshot, which becomes an entry when the sequence finishes (or is preempted): the next
    chat turn, whose prompt holds this one's reply, starts past the reply.

Admission shortens a prefix hit to the last hit block that has a snapshot (no snapshot: no
hit) and restores the sequence's slot from it; attention blocks are never reused without it.

Bounds: every snapshot is `bytes_per_snapshot` (one state slot); entries and pending together
stay within `capacity_bytes`, least recently used entries dropped first, pending ones using at
most half. An entry is dropped when the block pool evicts the block its hash names
(BlockPool.on_evict), so every entry's hash is a findable block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class SnapshotStats:
    taken: int = 0  # entries stored (prompt boundaries and promoted pending ones)
    hits: int = 0  # admissions restored from an entry
    evicted: int = 0  # entries dropped for room (LRU)
    dropped: int = 0  # entries dropped with their block (BlockPool.on_evict)
    shortened: int = 0  # prefix hits shortened for want of a snapshot at their end


class StateSnapshots:
    """Snapshots of one slot's state, by block hash (LRU), plus one pending per decoding sequence.

    Args:
        capacity_bytes: what entries and pending snapshots may hold together.
        bytes_per_snapshot: one state slot (StateStore.bytes_per_slot).

    Example:
        >>> s = StateSnapshots(300, 100)
        >>> s.put(b"a", [[1]]), s.put(b"b", [[2]]), s.put(b"c", [[3]]), s.put(b"d", [[4]])
        (True, True, True, True)
        >>> list(s.entries), s.nbytes
        ([b'b', b'c', b'd'], 300)
    """

    def __init__(self, capacity_bytes: int, bytes_per_snapshot: int):
        if capacity_bytes < 0 or bytes_per_snapshot < 1:
            raise ValueError(f"bad snapshot sizes: capacity {capacity_bytes}, snapshot {bytes_per_snapshot}")
        self.capacity = capacity_bytes
        self.size = bytes_per_snapshot
        self.entries: OrderedDict[bytes, list] = OrderedDict()  # block hash -> [layer][k] arrays (1, ...)
        self.pending: dict[str, tuple[int, list]] = {}  # request id -> (position, arrays)
        self.stats = SnapshotStats()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        return (len(self.entries) + len(self.pending)) * self.size

    def _make_room(self) -> bool:
        while self.nbytes + self.size > self.capacity and self.entries:
            self.entries.popitem(last=False)
            self.stats.evicted += 1
        return self.nbytes + self.size <= self.capacity

    def get(self, block_hash: bytes) -> list:
        """The snapshot (most recently used now); KeyError without one."""
        arrays = self.entries[block_hash]
        self.entries.move_to_end(block_hash)
        self.stats.hits += 1
        return arrays

    def put(self, block_hash: bytes, arrays: list, spare: bool = False) -> bool:
        """Keep arrays as the state after the block named block_hash (False: no room, or one already).

        spare: a guess that may never be used; it goes to the least recently used end, dropped
        first unless a hit refreshes it.
        """
        if block_hash in self.entries:
            if not spare:
                self.entries.move_to_end(block_hash)
            return False
        if not self._make_room():
            return False
        self.entries[block_hash] = arrays
        if spare:
            self.entries.move_to_end(block_hash, last=False)
        self.stats.taken += 1
        return True

    def drop(self, block_hash: bytes) -> None:
        """The block pool evicted the block with this hash: its snapshot goes too."""
        if self.entries.pop(block_hash, None) is not None:
            self.stats.dropped += 1

    # -- pending: the newest boundary a decoding sequence crossed ---------------------------
    def put_pending(self, request_id: str, position: int, arrays: list) -> bool:
        if request_id in self.pending:
            self.pending[request_id] = (position, arrays)
            return True
        if (len(self.pending) + 1) * self.size > self.capacity // 2 or not self._make_room():
            return False
        self.pending[request_id] = (position, arrays)
        return True

    def take_pending(self, request_id: str) -> tuple[int, list] | None:
        return self.pending.pop(request_id, None)

    def stats_dict(self) -> dict:
        """The snapshots' part of LLMEngine.kv_stats()."""
        st = self.stats
        return {
            "state_snapshots": len(self.entries),
            "state_snapshots_pending": len(self.pending),
            "state_snapshot_bytes": self.nbytes,
            "state_snapshot_capacity": self.capacity,
            "state_snapshots_taken": st.taken,
            "state_snapshot_hits": st.hits,
            "state_snapshots_evicted": st.evicted,
            "state_snapshots_dropped": st.dropped,
            "prefix_hits_shortened": st.shortened,
        }
