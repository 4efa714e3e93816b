"""Token-level scheduler: which sequences compute how many tokens this step.

vLLM v1's scheme, without phases: every sequence has `num_computed_tokens`
catching up with `num_tokens`, and each step hands out at most
`max_num_batched_tokens` tokens of work (the token budget):

  1. Running sequences first, decodes (1 token left) before prefill chunks, so a
     long prompt never stalls the streams already producing tokens. A chunk gets
     whatever budget is left.
  2. If a running sequence needs a block and none is free, the newest running
     sequence is preempted (its blocks freed, recomputed later) until it fits.
  3. Then waiting sequences, first come first served, while blocks and budget
     allow (and only if nothing was preempted this step: no point admitting new
     work while evicting old). An admitted sequence starts from its longest
     cached prefix (prefix caching: num_computed_tokens jumps over the hits).

A sequence whose KV could not fit even in an empty pool finishes with
"length" instead of cycling through preemption forever.

The scheduler is the one writer of what a sequence has computed and holds: `schedule` hands out
tokens and blocks, `update_from_output` counts what the step computed, appends the sampled
tokens (macinfer.core.stop_checker) and frees the sequences they finish. The pipelined decode
step does the same through its subclass (macinfer.core.async_scheduler).

Forks (n > 1 samples of one prompt): a sequence with `fork_of` waits until its parent
has computed the prompt's full blocks, then starts from them (ref_cnt + 1 each, as a
prefix hit) and computes only the prompt's last, partial block itself:

    parent  [b1 b2 b3 | b4: p p g g]        b1..b3 shared (ref_cnt 3)
    fork 1  [b1 b2 b3 | b5: p p g g]        the tail block is recomputed: the decode
    fork 2  [b1 b2 b3 | b6: p p g g]        tokens of each sample land in blocks of its own

NOTE: a fork takes only blocks its parent has computed, so what it shares never depends on
the parent's later steps (a parent preempted mid-prefill would leave them unwritten).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from macinfer.core.block_pool import BlockPool
from macinfer.core.sequence import Sequence, SequenceStatus
from macinfer.core.stop_checker import StopChecker


@dataclass
class SchedulerConfig:
    """Scheduling limits.

    Args:
        max_num_seqs: sequences running at once (rows of a decode batch).
        max_num_batched_tokens: tokens computed per step (decodes + prefill chunks).
        batch_decode: whether decodes share one forward (False: the model cannot take per-row
            offsets; macinfer.core.async_scheduler then pipelines a lone sequence only).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    batch_decode: bool = True

    def __post_init__(self):
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs}")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be an integer >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode each step"
            )


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    num_spec_tokens: int = 0  # of num_new_tokens, drafted tokens to verify (macinfer.spec_decode.decoder)

    @property
    def samples(self) -> bool:
        """After this step the whole sequence is computed, so it yields a token."""
        return self.seq.num_computed_tokens + self.num_new_tokens - self.num_spec_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # out of KV capacity

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """FCFS continuous-batching scheduler over a BlockPool.

    Args:
        config: the scheduling limits.
        block_pool: the KV blocks it hands out.
        stop_checker: appends each sampled token and says which one ends a request (default: no EOS ids).
    """

    def __init__(self, config: SchedulerConfig, block_pool: BlockPool, stop_checker: StopChecker | None = None):
        self.config = config
        self.block_pool = block_pool
        self.stop_checker = stop_checker or StopChecker(())
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # NOTE: admission order; running[-1] is the newest.
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _never_fits(self, seq: Sequence, num_new_tokens: int) -> bool:
        pool = self.block_pool
        return pool.num_blocks_for(seq.num_computed_tokens + num_new_tokens) > pool.num_usable_blocks

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_pool.free(seq)
        seq.reset_for_recompute()
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        self._admit_waiting(out, budget)
        self._stamp_scheduled([s.seq for s in out.scheduled])
        return out

    @staticmethod
    def _stamp_scheduled(seqs: list[Sequence]) -> None:
        now = time.perf_counter()
        for seq in seqs:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running: decodes, then prefill chunks; preempt the newest on block shortage. Returns the budget left."""
        pool = self.block_pool
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        chunks = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + chunks:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._cap(seq, seq.num_computed_tokens, min(seq.num_uncomputed_tokens, budget))
            if self._never_fits(seq, n):
                self.finish(seq, SequenceStatus.FINISHED_LENGTH)
                out.finished.append(seq)
                continue
            # Drafts ride along with a decode if budget and blocks allow; they never preempt anyone.
            num_spec = min(len(seq.spec_token_ids), budget - n) if n == seq.num_uncomputed_tokens else 0
            if num_spec and not pool.allocate_slots(seq, n + num_spec):
                num_spec = 0
            budget += self._make_room(seq, n, out)
            if seq.status is SequenceStatus.RUNNING:
                del seq.spec_token_ids[num_spec:]
                out.scheduled.append(ScheduledSequence(seq, n + num_spec, num_spec))
                budget -= n + num_spec
        return budget

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> int:
        """Allocate n slots for seq, preempting the newest running sequences (seq itself last) until they fit.

        Returns:
            The budget given back by victims already scheduled this step (decodes go first).
        """
        freed = 0
        while not self.block_pool.allocate_slots(seq, n):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            for i, s in enumerate(out.scheduled):
                if s.seq is victim:
                    freed += s.num_new_tokens
                    del out.scheduled[i]
                    break
            if victim is seq:
                break
        return freed

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Waiting, FCFS: stop at the first that does not fit (no overtaking), or after any preemption."""
        pool = self.block_pool
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self._fork_waits(seq):
                break
            if self._never_fits(seq, seq.num_uncomputed_tokens):
                self.waiting.popleft()
                self.finish(seq, SequenceStatus.FINISHED_LENGTH)
                out.finished.append(seq)
                continue
            # Prefix cache: start from the longest cached prefix ([] and 0 when off).
            cached, num_cached = self._computed_blocks(seq)
            n = self._cap(seq, num_cached, min(seq.num_tokens - num_cached, budget))
            if not pool.allocate_slots(seq, n, cached):
                break
            seq.num_computed_tokens = num_cached
            self._admitted(seq)
            if seq.num_preemptions == 0:
                # A hit ends on a block boundary before the last prompt token, so the whole prompt
                # was cached when no more than one block is left to compute.
                seq.metrics.cached_tokens = num_cached
                seq.metrics.prompt_cached = num_cached > 0 and seq.num_tokens - num_cached <= pool.block_size
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, n))
            budget -= n

    def _fork_tokens(self, seq: Sequence) -> int:
        """Prompt tokens a fork shares with its parent: the full blocks before the last prompt token."""
        bs = self.block_pool.block_size
        return (seq.num_prompt_tokens - 1) // bs * bs

    def _fork_waits(self, seq: Sequence) -> bool:
        """A fork waits while its parent (not finished) has not computed the blocks it shares."""
        parent = seq.fork_of
        return (parent is not None and not parent.is_finished
                and (parent.status is SequenceStatus.WAITING or parent.num_computed_tokens < self._fork_tokens(seq)))

    # -- hooks (macinfer.core.state_pool.StateScheduler) --------------------------------------
    def _computed_blocks(self, seq: Sequence):
        """The prefix hit an admitted seq starts from: (blocks, tokens); a fork's are its parent's."""
        hits = self.block_pool.get_computed_blocks(seq)
        parent = seq.fork_of
        if parent is not None and not parent.is_finished:
            shared = self.block_pool.forked_blocks(parent, self._fork_tokens(seq))
            if len(shared) > len(hits[0]):  # with the prefix cache on, it finds these very blocks
                return shared, len(shared) * self.block_pool.block_size
        return hits

    def _cap(self, seq: Sequence, start: int, n: int) -> int:
        """How many of the n tokens from start seq computes this step."""
        return n

    def _admitted(self, seq: Sequence) -> None:
        """seq got its blocks and starts at num_computed_tokens."""

    def _computed(self, seqs: list[Sequence]) -> None:
        """seqs' new num_computed_tokens are where their K/V (and state) now stand."""

    def update_from_output(self, out: SchedulerOutput, sampled: list) -> list[Sequence]:
        """The step ran: count what it computed, append its tokens, end the sequences they stop.

        Args:
            out: the step's schedule.
            sampled: per scheduled row, what the runner sampled: None (mid-prefill), a token, or
                (a row with drafts) the accepted drafts then the target's own token.

        Returns:
            The sequences that got tokens or finished, each once, in schedule order (the step's
            capacity finishes, out.finished, first).

        NOTE: a row that verified k drafts and accepted a of them has a + 1 new tokens, the last
        one without K/V yet. Its drafts' K/V was written too; the accepted ones count as computed
        once they are tokens, and blocks past the sequence's tokens (holding only rejected drafts)
        are freed:

            before    tokens [.. t]           computed [.. ]            + k drafts written
            after     tokens [.. t d0 d1 x]   computed [.. t d0 d1]     (a = 2, x: the target's)
        """
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens - s.num_spec_tokens
            self.block_pool.cache_full_blocks(s.seq)  # full, computed blocks become reusable
        self._computed([s.seq for s in out.scheduled if not s.num_spec_tokens])
        moved = list(out.finished)
        for s, toks in zip(out.scheduled, sampled):
            if toks is not None:
                self.append_tokens(s.seq, toks if isinstance(toks, list) else [toks])
                moved.append(s.seq)
        verified = []
        for s, toks in zip(out.scheduled, sampled):
            if s.num_spec_tokens and not s.seq.is_finished:
                s.seq.num_computed_tokens += len(toks) - 1
                self.block_pool.trim(s.seq, s.seq.num_tokens)
                verified.append(s.seq)
        self._computed(verified)
        return moved

    def append_tokens(self, seq: Sequence, tokens: list[int]) -> None:
        """Append seq's sampled tokens in order, up to the first that ends it (which finishes it)."""
        for tok in tokens:
            status = self.stop_checker.append(seq, tok)
            if status is not None:
                self.finish(seq, status)
                return

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End seq (stop, length or abort) and free its blocks at once (its cached ones stay findable,
        and go to the prefix cache's disk tier if there is one)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_pool.free(seq)
        seq.status = status
        self.block_pool.persist(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for seq in list(self.running) + list(self.waiting):
            if seq.request_id == request_id:
                self.finish(seq, SequenceStatus.FINISHED_ABORTED)
                return seq
        return None
