"""The pipelined decode step (async scheduling), the engine's variant of its synchronous step.

While every running sequence is plainly decoding, step n+1 is built from step n's sampled ids
while they are still being computed, and queued before step n's ids are read back (vLLM's
async scheduling; mlx-lm's generate_step does the same for one stream). Building a forward costs
a few ms of Python per step; this way it overlaps the model's compute instead of adding to it,
and so do the caller's handling of the deltas and detokenising. Which rows, and their slots and
computed tokens, are the scheduler's (macinfer.core.async_scheduler); this module launches and
reads back:

    schedule_decode -> runner.launch_decode -> launched (n+1) -> read back n -> update_from_launched -> output

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

from macinfer.core.async_scheduler import AsyncScheduling, same_rows
from macinfer.core.evaluator import Job
from macinfer.core.logprobs import LogprobRows
from macinfer.core.model_runner import HeldRows, ModelRunner
from macinfer.core.outputs import StreamDelta
from macinfer.core.sequence import Sequence
from macinfer.engine.output_processor import OutputProcessor
from macinfer.spec_decode.decoder import SpecDecoder


@dataclass
class InFlight:
    """A launched decode step whose sampled ids are not read back yet."""

    seqs: list[Sequence]
    tokens: mx.array  # (B,) lazy sampled ids, one per seq
    logprob_rows: LogprobRows  # the rows' logprobs (those that asked), delivered with the ids
    job: Job | None = None  # the forward's evaluation on the worker thread (threaded evaluator only)
    held: HeldRows | None = None  # rows with a grammar, not sampled yet (_sample_held)
    held_job: Job | None = None  # their sampling's evaluation, behind `job`


class Pipeline:
    """Launches decode steps ahead and reads them back.

    Args:
        scheduler: an async scheduler (schedule_decode / launched / update_from_launched).
        runner: launches the forwards.
        output: streams the read-back tokens.
        spec_decoder: the engine's SpecDecoder, or None: with one, a step worth drafting runs synchronously.

    NOTE: the engine runs a synchronous step only while `inflight` is None.
    """

    def __init__(self, scheduler: AsyncScheduling, runner: ModelRunner, output: OutputProcessor,
                 spec_decoder: SpecDecoder | None = None):
        self.scheduler, self.runner, self.output, self.spec_decoder = scheduler, runner, output, spec_decoder
        self.inflight: InFlight | None = None  # the step queued and not yet read back
        self._last_resolve: float | None = None  # when the previous queued step was read back
        self._reads = 0  # read-backs in this run of queued steps (0: none queued, a synchronous step next)

    def start(self) -> bool:
        """Launch a step if every running sequence can decode without a synchronous step; whether it did."""
        rows = self._schedule(None)
        if rows:
            self.inflight = self._launch(rows, None)
        return bool(rows)

    def step(self) -> list[StreamDelta]:
        """Queue step n+1 (if the rows allow), then read back step n and stream its tokens."""
        prev = self.inflight
        rows = self._schedule(prev)
        self.inflight = self._launch(rows, prev) if rows else None
        deltas = self._resolve(prev)
        if self.inflight is None:
            self.runner.evaluator.drain()  # a synchronous step comes next: nothing may run behind it
        else:
            self._sample_held(self.inflight)  # its grammar rows: their matchers now hold prev's tokens
        if self.spec_decoder is not None:
            # Read-back to read-back is one step's cost only while a step is queued behind
            # each. The last read-back before a synchronous step has none: where queueing
            # blocks until the step before is done (MLX on the CPU), it times only that
            # step's tail (~20 ms of ~160 at 8 rows), and the fit took decode for cheap.
            # Nor does the first interval of a run of queued steps: the run's first step was
            # launched behind nothing and its second built on it at once, and on the CPU backend
            # the pair's time sometimes splits unevenly between them (seen: 64 + 12 ms for two
            # 38 ms steps). Timed as one step, the 12 ms made drafting look 3x dearer than it is
            # (the fit's sync_penalty went to 14-21 ms), so drafting stopped for ~15 steps.
            now = time.perf_counter()
            self._reads = self._reads + 1 if self.inflight is not None else 0
            full = self._reads >= 3  # the interval from the run's second read-back on
            self.spec_decoder.skip_step(self.scheduler.running, len(prev.seqs),
                                now - self._last_resolve if full else None)
            self._last_resolve = now if self.inflight is not None else None
        return deltas

    def _schedule(self, prev: InFlight | None) -> list[Sequence]:
        wants_sync = None if self.spec_decoder is None else self.spec_decoder.wants_sync
        return self.scheduler.schedule_decode(None if prev is None else prev.seqs, wants_sync)

    def _launch(self, rows: list[Sequence], prev: InFlight | None) -> InFlight:
        """Queue a decode step for rows; their input ids are prev's lazy outputs."""
        if prev is None:
            tokens = mx.array([s.token_ids[-1] for s in rows], dtype=mx.uint32)
        elif same_rows(rows, prev.seqs):
            tokens = prev.tokens  # the usual step: no index to build
        else:
            index = {id(s): i for i, s in enumerate(prev.seqs)}
            tokens = prev.tokens[mx.array([index[id(s)] for s in rows])]
        sampled, logprob_rows, held = self.runner.launch_decode(rows, tokens)
        step = InFlight(rows, sampled, logprob_rows, self.runner.evaluator.last, held)
        self.scheduler.launched(rows)
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
        """Read a launched step's tokens back; the scheduler appends them, the output streams them."""
        for job in (step.job, step.held_job):
            if job is not None:
                job.wait()  # before reading: the engine thread evaluates nothing a worker may be evaluating
        tokens = step.tokens.tolist()
        step.logprob_rows.deliver()
        moved = self.scheduler.update_from_launched(step.seqs, tokens)
        if self.spec_decoder is not None:
            for seq in moved:
                if seq.is_finished:
                    self.spec_decoder.remove(seq.request_id)  # what the drafter held for it (a sync step's record would)
        return self.output.deltas(moved)
