"""The prefix cache on hybrid / SSM models: recurrent-state snapshots at block boundaries
(macinfer.core.state_snapshots), against mlx-lm.

A prefix hit is only taken up to a block whose end has a state snapshot; these tests assert the
exact number of cached tokens (where the snapshots must be), mlx-lm's tokens, and that every
block, slot and snapshot byte is accounted for after each run.
"""

from __future__ import annotations

import random

import pytest

from macinfer.prefix_cache.keys import hash_blocks
from macinfer.core.sampling import SamplingParams
from macinfer.core.state_snapshots import StateSnapshots
from macinfer.engine.llm_engine import LLMEngine
from test_hybrid import ScriptedDrafter, assert_all_free, hybrid, model_vocab, oracle, run, uneven  # noqa: F401

FAMILIES = ["qwen3_next", "lfm2", "mamba2"]
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


def rand(rng, n):
    return [rng.randrange(3, 300) for _ in range(n)]


def assert_snapshots_exact(engine):
    """Everything back in its pool; snapshot bytes = count x slot size, each snapshot one slot's
    arrays of its own, each naming a findable block."""
    assert_all_free(engine)
    snaps, pool = engine.snapshots, engine.block_pool
    assert snaps.pending == {}  # every sequence finished: promoted or dropped
    assert snaps.size == engine.specs.bytes_per_slot
    assert snaps.nbytes == len(snaps.entries) * snaps.size <= snaps.capacity == engine.snapshot_bytes
    for h, arrays in snaps.entries.items():
        assert h in pool.cached_block_hash_to_block
        assert len(arrays) == len(engine.specs.states)
        assert sum(a.nbytes for layer in arrays for a in layer) == snaps.size
        assert all(a.shape[0] == 1 for layer in arrays for a in layer)
    s = engine.kv_stats()
    assert s["state_snapshots"] == len(snaps.entries) and s["state_snapshot_bytes"] == snaps.nbytes
    assert s["state_snapshots_pending"] == 0


def engine_for(model, tok, **kw):
    opts = dict(num_blocks=64, block_size=4, max_num_batched_tokens=12, max_num_seqs=4,
                state_snapshot_memory=f"{16 * 64 << 10}B")
    opts.update(kw)
    engine = LLMEngine(model, tok, None, **opts)
    engine.scheduler.min_snapshot_tokens = engine.scheduler.min_spare_tokens = 0  # tiny prompts: snapshot anyway
    return engine


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("name", FAMILIES)
def test_second_request_and_chat_turn_start_at_the_snapshot(hybrid, name, async_scheduling):
    path, model, tok = hybrid(name)
    rng = random.Random(name)
    p1 = rand(rng, 33)  # blocks of 4: the snapshot at 32 (last full block before the last token)
    engine = engine_for(model, tok, async_scheduling=async_scheduling)
    o1 = run(engine, [(0, p1, PARAMS, "a")])["a"]
    assert o1.metrics.cached_tokens == 0 and o1.token_ids == oracle(model, p1, 10)
    # The same prompt, longer: starts at 32; chunks of 12 from 0 ended at 12, 16, 24, 28, 32
    # (capped: snapshots at 32 and, spare, 28, 24 and 16).
    p2 = p1 + rand(rng, 6)
    o2 = run(engine, [(0, p2, PARAMS, "b")])["b"]
    assert o2.metrics.cached_tokens == 32 and o2.token_ids == oracle(model, p2, 10)
    # A second chat turn: the prompt holds the first one's reply (43 tokens, 42 computed):
    # the reply's last full block ends at 40.
    p3 = p1 + o1.token_ids + rand(rng, 5)
    o3 = run(engine, [(0, p3, PARAMS, "c")])["c"]
    assert o3.metrics.cached_tokens == 40 and o3.token_ids == oracle(model, p3, 10)
    # The very same prompt again: its own snapshot at 32 (and p2's reply does not match it).
    o4 = run(engine, [(0, p1, PARAMS, "d")])["d"]
    assert o4.metrics.cached_tokens == 32 and o4.token_ids == o1.token_ids
    assert engine.snapshots.stats.hits == 3
    assert_snapshots_exact(engine)


@pytest.mark.parametrize("name", FAMILIES)
def test_hit_without_a_snapshot_at_its_end_is_shortened(hybrid, name):
    path, model, tok = hybrid(name)
    rng = random.Random(3)
    prefix = rand(rng, 30)
    engine = engine_for(model, tok)
    prompts = {"r1": prefix + rand(rng, 13), "r2": prefix + rand(rng, 6), "r3": prefix + rand(rng, 4)}
    cached = {}
    for rid, p in prompts.items():
        out = run(engine, [(0, p, PARAMS, rid)])[rid]
        assert out.token_ids == oracle(model, p, 10), rid
        cached[rid] = out.metrics.cached_tokens
    # r1 (43 tokens) leaves snapshots at 40 and, spare, 36, 32 and 24. r2 shares 7 blocks (28 tokens)
    # with it, but the last snapshot among them is at 24: shortened to 24; r2 snapshots where the
    # shared blocks ended, so r3 starts at 28.
    assert cached == {"r1": 0, "r2": 24, "r3": 28}
    assert engine.snapshots.stats.shortened == 1
    assert engine.kv_stats()["prefix_hit_tokens"] == 24 + 28
    assert_snapshots_exact(engine)


@pytest.mark.parametrize("name", FAMILIES)
def test_batched_preempted_prefix_hits_match_mlx_lm(hybrid, monkeypatch, name):
    path, model, tok = hybrid(name)
    rng = random.Random(9)
    prefix = rand(rng, 22)
    warm = prefix + rand(rng, 1)  # leaves a snapshot at 20
    prompts = [prefix + rand(rng, n) for n in (9, 6, 11)]
    engine = engine_for(model, tok, num_blocks=16, max_num_batched_tokens=8, max_num_seqs=3, async_scheduling=True)
    preempted = []
    preempt = type(engine.scheduler)._preempt
    monkeypatch.setattr(type(engine.scheduler), "_preempt", lambda self, seq: preempted.append(seq.request_id)
                        or preempt(self, seq))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    out = run(engine, [(0, warm, params, "warm")] + [(14 + i, p, params, f"p{i}") for i, p in enumerate(prompts)])
    assert preempted, "nothing was preempted"
    assert out["warm"].token_ids == oracle(model, warm, 12)
    for i, p in enumerate(prompts):
        assert out[f"p{i}"].token_ids == oracle(model, p, 12), f"p{i}"
    assert all(out[f"p{i}"].metrics.cached_tokens >= 20 for i in range(3))
    assert engine.kv_stats()["blocks_evicted"] > 0  # a small pool: snapshots went with their blocks
    assert_snapshots_exact(engine)


def test_speculative_decoding_with_prefix_hits_is_exact(hybrid):
    path, model, tok = hybrid("qwen3_next")
    rng = random.Random(13)
    prefix = rand(rng, 26)
    s0 = prefix + rand(rng, 3)  # snapshot at 28
    prompts = {"s0": s0, "s1": s0 + rand(rng, 7), "s2": prefix + rand(rng, 5), "s3": prefix + rand(rng, 4)}
    want = {rid: oracle(model, p, 14) for rid, p in prompts.items()}
    prompts["s4"] = s0 + want["s0"] + rand(rng, 3)  # a next chat turn: s0's reply was decoded with drafts
    want["s4"] = oracle(model, prompts["s4"], 14)
    drafter = ScriptedDrafter({tuple(prompts[r]): w for r, w in want.items()}, model_vocab(model))
    engine = engine_for(model, tok, max_num_batched_tokens=16, max_num_seqs=3, draft=drafter,
                        num_speculative_tokens=3, adaptive_speculation=False)
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    out = run(engine, [(0, prompts["s0"], params, "s0")])
    out |= run(engine, [(0, prompts["s1"], params, "s1"), (0, prompts["s2"], params, "s2")])  # batched
    out |= run(engine, [(0, prompts["s3"], params, "s3")])
    out |= run(engine, [(0, prompts["s4"], params, "s4")])
    for rid in prompts:
        assert out[rid].token_ids == want[rid], rid
    # A reply decoded with drafts gets a snapshot only where a step ended on a block boundary; here
    # (29, 31, 35, 39, then it finished) none did: s4 starts at s0's prompt snapshot.
    assert out.pop("s4").metrics.cached_tokens == 28
    # s1 extends s0's prompt (snapshot at 28); s2 and s3 share 6 blocks with it: the spare snapshot at 24.
    assert {r: o.metrics.cached_tokens for r, o in out.items()} == {"s0": 0, "s1": 28, "s2": 24, "s3": 24}
    assert sum(o.metrics.accepted_tokens for o in out.values()) > 0
    assert_snapshots_exact(engine)


@pytest.mark.parametrize("name", ["lfm2", "mamba2"])
def test_snapshots_go_with_their_blocks(hybrid, name):
    path, model, tok = hybrid(name)
    rng = random.Random(21)
    first = rand(rng, 21)
    engine = engine_for(model, tok, num_blocks=12)  # 11 blocks of 4 tokens
    run(engine, [(0, first, PARAMS, "a")])
    h20 = hash_blocks(engine.block_pool.cache_root, first, 4)[4]  # the block ending at 20
    assert h20 in engine.snapshots  # the snapshot at 20
    for i in range(3):  # other prompts take every block: the first one's are evicted
        p = rand(rng, 30)
        assert run(engine, [(0, p, PARAMS, f"o{i}")])[f"o{i}"].token_ids == oracle(model, p, 10)
    assert h20 not in engine.snapshots and engine.snapshots.stats.dropped > 0
    again = run(engine, [(0, first, PARAMS, "b")])["b"]
    assert again.metrics.cached_tokens == 0 and again.token_ids == oracle(model, first, 10)
    assert_snapshots_exact(engine)


def test_short_prompts_are_not_cut_for_snapshots(hybrid, uneven):
    path, model, tok = hybrid("lfm2")
    rng = random.Random(4)
    engine = LLMEngine(model, tok, None, num_blocks=256, block_size=4, max_num_batched_tokens=512, max_num_seqs=2,
                       state_snapshot_memory="64KiB")
    short, long_ = rand(rng, 40), rand(rng, 270)
    out = run(engine, [(0, short, PARAMS, "short")])
    assert uneven["forwards"] == 10 and len(engine.snapshots) == 1  # one prefill forward; the reply's snapshot
    out |= run(engine, [(0, long_, PARAMS, "long")])
    # 270 tokens: cut at 252 (the last full block before the last token), 248, 244 and 236 (spare).
    assert uneven["forwards"] == 10 + 5 + 9 and len(engine.snapshots) == 1 + 4 + 1
    assert out["long"].token_ids == oracle(model, long_, 10) and out["short"].token_ids == oracle(model, short, 10)
    assert_snapshots_exact(engine)


def test_snapshot_store_lru_and_pending_bounds():
    s = StateSnapshots(capacity_bytes=400, bytes_per_snapshot=100)
    for h in (b"a", b"b", b"c"):
        assert s.put(h, [[h]])
    assert not s.put(b"a", [[b"x"]]) and list(s.entries) == [b"b", b"c", b"a"]  # refreshed, kept
    assert s.get(b"b") == [[b"b"]] and list(s.entries) == [b"c", b"a", b"b"]
    assert s.put_pending("r1", 8, [[1]]) and s.nbytes == 400
    assert s.put_pending("r2", 8, [[2]]) and list(s.entries) == [b"a", b"b"]  # LRU entry made room
    assert not s.put_pending("r3", 8, [[3]])  # pending ones hold at most half
    assert s.put_pending("r1", 12, [[4]]) and s.pending["r1"] == (12, [[4]])  # replaced in place
    s.drop(b"a")
    assert list(s.entries) == [b"b"] and s.stats.dropped == 1 and s.stats.evicted == 1
    assert s.take_pending("r2") == (8, [[2]]) and s.nbytes == 200
    assert StateSnapshots(50, 100).put(b"z", [[0]]) is False  # smaller than one snapshot: nothing kept
    assert s.put(b"spare", [[5]], spare=True) and list(s.entries) == [b"spare", b"b"]  # dropped first
    assert s.get(b"spare") and list(s.entries) == [b"b", b"spare"]  # unless it is used
