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

import mlx.core as mx

from macinfer.core.scheduler import ScheduledSequence, Scheduler, SchedulerConfig, SchedulerOutput
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


def refeed_rejected(runner, rows: list[ScheduledSequence], results: list[tuple[int, mx.array]], group: list[int]) -> int:
    """Speculative decoding on a model with state layers: after a verify forward, rows that rejected
    some of their drafts get the state of their accepted tokens only.

    The verify forward ran every drafted token through the state layers, and a recurrent state cannot
    be trimmed like K/V. So such a row's slot goes back to the state before the forward and one more
    forward feeds the row's real token and its accepted drafts again (right-padded, per-row lengths):
    it rewrites the K/V those positions already hold and leaves the state just past them. Rows that
    accepted everything keep the verify forward's state. Costs a forward per step with a rejection,
    which the adaptive K sees in its measured step times.

    Args:
        runner: the target's ModelRunner (runner.states set).
        rows: the verify forward's ScheduledSequences.
        results: (scheduled index, evaluated [num_accepted, tokens...]) of its sampling rows.
        group: each row's scheduled index.

    Returns:
        How many rows were fed again.
    """
    accepted = {i: int(res[0].item()) for i, res in results}
    redo = [ScheduledSequence(r.seq, r.num_new_tokens - r.num_spec_tokens + accepted[i], accepted[i])
            for i, r in zip(group, rows) if r.num_spec_tokens and accepted.get(i, r.num_spec_tokens) < r.num_spec_tokens]
    if not redo:
        return 0
    runner.states.rollback([r.seq for r in redo])
    for sub in runner._groups(redo):  # unpadded groups for models that ignore lengths
        runner.forward([redo[i] for i in sub])
        mx.eval([c.state for c in runner.caches])  # see ModelRunner.execute_model's NOTE
    return len(redo)


def check_drafter(drafter, runner, model_type: str) -> None:
    """Refuse the drafts that cannot run exactly with state layers (one MacinferError line).

    A feature draft reads the target's hidden states of every forward, and refeed_rejected's extra
    forward would report some positions twice; a draft model with state layers would need slots of
    its own. Drafting by lookup, or with an attention-only draft model, is exact.
    """
    from macinfer.errors import MacinferError

    if runner.states is not None and runner.hidden_sink is not None:
        raise MacinferError(f"{model_type}: a feature draft is not supported for models with recurrent state "
                            "layers yet; use --draft ngram or a draft model")
    for d in (drafter, getattr(drafter, "model", None)):
        if getattr(getattr(d, "runner", None), "states", None) is not None:
            raise MacinferError(f"{getattr(d, 'name', 'the draft')}: draft models with recurrent state layers are "
                                "not supported yet; use --draft ngram or an attention-only draft")
