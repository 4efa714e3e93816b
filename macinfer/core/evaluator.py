"""Where a launched decode step is evaluated while the host builds the next one.

Async scheduling (macinfer.engine.pipeline) queues step n and builds step n+1 before reading
step n back. On Metal, mx.async_eval returns once the step's command buffers are queued, so the
host's Python overlaps the GPU's work. On MLX's CPU backend it does not: eval_impl waits whenever
more than MAX_ACTIVE_TASKS (10) tasks of 10 ops each are queued (mlx/transforms.cpp,
mlx/backend/cpu/encoder.h), so async_eval returns only when all but the last ~100 ops of a step
have run, and building the next step adds to the step instead of overlapping it
(docs/platform.md, "Async evaluation on the CPU backend").

So on the CPU backend a StepEvaluator hands each launched step to a worker thread of its own,
which runs mx.eval (that releases the GIL) while the engine thread builds the next step,
detokenises and schedules. Elsewhere (Metal, or `threaded=False`) `launch` is mx.async_eval.

On Metal, MLX keeps every input buffer of a command buffer alive until the GPU completes it
(the completion handler in mlx/backend/metal/eval.cpp), and an array is written in place only
if nothing else holds its buffer (`is_donatable`). A step n+1 queued while step n still runs
would find each KV pool held by step n's attention and copy the whole pool to write one token.
So there `launch` first waits for the step before (`settle`), then queues the next: the host
still builds step n+1 while step n runs, only its encoding waits (docs/platform.md, #metal-async).
The worker thread settles by construction: it evaluates step n+1 after step n's mx.eval returned.

Invariants in threaded mode:
- Every array the engine builds lives on `stream`, a thread-unsafe stream on the default device
  (the GPU on a Mac, else the CPU): MLX keeps ordinary streams per thread, and the worker must
  evaluate what the engine thread built.
  `context()` makes it the default stream; the engine enters it for each step and request.
- While a job is queued or running, the engine thread builds graphs but evaluates nothing on
  `stream`: results of a launched step are read only after `Job.wait()`, and any other
  evaluation (a synchronous step, writing blocks to disk) comes after `drain()`. A forward that
  evaluates while it is built (a model whose source reads arrays back, see
  macinfer.kv.model_probe.forward_evaluates) is built only after `drain()` and launched inline,
  or the engine is not threaded at all; so is a forward through the attention hook
  (ForwardContext.attention_fn: the Metal kernel, which evaluates nothing there since its shape
  classes are checked at start-up, or a test's stand-in, which may).
- Jobs run in launch order; a job drops its arrays once evaluated, so the next step's writes
  into the KV pools can reuse their buffers (a pool referenced twice would be copied).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import weakref

import mlx.core as mx

_free_streams: list = []  # thread-unsafe streams of evaluators that are gone (MLX never frees one)
_streams_lock = threading.Lock()


def _take_stream():
    """A thread-unsafe stream on the default device: the model runs where it would without the thread."""
    device = mx.default_device()
    with _streams_lock:
        for i, stream in enumerate(_free_streams):
            if stream.device == device:
                return _free_streams.pop(i)
    return mx.new_thread_unsafe_stream(device)


def _retire(stream, jobs: queue.Queue, box: list) -> None:
    """An evaluator is gone: stop its worker after the jobs queued, then free its stream for another."""
    worker = box[0]
    if worker is not None:
        jobs.put(None)
        if worker is threading.current_thread():
            return  # collected on its own worker: that stream is simply not reused
        worker.join()
    with _streams_lock:
        _free_streams.append(stream)


def threads_pay_off() -> bool:
    """True where async_eval cannot overlap the host with the step: MLX without Metal."""
    return not mx.metal.is_available()


def settles() -> bool:
    """True where a step queued behind a running one would copy the KV pools it writes: Metal (module docstring)."""
    return mx.metal.is_available()


# Waiting for a short step, Job.wait polls instead of blocking: the waiting core stays busy, so the
# step's end is seen at once, not after a futex wake-up of an idle core (docs/platform.md#cpu-poll).
# Only where the last job evaluated in under SHORT_STEP_S, and for SPIN_S at most: polling through
# a long step takes a core from the step's own threads.
SPIN_S = 0.005
SHORT_STEP_S = 0.008


def _poll(event: threading.Event, seconds: float) -> None:
    """Return when event is set or after `seconds`; yields the CPU and the GIL between polls."""
    end = time.perf_counter() + seconds
    while not event.is_set() and time.perf_counter() < end:
        os.sched_yield()  # drops the GIL: the worker needs it to set the event


class Job:
    """One launched step's arrays; `wait()` returns once they are evaluated (or raises what eval raised)."""

    __slots__ = ("arrays", "done", "error", "seen", "spin_s", "timed")

    def __init__(self, arrays: list, spin_s: float = 0.0, timed: bool = False):
        self.arrays, self.done, self.error, self.seen = arrays, threading.Event(), None, False
        self.spin_s = spin_s  # how long wait() polls before it blocks
        self.timed = timed  # a model step: its evaluation time decides whether the next waits poll

    def wait(self) -> None:
        if not self.done.is_set():
            if self.spin_s:
                _poll(self.done, self.spin_s)
            self.done.wait()
        self.seen = True
        if self.error is not None:
            raise self.error


class StepEvaluator:
    """Evaluates launched steps: on a worker thread (threaded) or with mx.async_eval."""

    IDLE_EXIT_S = 2.0  # an idle worker thread ends; the next launch starts another

    def __init__(self, threaded: bool, settle: bool | None = None):
        self.threaded = threaded
        # mx.async_eval: wait for the step before queueing the next (default: on Metal)
        self.settle = (not threaded and settles()) if settle is None else settle
        self.stream = _take_stream() if threaded else None
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._box: list[threading.Thread | None] = [None]  # the worker thread, if running
        self._last: Job | None = None  # the newest job launched
        self._launched: list[Job] = []  # jobs launched since the last drain (their errors: drain)
        self._eval_s = [float("inf")]  # how long the last step took to evaluate (its worker writes it)
        if threaded:
            weakref.finalize(self, _retire, self.stream, self._queue, self._box)

    def context(self):
        """The default stream for everything the engine builds (a no-op unless threaded)."""
        return mx.stream(self.stream) if self.threaded else contextlib.nullcontext()

    def launch(self, arrays: list, inline: bool = False, step: bool = False) -> Job | None:
        """Evaluate arrays behind everything launched before; returns the job (None: mx.async_eval).

        inline: with mx.async_eval on this thread even if threaded (the caller drained first).
        step: the arrays are a model step's (not a small follow-up job), so its time is recorded.
        """
        if not self.threaded or inline:
            assert self._last is None or not inline, "drain() before an inline launch"
            if self.settle:
                mx.synchronize()  # the step before is done: its readers hold no pool any more
            mx.async_eval(arrays)
            return None
        job = Job(arrays, SPIN_S if self._eval_s[0] < SHORT_STEP_S else 0.0, timed=step)
        with self._lock:
            self._queue.put(job)
            self._last = job
            # Kept until drained only while running or failed unseen: a long pipelined run holds a few.
            self._launched = [j for j in self._launched if not j.done.is_set() or (j.error and not j.seen)]
            self._launched.append(job)
            if self._box[0] is None:
                self._box[0] = threading.Thread(target=_work, args=(weakref.ref(self), self._queue, self._eval_s),
                                                name="macinfer-eval", daemon=True)
                self._box[0].start()
        return job

    @property
    def last(self) -> Job | None:
        """The newest job launched and not drained (None: nothing, or not threaded)."""
        return self._last

    def drain(self) -> None:
        """Wait for every launched job; the engine thread may evaluate on its own afterwards.

        Raises:
            The error of a job that failed and that nobody waited for (a state snapshot's: no step
            reads it); a failed job that was waited for raised its error there already.
        """
        last, self._last = self._last, None
        if last is not None:
            last.done.wait()
        with self._lock:
            jobs, self._launched = self._launched, []
        for job in jobs:
            if job.error is not None and not job.seen:
                job.seen = True
                raise job.error

    def _idle_exit(self) -> bool:
        """The worker's question after waiting in vain: may it end? (Yes if nothing was queued meanwhile.)"""
        with self._lock:
            if self._queue.empty():
                self._box[0] = None
                return True
            return False


def _work(owner: weakref.ref, jobs: queue.Queue, eval_s: list) -> None:
    """The worker: evaluate jobs in order (holding only a weak reference to its evaluator)."""
    while True:
        try:
            job = jobs.get(timeout=StepEvaluator.IDLE_EXIT_S)
        except queue.Empty:
            ev = owner()
            if ev is None or ev._idle_exit():
                return
            del ev
            continue
        if job is None:  # its evaluator was collected (_retire)
            return
        t0 = time.perf_counter()
        try:
            mx.eval(job.arrays)
        except BaseException as e:  # raised to the engine by job.wait()
            job.error = e
        if job.timed:  # includes retaking the GIL after mx.eval: what the engine thread waits for
            eval_s[0] = time.perf_counter() - t0
        job.arrays = None
        job.done.set()
        del job
