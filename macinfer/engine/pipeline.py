"""The pipelined variant of LLMEngine.step.

Async scheduling (vLLM's name for it; mlx-lm's generate_step does the same for one
stream): while every running sequence is plainly decoding, step n+1 is built from
step n's sampled ids while they are still being computed, and queued with
mx.async_eval before step n's ids are read back. Building a forward costs a few ms
of Python per step; this way it overlaps the model's compute instead of adding to
it, and so do the caller's handling of the deltas and detokenising. Stops are
therefore seen one step late: a sequence that finished at step n also computed one
row in step n+1, which is dropped (its K/V slot lies past the sequence's end and
its blocks are freed as usual). Anything else (admitting a request, a prefill
chunk, drafts, too few free blocks) first reads back the step in flight, then runs
a plain synchronous step.

Structured output rides along: step n+1's mask needs step n's token, so a row with a grammar is
computed in step n+1's forward but not sampled there. Once step n is read back (its tokens fed
to the matchers), its masks are filled while step n+1's forward runs and its sampling is queued
as a small job of its own, before step n+2 is built on step n+1's ids:

    launch n+1 (forward; grammar rows held) -> resolve n -> sample n+1's held rows -> launch n+2 ...

Where a step is evaluated is the runner's StepEvaluator (macinfer.core.evaluator): mx.async_eval,
or on MLX's CPU backend a worker thread, whose jobs are waited for before their ids are read and
drained before any synchronous step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from macinfer.core.evaluator import Job
from macinfer.core.logprobs import LogprobRows
from macinfer.core.model_runner import HeldRows
from macinfer.core.outputs import StreamDelta
from macinfer.core.sequence import Sequence


@dataclass
class InFlight:
    """A decode step queued with mx.async_eval whose sampled ids are not read back yet."""

    seqs: list[Sequence]
    tokens: mx.array  # (B,) lazy sampled ids, one per seq
    logprob_rows: LogprobRows  # the rows' logprobs (those that asked), delivered with the ids
    job: Job | None = None  # the forward's evaluation on the worker thread (threaded evaluator only)
    held: HeldRows | None = None  # rows with a grammar, not sampled yet (_sample_held)
    held_job: Job | None = None  # their sampling's evaluation, behind `job`


class PipelinedSteps:
    """LLMEngine's pipelined steps (a mixin, as vLLM keeps its AsyncScheduler apart).

    NOTE: it reads the engine's config, scheduler, block_pool, runner, spec and snapshots, and keeps
    `_inflight` (the step queued and not yet read back) and `_last_resolve`; a
    synchronous step runs only while `_inflight` is None.
    """

    def _step_pipelined(self) -> list[StreamDelta]:
        """Queue step n+1 (if the rows allow), then read back step n and process its tokens."""
        prev = self._inflight
        rows = self._decode_rows(prev)
        self._inflight = self._launch(rows, prev) if rows else None
        deltas = self._resolve(prev)
        if self._inflight is None:
            self.runner.evaluator.drain()  # a synchronous step comes next: nothing may run behind it
        else:
            self._sample_held(self._inflight)  # its grammar rows: their matchers now hold prev's tokens
        if self.spec is not None:
            # Read-back to read-back is one step's cost only while a step is queued behind
            # each. The last read-back before a synchronous step has none: where queueing
            # blocks until the step before is done (MLX on the CPU), it times only that
            # step's tail (~20 ms of ~160 at 8 rows), and the fit took decode for cheap.
            now = time.perf_counter()
            full = self._last_resolve is not None and self._inflight is not None
            self.spec.skip_step(self.scheduler.running, len(prev.seqs),
                                now - self._last_resolve if full else None)
            self._last_resolve = now if self._inflight is not None else None
        return deltas

    def _decode_rows(self, prev: InFlight | None) -> list[Sequence]:
        """The sequences the next step can decode without reading anything back, or [].

        Pipelining only covers the steady state: every running sequence decoding, nobody
        waiting who could be admitted, no drafts, a free slot for each row without preempting.
        Rows with structured output are sampled once step n is read back (_sample_held).
        With a step in flight, a sequence whose pending token is its last (max_tokens)
        is left out: it is certain to finish.
        """
        running = self.scheduler.running
        # A waiting request only blocks pipelining if it could be admitted now: a server whose
        # queue is longer than max_num_seqs still runs its full batch ahead.
        admissible = self.scheduler.waiting and len(running) < self.config.max_num_seqs
        if (not self.config.async_scheduling or admissible
                or not running or (len(running) > 1 and not self.runner.batch_decode)):
            return []
        if prev is None:
            if any(s.num_uncomputed_tokens != 1 for s in running):
                return []
            rows = list(running)
        else:
            if not _same_rows(running, prev.seqs):  # the usual step is the same rows again: no set to build
                launched = {id(s) for s in prev.seqs}
                if any(id(s) not in launched for s in running):
                    return []
            rows = [s for s in running if s.num_output_tokens + 1 < s.max_tokens]
        pool = self.block_pool
        if sum(pool.num_new_blocks(s, 1) for s in rows) > pool.get_num_free_blocks():
            return []
        if self.spec is not None and rows and self.spec.wants_sync(rows, pending=prev is not None):
            return []  # worth drafting: that needs the tokens read back, then a synchronous step
        return rows

    def _launch(self, rows: list[Sequence], prev: InFlight | None) -> InFlight:
        """Queue a decode step for rows; their input ids are prev's lazy outputs."""
        if prev is None:
            tokens = mx.array([s.token_ids[-1] for s in rows], dtype=mx.uint32)
        elif _same_rows(rows, prev.seqs):
            tokens = prev.tokens  # the usual step: no index to build
        else:
            index = {id(s): i for i, s in enumerate(prev.seqs)}
            tokens = prev.tokens[mx.array([index[id(s)] for s in rows])]
        now = time.perf_counter()
        for s in rows:
            ok = self.block_pool.allocate_slots(s, 1)
            assert ok, s  # _decode_rows counted the free blocks
            if s.metrics.first_scheduled_time is None:
                s.metrics.first_scheduled_time = now
        sampled, logprob_rows, held = self.runner.launch_decode(rows, tokens)
        job = self.runner.evaluator.last
        for s in rows:
            s.num_computed_tokens += 1  # the row's K/V is queued; its token comes with _resolve
        if self.snapshots is not None:  # pending state snapshots at block boundaries, queued too
            self.scheduler.take_snapshots(rows, launch=self.runner.evaluator.launch)
        step = InFlight(rows, sampled, logprob_rows, job, held)
        if prev is None:  # every matcher has consumed the rows' input ids already
            self._sample_held(step)
        return step

    def _sample_held(self, step: InFlight) -> None:
        """Sample the grammar rows of a launched step, before the next step takes its ids as inputs.

        NOTE: called once every held row's matcher has consumed the row's input id (the step
        before was resolved), so masks are computed from known tokens only: the matchers are
        never advanced speculatively. Rows that finished meanwhile are dropped at _resolve.
        """
        if step.held is not None:
            step.tokens = self.runner.launch_held(step.seqs, step.held, step.tokens, step.logprob_rows)
            step.held, step.held_job = None, self.runner.evaluator.last

    def _resolve(self, step: InFlight) -> list[StreamDelta]:
        """Read a launched step's tokens back and process them like a synchronous step."""
        deltas = []
        for job in (step.job, step.held_job):
            if job is not None:
                job.wait()  # before reading: the engine thread evaluates nothing a worker may be evaluating
        tokens = step.tokens.tolist()
        step.logprob_rows.deliver()
        for seq, tok in zip(step.seqs, tokens):
            if seq.is_finished:  # stopped a step earlier, or aborted: the row is dropped
                continue
            delta = self._process_token(seq, tok)
            if delta is not None:
                deltas.append(delta)
            if not seq.is_finished:
                self.block_pool.cache_full_blocks(seq)  # now that its token ids are known
            elif self.spec is not None:
                self.spec.remove(seq.request_id)  # what the drafter held for it (a sync step's update would)
        return deltas


def _same_rows(rows: list[Sequence], launched: list[Sequence]) -> bool:
    """The same sequences in the same order (the usual decode step after the one before)."""
    return len(rows) == len(launched) and all(a is b for a, b in zip(rows, launched))
