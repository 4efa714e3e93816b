"""StepEvaluator: launched steps evaluated on a worker thread (MLX's CPU backend), in order,
errors raised where the step is read, OpenBLAS held to one thread meanwhile, nothing left behind."""

from __future__ import annotations

import gc
import threading
import time

import mlx.core as mx
import mlx.nn as nn
import pytest

from macinfer.core import evaluator as ev_mod
from macinfer.core.evaluator import StepEvaluator, threads_pay_off
from macinfer.core.sampling import SamplingParams
from macinfer.engine.llm_engine import LLMEngine
from macinfer.kv.model_probe import forward_evaluates


def test_jobs_run_in_order_on_the_worker():
    ev = StepEvaluator(threaded=True)
    with ev.context():
        x = mx.arange(8, dtype=mx.float32)
        jobs, outs = [], []
        for _ in range(5):  # each step built on the previous step's lazy output, as decode steps are
            x = x * 2 + 1
            outs.append(x)
            jobs.append(ev.launch([x]))
    for j in jobs:
        j.wait()
    assert ev.last is jobs[-1]
    ev.drain()
    assert ev.last is None
    want = mx.arange(8, dtype=mx.float32)
    for got in outs:
        want = want * 2 + 1
        assert mx.array_equal(got, want).item()


def test_waits_poll_only_after_a_short_step(monkeypatch):
    """A wait polls (SPIN_S) only where the last *step* evaluated in under SHORT_STEP_S; small
    follow-up jobs (snapshots, held rows) do not count."""
    ev = StepEvaluator(threaded=True)
    with ev.context():
        x = mx.arange(8, dtype=mx.float32)
        assert ev.launch([x + 1], step=True).spin_s == 0.0  # nothing timed yet: block
        ev.drain()
        monkeypatch.setattr(ev_mod, "SHORT_STEP_S", 60.0)  # a step evaluated: it was short
        assert ev.launch([x + 2]).spin_s == ev_mod.SPIN_S > 0
        ev.drain()
        monkeypatch.setattr(ev_mod, "SHORT_STEP_S", 1e-12)  # the same step, now counted as long
        assert ev.launch([x + 3]).spin_s == 0.0
        ev.drain()
        monkeypatch.setattr(ev_mod, "SHORT_STEP_S", 60.0)
        ev._eval_s[0] = 120.0  # a long step ...
        ev.launch([x + 4]).wait()  # ... then a small job that is not a step: it is not timed
        assert ev.launch([x + 5]).spin_s == 0.0
        ev.drain()


def test_a_polling_wait_stops_polling_after_spin_s():
    """A wait longer than its job's spin_s blocks for the rest: it burns at most spin_s of CPU."""
    job = ev_mod.Job([], spin_s=0.05)
    threading.Timer(0.5, job.done.set).start()
    c0, t0 = time.thread_time(), time.perf_counter()
    job.wait()
    assert time.perf_counter() - t0 >= 0.45
    assert time.thread_time() - c0 < 0.05 + 0.1


def test_an_error_in_a_job_is_raised_by_its_wait():
    """An array built outside the evaluator's stream cannot be evaluated by the worker (MLX keeps
    ordinary streams per thread): the step's own wait raises it, on the engine's thread."""
    ev = StepEvaluator(threaded=True)
    stray = mx.ones((3,)) * 3  # the test thread's default stream, not ev.stream
    job = ev.launch([stray])
    with pytest.raises(RuntimeError, match="Stream"):
        job.wait()
    ev.drain()  # a failed job still counts as done: drain does not hang


def test_drain_raises_the_error_of_a_job_nobody_waited_for():
    """A job no step reads (a state snapshot's) fails: the next drain raises it, once; a waited one's
    error is not raised twice."""
    ev = StepEvaluator(threaded=True)
    with ev.context():
        ok = ev.launch([mx.arange(4) * 2])
    ev.launch([mx.ones((3,)) * 3])  # built outside ev.stream: fails on the worker
    with pytest.raises(RuntimeError, match="Stream"):
        ev.drain()
    ev.drain()  # raised once
    ok.wait()
    waited = ev.launch([mx.ones((2,)) + 1])
    with pytest.raises(RuntimeError, match="Stream"):
        waited.wait()
    ev.drain()  # its wait raised it already


def test_a_collected_evaluator_ends_its_worker_and_frees_its_stream():
    ev = StepEvaluator(threaded=True)
    stream = ev.stream
    with ev.context():
        ev.launch([mx.ones((4,)) + 1]).wait()
    worker = ev._box[0]
    assert worker is not None and worker.is_alive()
    del ev
    gc.collect()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert stream in ev_mod._free_streams
    freed = list(ev_mod._free_streams)
    again = StepEvaluator(threaded=True)
    assert again.stream in freed and len(ev_mod._free_streams) == len(freed) - 1  # reused: MLX never frees one


def test_unthreaded_is_async_eval():
    ev = StepEvaluator(threaded=False)
    x = mx.ones((4,)) * 5
    assert ev.launch([x]) is None and ev.last is None
    assert x.tolist() == [5.0] * 4


def test_no_synchronous_forward_while_a_step_is_on_the_worker(load):
    """Every synchronous step (prefill, admission, the step after the last launched one) runs only
    once the worker is drained: the engine thread and the worker never evaluate at once."""
    model, tok = load("llama")
    engine = LLMEngine(model, tok, None, num_blocks=64, block_size=4, max_num_batched_tokens=16,
                       max_num_seqs=4, eval_thread=True)
    assert engine.runner.evaluator.threaded
    execute, checked, launched = engine.runner.execute_model, [], []

    def guarded(scheduled):
        checked.append(engine.runner.evaluator.last is None)
        return execute(scheduled)

    launch = engine.runner.launch_decode

    def spy(seqs, tokens):
        launched.append(threading.current_thread())
        return launch(seqs, tokens)

    engine.runner.execute_model, engine.runner.launch_decode = guarded, spy
    for i, n in enumerate((5, 9, 3)):
        engine.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=12 + 5 * i, ignore_eos=True), str(i))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 6:  # a late arrival: admitting it needs a synchronous step behind launched ones
            engine.add_request(list(range(7, 20)), SamplingParams(max_tokens=6, ignore_eos=True), "late")
    assert launched and checked and all(checked), checked


class _Routing(nn.Module):
    """A layer that reads its routing back while the forward is built, as mlx-lm's dbrx does."""

    def __call__(self, x):
        return x[: max(1, int(mx.argmax(x).item()) % 2)]


def test_a_forward_that_reads_back_is_never_built_beside_the_worker(load):
    model, tok = load("llama")
    assert forward_evaluates(model) == []
    assert LLMEngine(model, tok, None, num_blocks=16, block_size=4).runner.evaluator.threaded == threads_pay_off()
    model.extra = _Routing()  # now a class of the model lives in a module with a read-back
    try:
        assert forward_evaluates(model) == [__name__]
        assert not LLMEngine(model, tok, None, num_blocks=16, block_size=4).runner.evaluator.threaded
    finally:
        del model.extra
