"""Async scheduling: decode step n+1 is queued before step n's tokens are read back.

The engine must behave exactly as with async_scheduling=False (and as mlx-lm alone)
although it learns of stops one step late: the extra row of a finished sequence is
dropped, its blocks still come back, and blocks are hashed for the prefix cache only
once their tokens are known.
"""

from __future__ import annotations

import random

import pytest

from macinfer.engine.llm_engine import LLMEngine
from macinfer.core.sampling import SamplingParams
from test_engine import assert_all_free, oracle, run


def _spy_launches(engine):
    calls = []
    launch = engine.runner.launch_decode

    def spy(seqs, tokens):
        calls.append(len(seqs))
        return launch(seqs, tokens)

    engine.runner.launch_decode = spy
    return calls


def _workload(model, vocab):
    """Requests that stop by EOS-like stop ids, stop strings, length, and abort mid-decode."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 19, 8, 11, 30, 7)]
    stop_at = oracle(model, prompts[1], 40)[0]
    i = next(k for k in range(6, len(stop_at)) if stop_at[k] not in stop_at[:k])
    greedy = dict(ignore_eos=True)
    arrivals = [
        (0, prompts[0], SamplingParams(max_tokens=40, **greedy), "long"),
        (0, prompts[1], SamplingParams(max_tokens=40, stop_token_ids=[stop_at[i]], **greedy), "stopid"),
        (0, prompts[2], SamplingParams(max_tokens=7, **greedy), "short"),
        (0, prompts[3], SamplingParams(temperature=0.8, seed=5, max_tokens=30, **greedy), "sampled"),
        (12, prompts[4], SamplingParams(max_tokens=15, **greedy), "late"),  # arrives mid-decode
        (0, prompts[5], SamplingParams(max_tokens=40, **greedy), "aborted"),
    ]
    return arrivals, [(20, "aborted")], i


def test_async_equals_sync_and_mlx_lm(load):
    model, tok = load("llama")
    arrivals, aborts, stop_index = _workload(model, model.args.vocab_size)
    results = {}
    # async on a worker thread (the CPU backend's default), async with mx.async_eval, synchronous
    for mode in ("thread", "async_eval", "sync"):
        engine = LLMEngine(model, tok, None, num_blocks=80, block_size=4, max_num_batched_tokens=16,
                           max_num_seqs=8, async_scheduling=mode != "sync", eval_thread=mode == "thread")
        launches = _spy_launches(engine)
        results[mode] = run(engine, arrivals, aborts)
        assert_all_free(engine)
        if mode != "sync":  # the steady state really ran ahead, in batches, not one row at a time
            assert len(launches) > 30 and max(launches) >= 4
        else:
            assert launches == []
    on, off = results["thread"], results["sync"]
    assert on.keys() == off.keys() == results["async_eval"].keys() == {a[3] for a in arrivals}
    for rid in on:
        assert on[rid][0].token_ids == off[rid][0].token_ids == results["async_eval"][rid][0].token_ids, rid
        assert on[rid][0].finish_reason == off[rid][0].finish_reason, rid
        assert on[rid][1] == on[rid][0].token_ids  # streamed == final
    for _, prompt, params, rid in arrivals:
        if params.greedy and rid != "aborted":
            want = oracle(model, prompt, params.max_tokens)[0]
            if rid == "stopid":
                want = want[:stop_index]
            assert on[rid][0].token_ids == want, rid
    assert on["stopid"][0].finish_reason == "stop" and on["short"][0].finish_reason == "length"
    assert on["aborted"][0].finish_reason == "abort" and 0 < len(on["aborted"][0].token_ids) < 40


def test_stop_string_one_step_late_is_not_leaked(load):
    model, tok = load("llama")
    prompt = [12, 40, 7, 7, 91, 3]
    engine = LLMEngine(model, tok, None, num_blocks=64, block_size=4)
    full = run(engine, [(0, prompt, SamplingParams(max_tokens=30, ignore_eos=True), "f")])["f"][0]
    k = next(k for k in range(len(full.text) // 3, len(full.text) - 3) if "\ufffd" not in full.text[k: k + 3])
    stop = full.text[k: k + 3]
    calls = _spy_launches(engine)
    out = run(engine, [(0, prompt, SamplingParams(max_tokens=30, stop=[stop], ignore_eos=True), "s")])["s"]
    assert out[0].text == full.text[: full.text.find(stop)] and out[0].finish_reason == "stop"
    assert calls, "never pipelined"
    assert_all_free(engine)


def test_blocks_decoded_ahead_are_hashed_for_the_prefix_cache(load):
    model, tok = load("qwen3")
    prompt = [5, 9, 14, 3, 77, 21, 8]
    engine = LLMEngine(model, tok, None, num_blocks=64, block_size=4)
    calls = _spy_launches(engine)
    first = run(engine, [(0, prompt, SamplingParams(max_tokens=21, ignore_eos=True), "a")])["a"][0]
    assert len(calls) >= 15
    # Prompt + output spans 28 tokens = 7 full blocks, all computed by pipelined steps
    # except the prompt's; a follow-up turn must hit every one the first request finished.
    follow = prompt + first.token_ids + [42, 43]
    second = run(engine, [(0, follow, SamplingParams(max_tokens=6, ignore_eos=True), "b")])["b"][0]
    assert second.metrics.cached_tokens == 24  # 6 full blocks computed; the 7th holds the last token
    assert second.token_ids == oracle(model, follow, 6)[0]
    assert_all_free(engine)


def _sometimes_drafting(load):
    """A tiny model with a drafter that is right but has something to offer only now and then
    -> (engine, mlx-lm's greedy continuations, a function serving both prompts -> their outputs).

    Wall-clock step costs make K a coin toss on a tiny model (a 1 ms step, a loaded CI machine):
    the cost model is fed fixed ones (1 ms + 0.1 ms per token), so the choice is the logic's.
    """
    from test_spec_decode import ScriptedDrafter

    model, tok = load("llama")
    prompts = [[7, 19, 3, 44, 12], [90, 4, 4, 61, 8, 30, 2]]
    want = [oracle(model, p, 30)[0] for p in prompts]

    class Sometimes(ScriptedDrafter):
        def available(self, seq, k):
            return k if seq.num_tokens % 6 in (0, 1) else 0

    drafter = Sometimes(prompts, want, right=True, vocab=model.args.vocab_size)
    engine = LLMEngine(model, tok, None, num_blocks=64, block_size=4, draft=drafter, num_speculative_tokens=3)
    observe = engine.spec_decoder.step_cost.observe
    engine.spec_decoder.step_cost.observe = lambda tokens, seconds, **kw: observe(tokens, 1e-3 + 1e-4 * tokens, **kw)

    def serve():
        out = run(engine, [(0, p, SamplingParams(max_tokens=30, ignore_eos=True), f"r{i}")
                           for i, p in enumerate(prompts)])
        return [out[f"r{i}"][0] for i in range(len(prompts))]

    return engine, want, serve


def test_adaptive_speculation_queues_ahead_when_it_would_not_draft(load):
    """Drafting needs the previous token (a synchronous step); steps the adaptive choice would
    not draft in run asynchronously. Both kinds interleave and the output stays mlx-lm's."""
    engine, want, serve = _sometimes_drafting(load)
    launches = _spy_launches(engine)
    outs = serve()
    for i, w in enumerate(want):
        assert outs[i].token_ids == w, i
    drafted = sum(o.metrics.draft_tokens for o in outs)
    assert launches and drafted > 0  # both: queued-ahead plain steps and synchronous drafting steps
    assert_all_free(engine)


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_requests_finishing_in_a_queued_step_leave_nothing_in_the_drafter(load, tiny_models, draft):
    model, tok = load("llama")
    engine = LLMEngine(model, tok, None, num_blocks=64, block_size=4,
                       draft="ngram" if draft == "ngram" else str(tiny_models("llama", seed=1)))
    launches = _spy_launches(engine)
    for i in range(6):
        run(engine, [(0, [5 + i, 9, 14, 3, 8], SamplingParams(max_tokens=12, ignore_eos=True), f"q{i}")])
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=20, ignore_eos=True), request_id="gone")
    for _ in range(8):
        engine.step()
    engine.abort_request("gone")
    run(engine)
    assert launches, "never queued ahead: the test proves nothing"
    drafter = engine.spec_decoder.drafter
    assert engine.spec_decoder.acceptance == {}
    if draft == "ngram":
        assert drafter._cache == {}
    else:
        assert drafter.states == {} and drafter.pool.req_to_blocks == {}
    assert_all_free(engine)


def test_full_batch_with_a_queue_still_runs_ahead(load):
    """More requests than max_num_seqs: the queue waits for a free row either way, so the
    running batch is queued ahead meanwhile, and each output is still mlx-lm's."""
    model, tok = load("qwen2")
    prompts = [[9 + i, 33, 7, 2 * i + 5] for i in range(5)]
    engine = LLMEngine(model, tok, None, num_blocks=64, block_size=4, max_num_seqs=2)
    launches = _spy_launches(engine)
    out = run(engine, [(0, p, SamplingParams(max_tokens=10 + 3 * i, ignore_eos=True), f"w{i}")
                       for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert out[f"w{i}"][0].token_ids == oracle(model, p, 10 + 3 * i)[0], i
    assert sum(n == 2 for n in launches) >= 10  # the full batch ran ahead while others waited
    assert_all_free(engine)


def test_async_scheduling_option_is_validated(load):
    model, tok = load("llama")
    with pytest.raises(ValueError, match="async_scheduling must be True or False"):
        LLMEngine(model, tok, None, num_blocks=8, async_scheduling="no")


def test_step_cost_learns_only_from_whole_queued_steps(load):
    """A queued step's cost is read-back to read-back with the next step queued behind it. The
    read-back before a synchronous (drafting) step has nothing queued behind it and, where
    queueing waits for the step before (MLX's CPU backend), times only a step's tail: that
    sample must not reach the cost model, or decode looks cheap and drafting never pays."""
    import time

    engine, want, serve = _sometimes_drafting(load)
    launch = engine.runner.launch_decode

    def blocking_launch(seqs, tokens):  # as on the CPU: queueing returns once the step before is done
        time.sleep(0.03)
        return launch(seqs, tokens)

    engine.runner.launch_decode = blocking_launch
    samples = []
    skip = engine.spec_decoder.skip_step
    engine.spec_decoder.skip_step = lambda running, n, seconds: (samples.append(seconds), skip(running, n, seconds))
    outs = serve()
    assert [o.token_ids for o in outs] == want
    timed = [s for s in samples if s is not None]
    assert timed and sum(o.metrics.draft_tokens for o in outs) > 0  # both kinds of step ran
    assert min(timed) >= 0.025, sorted(timed)[:3]


def test_step_cost_skips_the_first_interval_of_a_run_of_queued_steps(load):
    """A run of queued steps starts with a step launched behind nothing and a second built on it at
    once; on MLX's CPU backend the pair's time sometimes splits unevenly between them (64 + 12 ms for
    two 38 ms steps, measured), so the interval between their read-backs is not a step's cost. Timed,
    it made drafting look 3x dearer for ~15 steps. Only intervals from a run's second read-back on
    reach the cost model."""
    engine, want, serve = _sometimes_drafting(load)
    samples, pos = [], [0]
    skip = engine.spec_decoder.skip_step

    def spy(running, n, seconds):
        pos[0] += 1
        samples.append((pos[0], seconds))
        if engine.pipeline.inflight is None:  # the run's last read-back: a synchronous step comes next
            pos[0] = 0
        return skip(running, n, seconds)

    engine.spec_decoder.skip_step = spy
    outs = serve()
    assert [o.token_ids for o in outs] == want
    assert [p for p, s in samples if s is not None and p < 3] == []
    assert any(s is not None for p, s in samples if p >= 3)  # runs long enough to be timed did occur
