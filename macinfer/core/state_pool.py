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

from macinfer.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from macinfer.core.sequence import Sequence, SequenceStatus


class StatePool:
    """Hands out state slots 1..num_slots, one per running sequence.

    Args:
        num_slots: usable slots (max_num_seqs).
        bytes_per_slot: the state of one sequence, every state layer together.
        release: called with a slot when its state is dropped (StateStore.release).

    Example:
        >>> pool = StatePool(2, 1024)
        >>> pool.num_free_slots, pool.state_bytes
        (2, 2048)
    """

    def __init__(self, num_slots: int, bytes_per_slot: int, release=None):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.bytes_per_slot = bytes_per_slot
        self.release = release
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
        if self.release is not None:
            self.release(slot)  # nothing left of a former holder
        self.req_to_slot[seq.request_id] = slot
        return slot

    def free(self, seq: Sequence) -> None:
        """Give seq's slot back (no-op without one); its state is gone."""
        slot = self.req_to_slot.pop(seq.request_id, None)
        if slot is None:
            return
        if self.release is not None:
            self.release(slot)
        self.free_slots.append(slot)

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


class StateScheduler(Scheduler):
    """The Scheduler, plus a state slot per running sequence (models with recurrent layers)."""

    def __init__(self, config: SchedulerConfig, block_pool, state_pool: StatePool):
        super().__init__(config, block_pool)
        self.state_pool = state_pool

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        for s in out.scheduled:  # admitted this step (fresh, or again after a preemption)
            if s.seq not in self.state_pool:
                self.state_pool.allocate(s.seq)
        return out

    def _preempt(self, seq: Sequence) -> None:
        super()._preempt(seq)
        self.state_pool.free(seq)  # recomputed from scratch, like its blocks

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        super().finish(seq, status)
        self.state_pool.free(seq)
