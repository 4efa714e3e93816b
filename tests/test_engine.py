"""LLMEngine against mlx-lm on tiny random models.

The oracle for every greedy request is mlx-lm's own `generate_step` on that
request alone (its contiguous KVCache, no batching). The engine serves the same
requests together, arriving at different steps, through a KV pool small enough
to force preemption, with some requests aborted midway.
"""

from __future__ import annotations

import random

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from macinfer.engine.llm_engine import LLMEngine
from macinfer.units import parse_bytes
from macinfer.errors import MacinferError
from macinfer.kv.model_probe import inspect_model
from macinfer.core.sampling import SamplingParams

def oracle(model, prompt, max_tokens, eos=()):
    """Greedy tokens from mlx-lm alone, cut at the first EOS (which is not output)."""
    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        if int(tok) in eos:
            return out, "stop"
        out.append(int(tok))
    return out, "length"


def run(engine, arrivals=(), aborts=()):
    """Step the engine to the end; arrivals: (step, prompt, params, rid); aborts: (step, rid).

    Returns:
        {rid: (RequestOutput, streamed token ids)}
    """
    arrivals, aborts = list(arrivals), dict((rid, s) for s, rid in aborts)
    outputs, streamed, step = {}, {}, 0
    while arrivals or engine.has_unfinished():
        for a in [a for a in arrivals if a[0] == step]:
            engine.add_request(a[1], a[2], request_id=a[3])
            arrivals.remove(a)
        for rid, s in aborts.items():
            if s == step:
                engine.abort_request(rid)
        for d in engine.step():
            streamed.setdefault(d.request_id, []).extend(d.token_ids)
            if d.output is not None:
                outputs[d.request_id] = d.output
        step += 1
        assert step < 2000, "engine does not make progress"
    return {rid: (o, streamed.get(rid, [])) for rid, o in outputs.items()}


def assert_all_free(engine):
    pool = engine.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    assert pool.req_to_blocks == {} and engine.requests == {}
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_batch_matches_mlx_lm_alone(load, arch):
    model, tok = load(arch)
    rng = random.Random(arch)
    vocab = model.args.vocab_size
    # (arrival step, prompt length, max_tokens, abort at step or None)
    plan = [(0, 5, 24, None), (0, 37, 16, None), (1, 12, 20, None), (2, 9, 30, 5),
            (3, 60, 12, None), (4, 3, 20, 9), (6, 20, 20, None)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for _, n, _, _ in plan]
    # 29 usable blocks x 4 = 116 token slots for ~270 tokens of demand: preemption.
    engine = LLMEngine(model, tok, None, num_blocks=30, block_size=4, max_num_batched_tokens=16, max_num_seqs=6)
    eos = engine.eos_token_ids
    results = run(
        engine,
        arrivals=[(s, p, SamplingParams(max_tokens=m), f"r{i}") for i, ((s, _, m, _), p) in enumerate(zip(plan, prompts))],
        aborts=[(a, f"r{i}") for i, (_, _, _, a) in enumerate(plan) if a is not None],
    )
    assert engine.scheduler.num_preemptions > 0
    for i, ((_, _, max_tokens, abort), prompt) in enumerate(zip(plan, prompts)):
        out, streamed = results[f"r{i}"]
        want, reason = oracle(model, prompt, max_tokens, eos)
        assert streamed == out.token_ids
        if abort is None:
            assert out.token_ids == want, f"r{i}"
            assert out.finish_reason == reason
        else:
            assert out.finish_reason == "abort"
            assert out.token_ids == want[: len(out.token_ids)] and len(out.token_ids) < max_tokens
    assert_all_free(engine)


def test_sliding_window_matches_mlx_lm(load):
    kw = dict(layer_types=("sliding_attention", "full_attention"), sliding_window=6)
    model, tok = load("llama", **kw)
    full_model, _ = load("llama")  # same seed and shapes: the same weights, no window
    assert [s.window for s in inspect_model(model, "llama")] == [6, None]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (4, 9, 23, 40)]
    engine = LLMEngine(model, tok, None, num_blocks=40, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    results = run(engine, [(i, p, SamplingParams(max_tokens=20, ignore_eos=True), f"w{i}") for i, p in enumerate(prompts)])
    differs = False
    for i, p in enumerate(prompts):
        assert results[f"w{i}"][0].token_ids == oracle(model, p, 20)[0]
        differs |= oracle(full_model, p, 20)[0] != results[f"w{i}"][0].token_ids
    assert differs, "the window never mattered: the test proves nothing"
    assert_all_free(engine)


def test_seeded_sampling_reproducible_whatever_the_batch(load):
    model, tok = load("llama")
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=11, max_tokens=16, ignore_eos=True)
    prompt = [5, 17, 42, 99, 7]

    def engine():
        return LLMEngine(model, tok, None, num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=8)

    alone = run(engine(), [(0, prompt, p, "s")])["s"][0].token_ids
    busy = run(engine(), [
        (0, [9] * 30, SamplingParams(max_tokens=20, ignore_eos=True), "g"),
        (1, [3, 4, 5], SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True), "o"),
        (2, prompt, p, "s"),
        (4, [8] * 11, SamplingParams(temperature=0.5, max_tokens=9, ignore_eos=True), "x"),
    ])
    assert busy["s"][0].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=12, max_tokens=16, ignore_eos=True)
    assert run(engine(), [(0, prompt, other_seed, "s")])["s"][0].token_ids != alone


def test_stop_token_ids_and_stop_strings(load):
    model, tok = load("llama")
    prompt = [12, 40, 7, 7, 91, 3]
    want, _ = oracle(model, prompt, 30)
    engine = LLMEngine(model, tok, None, num_blocks=64, block_size=4)
    # Stop token: the first token that did not occur before it, from index 3 on.
    i = next(k for k in range(3, len(want)) if want[k] not in want[:k])
    r = run(engine, [(0, prompt, SamplingParams(max_tokens=30, stop_token_ids=[want[i]], ignore_eos=True), "t")])
    assert r["t"][0].token_ids == want[:i] and r["t"][0].finish_reason == "stop"

    full = run(engine, [(0, prompt, SamplingParams(max_tokens=30, ignore_eos=True), "f")])["f"][0]
    assert full.token_ids == want and full.finish_reason == "length"
    text = full.text
    k = next(k for k in range(len(text) // 2, len(text) - 3) if "\ufffd" not in text[k: k + 3])
    stop = text[k: k + 3]
    outputs, step, streamed_text = {}, 0, ""
    engine.add_request(prompt, SamplingParams(max_tokens=30, stop=[stop, "never-there"], ignore_eos=True), request_id="s")
    while engine.has_unfinished():
        for d in engine.step():
            streamed_text += d.text
            if d.output:
                outputs[d.request_id] = d.output
    out = outputs["s"]
    assert out.text == text[: text.find(stop)] and out.finish_reason == "stop"
    assert streamed_text == out.text  # held-back text never leaked the stop string
    # An empty stop string stops nothing and holds nothing back (it made the hold -1: lost text).
    streamed = ""
    engine.add_request(prompt, SamplingParams(max_tokens=30, stop=[""], ignore_eos=True), request_id="e")
    while engine.has_unfinished():
        streamed += "".join(d.text for d in engine.step())
    assert streamed == text
    assert_all_free(engine)


def test_metrics_are_filled(load):
    model, tok = load("qwen3")
    engine = LLMEngine(model, tok, None, num_blocks=64, block_size=4)
    out = run(engine, [(0, [4] * 7, SamplingParams(max_tokens=5, ignore_eos=True), "m")])["m"][0]
    m = out.metrics
    assert m.prompt_tokens == 7 and m.generation_tokens == 5 == len(out.token_ids)
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
    assert m.decode_steps == 4 and m.kv_tokens_sum == 8 + 9 + 10 + 11
    assert out.finish_reason == "length"


def test_request_errors_and_capacity(load):
    model, tok = load("llama")
    engine = LLMEngine(model, tok, None, num_blocks=5, block_size=4, max_model_len=64)  # 16 token slots
    with pytest.raises(MacinferError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(MacinferError, match="at most 64"):
        engine.add_request([3] * 64, SamplingParams())
    with pytest.raises(MacinferError, match="KV cache holds 16"):
        engine.add_request([3] * 17, SamplingParams())
    # Fits at first, outgrows the whole pool while decoding: ends with "length", no hang.
    r = run(engine, [(0, [3] * 14, SamplingParams(max_tokens=10, ignore_eos=True), "big")])["big"][0]
    assert r.finish_reason == "length" and len(r.token_ids) == 3  # 14 + 2 tokens in KV, a 3rd sampled
    assert_all_free(engine)
    assert parse_bytes("2GB") == 2 * 10**9 and parse_bytes("2GiB") == 2 << 30 and parse_bytes("512 MiB") == 512 << 20
    with pytest.raises(MacinferError):
        parse_bytes("lots")


def test_kv_budget_and_describe(load):
    model, tok = load("llama")
    engine = LLMEngine(model, tok, None, kv_memory="64KiB", block_size=16, max_model_len=512)
    # "64KB" is 64,000 bytes (macinfer.units): a block fewer.
    assert LLMEngine(model, tok, None, kv_memory="64KB", block_size=16, max_model_len=512).block_pool.num_usable_blocks == 6
    # 2 layers x (K+V) x 2 kv heads x 16 dims x 4 bytes = 512 B/token -> 8 KiB/block.
    assert engine.bytes_per_token == 512 and engine.block_pool.num_usable_blocks == 7  # + the null block
    assert engine.runner.kv_bytes == 64 << 10
    assert "7 blocks x 16 tokens = 112 tokens" in engine.describe()
    engine.add_request([3] * 20, SamplingParams(max_tokens=4))
    engine.step()
    s = engine.kv_stats()
    assert s["used_blocks"] == 2 and s["live_tokens"] == 20 and s["reserved_bytes"] == 2 * 8192
    # A huge budget is capped at what max_num_seqs full-length sequences could use.
    big = LLMEngine(model, tok, None, kv_memory="1GB", max_num_seqs=2, max_model_len=512)
    assert big.block_pool.num_usable_blocks == 2 * 512 // 16


def test_default_budget_prefills_sixteen_short_prompts_in_one_step(load):
    # Many short prompts arriving together go through one forward, not one per 128 tokens:
    # each forward has a fixed cost, and recurrent layers cost their padded length whatever the rows.
    model, tok = load("llama")
    engine = LLMEngine(model, tok, None, num_blocks=128, max_num_seqs=16)
    for i in range(16):
        engine.add_request([3 + i] * 64, SamplingParams(max_tokens=2))
    out = engine.scheduler.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [64] * 16


def test_unpageable_architecture_is_refused():
    import mlx.nn as nn
    from mlx_lm.models.cache import QuantizedKVCache

    # Recurrent (ArraysCache) layers get state slots (tests/test_hybrid.py), chunked attention is masked
    # (llama4: tests/test_attention_variants.py); a cache type the engine does not know is refused.
    class Quantized(nn.Module):
        layers = [None]

        def make_cache(self):
            return [QuantizedKVCache()]

    with pytest.raises(MacinferError, match="oddity.*QuantizedKVCache"):
        inspect_model(Quantized(), "oddity")


def test_llm_interface(tiny_models):
    from macinfer.llm import LLM

    path = tiny_models("llama")
    llm = LLM(str(path), num_blocks=64, block_size=4)
    model, tok = mlx_lm.load(str(path))
    prompts = ["The quick brown fox", "Paged attention stores the key value cache", "What is"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12))
    for p, o in zip(prompts, outs):
        want, reason = oracle(model, tok.encode(p), 12, set(tok.eos_token_ids))
        assert o.token_ids == want and o.finish_reason == reason
    deltas = list(llm.stream("Once upon a time", SamplingParams(max_tokens=10, ignore_eos=True)))
    assert "".join(d.text for d in deltas) == deltas[-1].output.text and deltas[-1].finish_reason == "length"
    gen = llm.stream("Once upon a time", SamplingParams(max_tokens=50, ignore_eos=True))
    next(gen)
    gen.close()  # the caller walked away: aborted, blocks freed
    assert_all_free(llm.engine)
    assert llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3)).finish_reason
    with pytest.raises(MacinferError, match="empty"):
        llm.generate(["  "])
    with pytest.raises(MacinferError, match="shorten"):
        llm.generate([[5] * 600])


@pytest.mark.parametrize("name, overrides", [
    ("gemma", {"model_type": "gemma", "head_dim": 16}),
    ("gemma3_text", {"model_type": "gemma3_text", "head_dim": 16, "sliding_window": 6,
                     "sliding_window_pattern": 2, "query_pre_attn_scalar": 16}),
    ("phi3", {"model_type": "phi3", "tie_word_embeddings": False}),
])
def test_more_architectures_match_mlx_lm(load, name, overrides):
    model, tok = load("llama", **overrides)
    rng = random.Random(name)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (3, 11, 26)]
    engine = LLMEngine(model, tok, None, num_blocks=24, block_size=4, max_num_batched_tokens=12, max_num_seqs=4)
    results = run(engine, [(i, p, SamplingParams(max_tokens=14, ignore_eos=True), f"a{i}") for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert results[f"a{i}"][0].token_ids == oracle(model, p, 14)[0]
    assert_all_free(engine)


def test_attention_without_sdpa_is_refused():
    # Attention computed in the model's own code (as phi3small's block-sparse layers do) that no
    # variant routes (gemma2's soft-capping is routed: tests/test_attention_variants.py): paging
    # it would be silently wrong.
    import mlx.nn as nn

    class HandRolled(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Linear(4, 4)]

        def __call__(self, inputs, cache=None):
            k = mx.zeros((1, 1, inputs.shape[1], 4))
            k, v = cache[0].update_and_fetch(k, k)
            return (k @ v.swapaxes(-1, -2)).sum(1)

    with pytest.raises(MacinferError, match="handrolled.*cannot be paged"):
        inspect_model(HandRolled(), "handrolled")


def test_wired_limit_is_mlx_lms_recommended_one_on_metal_only(monkeypatch):
    """The engine wires memory as mlx-lm's generate and server do (maybe_set_recommended_wired_limit),
    and only where there is Metal."""
    import mlx.core as mx
    import mlx_lm.utils

    from macinfer.engine.config import wire_memory

    calls = []
    monkeypatch.setattr(mlx_lm.utils, "maybe_set_recommended_wired_limit", lambda: calls.append(1) or 0)
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    assert wire_memory() is False and calls == []
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    assert wire_memory() is True and calls == [1]
