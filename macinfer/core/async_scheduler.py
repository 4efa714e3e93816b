"""Async scheduling: the scheduler's side of the pipelined decode step (vLLM's AsyncScheduler).

While every running sequence is plainly decoding, the engine queues step n+1 before it reads
step n's tokens back (macinfer.engine.pipeline). Scheduling such a step needs no tokens:

    schedule_decode(launched)    the rows of step n+1, each a slot for one more position
    launched(rows)               step n+1 is queued: its rows count that position as computed
    update_from_launched(seqs, tokens)
                                 step n's tokens, read back: appended and checked for stops as
                                 a synchronous step's are (update_from_output)

Stops are therefore seen one step late: a sequence that finished at step n also computed a row
in step n+1, which is dropped (its slot lies past the sequence's end; its blocks are freed as
usual). Anything else (admitting a request, a prefill chunk, drafts, too few free blocks) is left
to a synchronous `schedule()` once the step in flight is read back.

The variants are this mixin over the plain and the state-slot scheduler (AsyncScheduler,
AsyncStateScheduler); the engine picks one by EngineConfig.async_scheduling.
"""

from __future__ import annotations

from collections.abc import Callable

from macinfer.core.scheduler import Scheduler
from macinfer.core.sequence import Sequence
from macinfer.core.state_pool import StateScheduler


class AsyncScheduling:
    """The pipelined decode step's scheduling, for a Scheduler subclass."""

    def schedule_decode(self: Scheduler, launched: list[Sequence] | None,
                        wants_sync: Callable[[list[Sequence], bool], bool] | None = None) -> list[Sequence]:
        """The rows of a decode step that can be queued now, each with a slot for its next position.

        Args:
            launched: the rows of the step in flight (their tokens not read back), or None.
            wants_sync: asked with the rows and whether a step is in flight; True keeps them for a
                synchronous step (a drafter that would draft for them).

        Returns:
            The rows (each computes position num_computed_tokens); [] when a synchronous step must
            come next.
        """
        rows = self._decode_rows(launched)
        if not rows or (wants_sync is not None and wants_sync(rows, launched is not None)):
            return []
        for s in rows:
            ok = self.block_pool.allocate_slots(s, 1)
            assert ok, s  # _decode_rows counted the free blocks
        self._stamp_scheduled(rows)
        return rows

    def launched(self, rows: list[Sequence]) -> None:
        """The rows' step is queued: their K/V is on its way; their tokens come with update_from_launched."""
        for s in rows:
            s.num_computed_tokens += 1

    def update_from_launched(self: Scheduler, seqs: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """A launched step's tokens, read back: append each (checking stops) and cache the blocks they fill.

        Returns:
            The sequences that moved (rows that had finished before are dropped).
        """
        moved = []
        for seq, tok in zip(seqs, tokens):
            if seq.is_finished:  # stopped a step earlier, or aborted: the row is dropped
                continue
            self.append_tokens(seq, [tok])
            if not seq.is_finished:
                self.block_pool.cache_full_blocks(seq)  # now that its token ids are known
            moved.append(seq)
        return moved

    def _decode_rows(self: Scheduler, launched: list[Sequence] | None) -> list[Sequence]:
        """The sequences the next step can decode without reading anything back, or [].

        Pipelining only covers the steady state: every running sequence decoding, nobody
        waiting who could be admitted, a free slot for each row without preempting. With a step
        in flight, a sequence whose pending token is its last (max_tokens) is left out: it is
        certain to finish.
        """
        running = self.running
        # A waiting request only blocks pipelining if it could be admitted now: a server whose
        # queue is longer than max_num_seqs still runs its full batch ahead.
        admissible = self.waiting and len(running) < self.config.max_num_seqs
        if admissible or not running or (len(running) > 1 and not self.config.batch_decode):
            return []
        if launched is None:
            if any(s.num_uncomputed_tokens != 1 for s in running):
                return []
            rows = list(running)
        else:
            if not same_rows(running, launched):  # the usual step is the same rows again: no set to build
                ids = {id(s) for s in launched}
                if any(id(s) not in ids for s in running):
                    return []
            rows = [s for s in running if s.num_output_tokens + 1 < s.max_tokens]
        pool = self.block_pool
        if sum(pool.num_new_blocks(s, 1) for s in rows) > pool.get_num_free_blocks():
            return []
        return rows


class AsyncScheduler(AsyncScheduling, Scheduler):
    """The Scheduler with the pipelined decode step."""


class AsyncStateScheduler(AsyncScheduling, StateScheduler):
    """The state-slot scheduler (hybrid / SSM models) with the pipelined decode step."""

    def launched(self, rows: list[Sequence]) -> None:
        super().launched(rows)
        self.take_snapshots(rows, launched=True)  # pending state snapshots at block boundaries, queued too


def same_rows(rows: list[Sequence], launched: list[Sequence]) -> bool:
    """The same sequences in the same order (the usual decode step after the one before)."""
    return len(rows) == len(launched) and all(a is b for a, b in zip(rows, launched))
