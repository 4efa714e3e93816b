"""State slots for models with recurrent layers, beside the KV block pool.

Every running sequence of a hybrid / SSM model (macinfer.kv.state_cache) owns one state slot:
taken when the scheduler admits it, given back when it finishes, is aborted or is preempted. A
preempted sequence loses its state with its blocks and recomputes from its first token. Slot 0
is never handed out (as the null block); slots 1..num_slots are, and num_slots is max_num_seqs,
so admission (bounded by max_num_seqs) always finds one. The engine reserves
num_slots x bytes_per_slot of its KV budget for them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import mlx.core as mx

from macinfer.core.scheduler import Scheduler, SchedulerConfig
from macinfer.core.sequence import Sequence, SequenceStatus
from macinfer.core.stop_checker import StopChecker


class StatePool:
    """Hands out state slots 1..num_slots, one per running sequence.

    Args:
        num_slots: usable slots (max_num_seqs).
        bytes_per_slot: the state of one sequence, every state layer together.

    Example:
        >>> pool = StatePool(2, 1024)
        >>> pool.num_free_slots, pool.state_bytes
        (2, 2048)
    """

    def __init__(self, num_slots: int, bytes_per_slot: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.bytes_per_slot = bytes_per_slot
        self.free_slots: deque[int] = deque(range(1, num_slots + 1))
        self.req_to_slot: dict[str, int] = {}

    def __contains__(self, seq: Sequence) -> bool:
        return seq.request_id in self.req_to_slot

    def allocate(self, seq: Sequence) -> int:
        """A fresh (empty) slot for seq."""
        assert seq.request_id not in self.req_to_slot, seq
        if not self.free_slots:
            raise RuntimeError(f"no free state slot for {seq.request_id!r}: more running sequences than max_num_seqs")
        slot = self.free_slots.popleft()
        self.req_to_slot[seq.request_id] = slot
        return slot

    def free(self, seq: Sequence) -> int | None:
        """Give seq's slot back; returns it (None: seq had none)."""
        slot = self.req_to_slot.pop(seq.request_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        return slot

    def slot_of(self, seq: Sequence) -> int:
        return self.req_to_slot[seq.request_id]

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    @property
    def num_used_slots(self) -> int:
        return len(self.req_to_slot)

    @property
    def state_bytes(self) -> int:
        """What the slots reserve of the KV budget."""
        return self.num_slots * self.bytes_per_slot

    def stats(self) -> dict:
        """The state pool's part of LLMEngine.kv_stats()."""
        return {
            "state_slots_used": self.num_used_slots,
            "state_slots_free": self.num_free_slots,
            "state_bytes": self.state_bytes,
            "state_bytes_per_slot": self.bytes_per_slot,
        }


SPARE_BLOCKS = (1, 2, 4)  # spare snapshots this many blocks before a prompt's last one (StateScheduler)


class StateScheduler(Scheduler):
    """The Scheduler, plus a state slot per running sequence (models with recurrent layers), and with
    the prefix cache on, state snapshots at block boundaries (macinfer.core.state_snapshots).

    Args:
        state_pool: the slots (one per running sequence).
        states: the runner's StateStore: a slot's state is dropped when the slot changes hands, and
            snapshots copy and restore slots.
        snapshots: the StateSnapshots, or None when the prefix cache is off.
        launch: how snapshot copies taken beside a launched (pipelined) step are queued
            (StepEvaluator.launch); a synchronous step's are evaluated at once.
    """

    def __init__(self, config: SchedulerConfig, block_pool, stop_checker: StopChecker | None, state_pool: StatePool,
                 states, snapshots=None, launch: Callable[[list], object] | None = None):
        super().__init__(config, block_pool, stop_checker)
        self.state_pool = state_pool
        self.states = states
        self.snapshots = snapshots
        self._launch = launch
        self._targets: dict[str, list[int]] = {}  # request id -> positions to snapshot at (chunks end there)
        self._full_hit: dict[str, int] = {}  # request id -> tokens its cached blocks covered at admission
        self._spare: dict[str, set[int]] = {}  # request id -> the targets that are guesses (StateSnapshots.put)

    # A chunk cut short for a snapshot costs a forward: no cut before min_snapshot_tokens, and spare
    # snapshots only for prompts whose last one is at least min_spare_tokens in (tests lower both).
    min_snapshot_tokens = 64
    min_spare_tokens = 256

    @property
    def _caching(self) -> bool:
        return self.snapshots is not None and self.block_pool.enable_caching

    def _computed_blocks(self, seq: Sequence):
        """The prefix hit, shortened to the last hit block with a snapshot; picks seq's snapshot targets."""
        if not self._caching:
            return [], 0
        pool, snaps, bs = self.block_pool, self.snapshots, self.block_pool.block_size
        blocks, _ = pool.get_computed_blocks(seq)
        hashes = pool.req_to_block_hashes.get(seq.request_id, [])
        n = len(blocks)
        while n and hashes[n - 1] not in snaps:
            n -= 1
        # The prompt's last full block before its last token; where its cached blocks end, a prefix
        # some earlier request shared (a system prompt?), if the hit had to stop short; the last block
        # boundary in its images' tokens (another question about the same images: their rest comes from
        # the image encoder's kept embeddings); and, spare, 1, 2 and 4 blocks before the last one (the
        # same prompt with another short tail).
        last = (seq.num_prompt_tokens - 1) // bs * bs
        images = seq.mm.end // bs * bs if seq.mm is not None else 0
        targets = {t for t in (last, len(blocks) * bs, images) if t >= self.min_snapshot_tokens}
        spare = {last - k * bs for k in SPARE_BLOCKS} - targets if last >= self.min_spare_tokens else set()
        self._targets[seq.request_id] = sorted(t for t in targets | spare if t > n * bs)
        self._spare[seq.request_id] = spare
        self._full_hit[seq.request_id] = len(blocks) * bs
        return blocks[:n], n * bs

    def _cap(self, seq: Sequence, start: int, n: int) -> int:
        for t in self._targets.get(seq.request_id, ()):
            if start < t < start + n:
                return t - start  # the chunk ends at the snapshot position
        return n

    def _admitted(self, seq: Sequence) -> None:
        """A slot for seq (fresh, or again after a preemption), restored from the snapshot its hit ends on."""
        slot = self.state_pool.allocate(seq)
        self.states.release(slot)  # nothing left of a former holder
        computed = seq.num_computed_tokens
        if computed:
            h = self.block_pool.req_to_block_hashes[seq.request_id][computed // self.block_pool.block_size - 1]
            self.states.restore(slot, self.snapshots.get(h))
        if self._caching and self._full_hit.pop(seq.request_id, 0) > computed:
            self.snapshots.stats.shortened += 1

    def _computed(self, seqs: list[Sequence]) -> None:
        self.take_snapshots(seqs)

    def take_snapshots(self, seqs: list[Sequence], launched: bool = False) -> int:
        """After a forward: copy the state of each seq that stands at a block boundary worth keeping.

        At one of its targets, the copy is stored under the hash of the block ending there; past its
        prompt, it becomes the sequence's pending snapshot (stored when it finishes). Each seq's
        num_computed_tokens must be where its slot's state is. launched: the forward is a launched
        step's, still computing: the copies are queued behind it (`launch`) instead of evaluated now.

        Returns:
            How many copies were made.
        """
        if not self._caching:
            return 0
        pool, snaps, bs = self.block_pool, self.snapshots, self.block_pool.block_size
        copies = []
        for seq in seqs:
            pos = seq.num_computed_tokens
            if not pos or pos % bs or seq not in self.state_pool:
                continue
            if pos in self._targets.get(seq.request_id, ()):
                hashes = pool.block_hashes(seq, pos // bs)
                h = hashes[-1] if len(hashes) == pos // bs else None
                if h is None or h in snaps or h not in pool.cached_block_hash_to_block:
                    continue
                arrays = self.states.snapshot(self.state_pool.slot_of(seq))
                if arrays is not None and snaps.put(h, arrays, spare=pos in self._spare.get(seq.request_id, ())):
                    copies.append(arrays)
            elif pos >= seq.num_prompt_tokens:
                arrays = self.states.snapshot(self.state_pool.slot_of(seq))
                if arrays is not None and snaps.put_pending(seq.request_id, pos, arrays):
                    copies.append(arrays)
        if copies:
            (self._launch if launched else mx.eval)(copies)
        return len(copies)

    def _promote(self, seq: Sequence) -> None:
        """seq stops: its pending snapshot becomes an entry if the block it ends is findable.

        NOTE: a pipelined step may have run one row past a stop token that never joined token_ids;
        a snapshot past num_tokens is that row's, and is dropped.
        """
        if self.snapshots is None:
            return
        pending = self.snapshots.take_pending(seq.request_id)
        if pending is None or not self._caching:
            return
        pos, arrays = pending
        if pos > seq.num_tokens:
            return
        pool = self.block_pool
        hashes = pool.block_hashes(seq, pos // pool.block_size)
        if len(hashes) == pos // pool.block_size and hashes[-1] in pool.cached_block_hash_to_block:
            self.snapshots.put(hashes[-1], arrays)

    def _forget(self, seq: Sequence) -> None:
        self._targets.pop(seq.request_id, None)
        self._full_hit.pop(seq.request_id, None)
        self._spare.pop(seq.request_id, None)

    def _preempt(self, seq: Sequence) -> None:
        self._promote(seq)  # its readmission can start there
        super()._preempt(seq)
        self._free_slot(seq)  # recomputed from the last snapshot, or from scratch, like its blocks
        self._forget(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self._promote(seq)
        super().finish(seq, status)
        self._free_slot(seq)
        self._forget(seq)

    def _free_slot(self, seq: Sequence) -> None:
        slot = self.state_pool.free(seq)
        if slot is not None:
            self.states.release(slot)
