"""Compiled decode forwards (macinfer.core.decode_graph): the same tokens as mlx-lm, few traces, and the
guards that turn compiling off when a replay could be wrong; and the evaluator's Metal configuration.

Every test runs twice: with the engine's defaults on MLX's CPU backend and on Metal, faked by what the
engine asks of the host (evaluator.threads_pay_off, evaluator.settles). A test that needs the decode
graph asks for the eval thread itself: on Metal the engine does not use it by default.
"""

from __future__ import annotations

import random

import mlx.core as mx
import mlx.nn as nn
import pytest
from test_engine import assert_all_free, oracle, run
from test_hybrid import hybrid  # noqa: F401 - a fixture

import macinfer.engine.llm_engine as llm_engine
from macinfer.core import evaluator
from macinfer.core.decode_graph import batch_bucket, block_bucket
from macinfer.core.sampling import SamplingParams
from macinfer.engine.llm_engine import LLMEngine
from macinfer.kv.paged_cache import current_forward


@pytest.fixture(params=["cpu", "metal"], autouse=True)
def host(request, monkeypatch):
    """The engine's host: MLX's CPU backend or Metal (faked: threads do not pay off, launches settle)."""
    metal = request.param == "metal"
    monkeypatch.setattr(llm_engine, "threads_pay_off", lambda: not metal)
    monkeypatch.setattr(evaluator, "settles", lambda: metal)
    return request.param


def test_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 25)] == [2, 2, 4, 4, 8, 8, 16, 16, 24, 24, 32]
    assert [block_bucket(n) for n in (1, 8, 9, 64, 65, 72, 73, 128, 129, 1000)] == [8, 8, 16, 64, 72, 72, 80, 128, 144,
                                                                                  1024]


def _engine(model, tok, compile_decode=True, **kw):
    # The decode graph needs the eval thread, which is not the default on Metal.
    return LLMEngine(model, tok, None, num_blocks=96, block_size=4, max_num_batched_tokens=24, max_num_seqs=8,
                     compile_decode=compile_decode, eval_thread=True, **kw)


def _plan(vocab: int, seed: str):
    """Staggered requests of several lengths: the decode batch grows, then shrinks through 8, 4 and 2 rows."""
    rng = random.Random(seed)
    lengths = [(0, 5, 30), (0, 19, 12), (0, 8, 22), (1, 11, 26), (2, 30, 9), (9, 7, 14)]
    return [(step, [rng.randrange(3, vocab) for _ in range(n)], SamplingParams(max_tokens=m, ignore_eos=True), str(i))
            for i, (step, n, m) in enumerate(lengths)]


def _spy(engine):
    """The decode batches the compiled graph ran: (rows, blocks of the longest context) each."""
    graph, calls, bs = engine.runner.decode_graph, [], engine.runner.block_size
    logits = graph.logits

    def spy(seqs, tokens):
        calls.append((len(seqs), max(-(-(s.num_computed_tokens + 1) // bs) for s in seqs)))
        return logits(seqs, tokens)

    graph.logits = spy
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "mamba2"])
def test_compiled_decode_equals_mlx_lm(load, hybrid, arch):
    model, tok = load(arch) if arch == "llama" else hybrid(arch)[1:]
    vocab = 323  # tests/tiny.py's
    plan = _plan(vocab, arch)
    engine = _engine(model, tok)
    calls = _spy(engine)
    got = run(engine, plan)
    assert_all_free(engine)
    for _, prompt, params, rid in plan:
        assert got[rid][0].token_ids == oracle(model, prompt, params.max_tokens)[0], rid
    graph = engine.runner.decode_graph
    assert graph.enabled and graph._checked  # its first replay matched the eager forward bit for bit
    assert len(calls) > 20 and {batch_bucket(n) for n, _ in calls} >= {2, 4, 8}
    assert min(n for n, _ in calls) == 1  # the last row alone runs compiled too (padded to two)
    # One trace per (batch bucket, block bucket) met, not one per shape.
    assert graph.num_traces == len({(batch_bucket(n), block_bucket(b)) for n, b in calls}) < len(set(calls))


class _HostValue(nn.Module):
    """The final norm, plus a value read from the host's block tables: what a trace would bake in."""

    def __init__(self, norm, via_memo: bool):
        super().__init__()
        self.norm, self.via_memo = norm, via_memo

    def __call__(self, h):
        ctx = current_forward()
        if ctx is None or h.shape[1] != 1:
            return self.norm(h)
        extra = mx.array(float(ctx.context_lens[0] % 3), dtype=h.dtype)
        if self.via_memo:
            ctx.memo[("host",)] = extra
        return self.norm(h) + extra


@pytest.mark.parametrize("via_memo", [False, True], ids=["baked", "memo"])
def test_a_forward_reading_host_data_runs_eagerly(load, via_memo):
    """Caught either by the memo check while tracing or by the bit-for-bit check of the first replay."""
    model, tok = load("llama")
    norm = model.model.norm
    model.model.norm = _HostValue(norm, via_memo)
    try:
        plan = _plan(model.args.vocab_size, "host")
        want = run(_engine(model, tok, compile_decode=False), plan)
        engine = _engine(model, tok)
        calls = _spy(engine)
        got = run(engine, plan)
    finally:
        model.model.norm = norm
    assert {rid: o[0].token_ids for rid, o in got.items()} == {rid: o[0].token_ids for rid, o in want.items()}
    assert not engine.runner.decode_graph.enabled
    assert len(calls) == (1 if via_memo else 2)  # off at the trace (memo) or after the first replay (baked)


def test_pools_are_written_in_place(load):
    """The pools go in and come out of the compiled graph: a step must not copy them."""
    model, tok = load("llama")
    engine = LLMEngine(model, tok, None, num_blocks=4096, block_size=16, max_num_seqs=4, compile_decode=True,
                       eval_thread=True)
    for i in range(4):
        engine.add_request(list(range(3, 40 + i)), SamplingParams(max_tokens=12, ignore_eos=True), request_id=str(i))
    for _ in range(3):
        engine.step()
    engine.runner.evaluator.drain()
    mx.reset_peak_memory()
    before = mx.get_active_memory()  # the pools and whatever else the session holds
    while engine.has_unfinished():
        engine.step()
    assert engine.runner.decode_graph.num_traces >= 1
    assert mx.get_peak_memory() - before < 0.25 * engine.runner.kv_bytes  # a copy of the pools would add all of it


def test_option_is_validated_and_auto_compiles_small_models_only(load, monkeypatch, capsys, host):
    import macinfer.core.decode_graph as decode_graph

    model, tok = load("llama")
    with pytest.raises(ValueError, match="compile_decode"):
        LLMEngine(model, tok, None, num_blocks=8, compile_decode="yes")
    assert LLMEngine(model, tok, None, num_blocks=8, compile_decode=False).runner.decode_graph is None
    default = LLMEngine(model, tok, None, num_blocks=8)
    assert (default.runner.decode_graph is not None) == (host == "cpu")  # by default on the CPU backend only
    assert default.runner.evaluator.threaded == (host == "cpu") and default.runner.evaluator.settle == (host == "metal")
    monkeypatch.setattr(decode_graph, "SMALL_MODEL_BYTES", 1 << 10)
    assert LLMEngine(model, tok, None, num_blocks=8).runner.decode_graph is None
    assert LLMEngine(model, tok, None, num_blocks=8, compile_decode=True, eval_thread=True).runner.decode_graph is not None
    # Without the eval thread (mx.async_eval pipelining), never: a compiled step could copy the whole pool.
    assert LLMEngine(model, tok, None, num_blocks=8, eval_thread=False).runner.decode_graph is None
    capsys.readouterr()
    assert LLMEngine(model, tok, None, num_blocks=8, eval_thread=False, compile_decode=True).runner.decode_graph is None
    assert capsys.readouterr().err == "note: compile_decode is off: it needs the eval thread (eval_thread=True)\n"


# ---------------------------------------------------------------- the evaluator on Metal


def test_the_eval_thread_runs_the_model_on_the_default_device(monkeypatch):
    """eval_thread=True on a Mac must evaluate on the GPU: its thread-unsafe stream is on the default device
    (it was always the CPU's). Faked here: the default device is the GPU, and MLX's stream factory records
    what it is asked for (a GPU stream cannot be made without Metal)."""
    asked = []
    make = mx.new_thread_unsafe_stream

    def new_stream(device):
        asked.append(device)
        return make(mx.cpu)

    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(mx, "new_thread_unsafe_stream", new_stream)
    monkeypatch.setattr(evaluator, "_free_streams", [])
    ev = evaluator.StepEvaluator(threaded=True)
    assert asked == [mx.gpu] and ev.stream is not None


def test_metal_launches_wait_for_the_step_before(load, host, monkeypatch):
    """With mx.async_eval pipelining on Metal each launch first waits for the step before (whose attention
    still holds the KV pools the new step writes), and the tokens are mlx-lm's. Only a Mac shows the copy
    it avoids (test_pipelined_decode_writes_the_pools_in_place_on_metal)."""
    model, tok = load("llama")
    order = []
    sync, launch = mx.synchronize, mx.async_eval
    monkeypatch.setattr(mx, "synchronize", lambda *a: (order.append("wait"), sync(*a))[1])
    monkeypatch.setattr(mx, "async_eval", lambda *a: (order.append("launch"), launch(*a))[1])
    engine = LLMEngine(model, tok, None, num_blocks=96, block_size=4, max_num_seqs=4, eval_thread=False)
    plan = _plan(model.args.vocab_size, "settle")[:3]
    got = run(engine, plan)
    seen = list(order)  # mlx-lm's generate_step (the oracle) launches with mx.async_eval too
    for _, prompt, params, rid in plan:
        assert got[rid][0].token_ids == oracle(model, prompt, params.max_tokens)[0], rid
    launches = [i for i, x in enumerate(seen) if x == "launch"]
    assert len(launches) > 10
    if host == "metal":
        assert all(seen[i - 1] == "wait" for i in launches)
    else:
        assert "wait" not in seen


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal: MLX holds a command buffer's inputs there")
@pytest.mark.parametrize("host", ["metal"], indirect=True)
def test_pipelined_decode_writes_the_pools_in_place_on_metal(load):
    """On a Mac, with the engine's default pipelining (mx.async_eval, no eval thread): a step must not copy the
    KV pools (a copy of one layer's pools would add a fifth of them all here)."""
    model, tok = load("llama")
    engine = LLMEngine(model, tok, None, num_blocks=8192, block_size=16, max_num_seqs=4)
    assert not engine.runner.evaluator.threaded and engine.runner.evaluator.settle
    for i in range(4):
        engine.add_request(list(range(3, 40 + i)), SamplingParams(max_tokens=24, ignore_eos=True), request_id=str(i))
    for _ in range(3):
        engine.step()
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    while engine.has_unfinished():
        engine.step()
    assert mx.get_peak_memory() - before < 0.1 * engine.runner.kv_bytes
