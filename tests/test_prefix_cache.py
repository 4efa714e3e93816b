"""Prefix cache: exact blocks, ref counts and eviction order; outputs equal to cache off and to
mlx-lm; the persistent tier round-trips across engines and rejects bad files."""

from __future__ import annotations

import random
import shutil
import warnings
from pathlib import Path

import mlx.core as mx
import pytest

from macinfer.core.block_pool import BlockPool
from macinfer.engine.llm_engine import LLMEngine
from macinfer.prefix_cache.keys import hash_block_tokens, hash_blocks
from macinfer.core.sampling import SamplingParams
from macinfer.core.sequence import Sequence
from test_engine import assert_all_free, oracle, run

ROOT = b"model"


def ids(blocks):
    return [b.block_id for b in blocks]


def queue(pool):
    return [b.block_id for b in pool.free_block_queue]


def seq(rid, tokens):
    return Sequence(rid, list(tokens), SamplingParams())


def admit(pool, s):
    """What the scheduler does at admission, then "computes" the whole sequence."""
    hits, num_cached = pool.get_computed_blocks(s)
    assert pool.allocate_slots(s, s.num_tokens - num_cached, hits)
    s.num_computed_tokens = s.num_tokens
    pool.cache_full_blocks(s)
    return num_cached


# -- the block pool ---------------------------------------------------------------------
def test_hash_chain_depends_on_parent_tokens_and_model():
    a = hash_blocks(ROOT, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2 and a[1] == hash_block_tokens(a[0], [5, 6, 7, 8])
    assert hash_blocks(ROOT, [0, 2, 3, 4, 5, 6, 7, 8], 4)[1] != a[1]  # same block, other parent
    assert hash_blocks(b"other model", [1, 2, 3, 4], 4)[0] != a[0]
    assert hash_blocks(ROOT, [1, 2, 3, 4, 5, 6, 7, 8], 4, start=1, hashes=a[:1]) == a


def test_hits_take_refs_and_leave_the_free_queue():
    pool = BlockPool(num_blocks=10, block_size=4, enable_caching=True, cache_root=ROOT)
    a = seq("a", range(10))  # blocks [0..3] [4..7] full, [8 9] partial
    assert admit(pool, a) == 0 and a.block_table == [1, 2, 3]
    assert [b.block_hash is not None for b in pool.blocks[1:4]] == [True, True, False]
    b = seq("b", list(range(9)) + [99])  # diverges inside block 2
    assert admit(pool, b) == 8 and b.block_table == [1, 2, 4]
    assert [blk.ref_cnt for blk in pool.blocks[1:5]] == [2, 2, 1, 1]
    pool.free(a)
    assert [blk.ref_cnt for blk in pool.blocks[1:5]] == [1, 1, 0, 1]
    assert queue(pool) == [5, 6, 7, 8, 9, 3]  # shared blocks stay out of the queue
    pool.free(b)
    assert queue(pool) == [5, 6, 7, 8, 9, 3, 4, 2, 1]  # tail first: the prefix is evicted last
    c = seq("c", range(12))  # a's blocks are free but still cached: hits
    assert admit(pool, c) == 8 and c.block_table == [1, 2, 5]
    assert queue(pool) == [6, 7, 8, 9, 3, 4] and pool.blocks[5].block_hash is not None
    pool.free(c)
    assert pool.get_num_free_blocks() == pool.num_usable_blocks and pool.req_to_blocks == {}
    assert all(blk.ref_cnt == 0 for blk in pool.blocks[1:]) and pool.req_to_block_hashes == {}
    assert pool.stats.queries == 10 + 10 + 12 and pool.stats.hits == 16


def test_last_prompt_token_is_always_recomputed_in_a_block_of_its_own():
    pool = BlockPool(num_blocks=10, block_size=4, enable_caching=True, cache_root=ROOT)
    a = seq("a", range(8))  # ends exactly on a block boundary
    admit(pool, a)
    assert a.block_table == [1, 2] and pool.num_cached_blocks == 2
    same = seq("same", range(8))
    hits, n = pool.get_computed_blocks(same)
    assert ids(hits) == [1] and n == 4  # block 2 is cached too, but token 7 needs logits
    assert pool.allocate_slots(same, 4, hits) and same.block_table == [1, 3]  # never writes block 2
    longer = seq("longer", range(9))
    assert ids(pool.get_computed_blocks(longer)[0]) == [1, 2]
    assert pool.get_computed_blocks(seq("one", [0])) == ([], 0)


def test_lru_eviction_drops_hashes_only_when_blocks_are_reused():
    pool = BlockPool(num_blocks=6, block_size=2, enable_caching=True, cache_root=ROOT)  # 5 usable
    a, b = seq("a", [1, 2, 3, 4, 5]), seq("b", [7, 8, 9])
    admit(pool, a)
    admit(pool, b)
    assert a.block_table == [1, 2, 3] and b.block_table == [4, 5]
    pool.free(b)
    pool.free(a)
    assert queue(pool) == [5, 4, 3, 2, 1] and pool.num_cached_blocks == 3  # 1, 2 (a) and 4 (b)
    hit = seq("hit", [1, 2, 3, 4, 6])
    assert admit(pool, hit) == 4 and hit.block_table == [1, 2, 5]
    assert queue(pool) == [4, 3] and pool.stats.blocks_evicted == 0
    pool.free(hit)
    assert queue(pool) == [4, 3, 5, 2, 1]  # a's prefix, just used, is now the most recent
    new = seq("new", [50, 51, 52, 53, 54, 55])
    admit(pool, new)
    assert new.block_table == [4, 3, 5] and pool.stats.blocks_evicted == 1  # b's block 4
    assert pool.get_computed_blocks(seq("b2", [7, 8, 9]))[1] == 0
    assert pool.get_computed_blocks(seq("again", [1, 2, 3, 4, 6]))[1] == 4
    pool.free(new)
    assert queue(pool) == [2, 1, 5, 3, 4]
    admit(pool, seq("c", [60, 61, 62, 63]))  # takes the two least recently used
    assert pool.stats.blocks_evicted == 3 and pool.get_computed_blocks(seq("again", [1, 2, 3]))[1] == 0
    assert pool.num_cached_blocks == 3 + 2  # new's three blocks and c's two


def test_rollback_uncaches_blocks_it_will_rewrite():
    pool = BlockPool(num_blocks=6, block_size=2, enable_caching=True, cache_root=ROOT)
    s = seq("s", [1, 2, 3, 4, 5])
    admit(pool, s)
    assert pool.num_cached_blocks == 2
    s.num_computed_tokens = 3  # e.g. rejected speculative tokens
    pool.cache_full_blocks(s)
    assert pool.num_cached_blocks == 1 and pool.blocks[2].block_hash is None


class FakeStore:
    """A persistent tier holding some hashes; records what it was asked to load."""

    def __init__(self, hashes, bad=()):
        self.hashes, self.bad, self.loads = set(hashes), set(bad), []

    def num_leading(self, hashes):
        return next((i for i, h in enumerate(hashes) if h not in self.hashes), len(hashes))

    def load(self, entries):
        self.loads.append([(toks, bid) for _, toks, bid in entries])
        return next((i for i, (h, _, _) in enumerate(entries) if h in self.bad), len(entries))


def test_blocks_from_the_persistent_tier_extend_memory_hits():
    pool = BlockPool(num_blocks=7, block_size=2, enable_caching=True, cache_root=ROOT)
    a = seq("a", [1, 2, 3, 4, 5])
    admit(pool, a)
    pool.free(a)
    assert queue(pool) == [4, 5, 6, 3, 2, 1]
    h = hash_blocks(ROOT, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 2)
    pool.store = FakeStore(h[:4], bad=h[3:4])  # block 3's file turns out bad
    b = seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    hits, n = pool.get_computed_blocks(b)
    # Memory hits 1, 2; the tier fills block 2 (tokens 5, 6) into the LRU block 4, and
    # tokens 7, 8 into 5, which is then given back (the file was bad): never evicting 1 or 2.
    assert ids(hits) == [1, 2, 4] and n == 6
    assert pool.store.loads == [[([5, 6], 4), ([7, 8], 5)]]
    assert queue(pool) == [5, 6, 3, 1, 2, 4] and pool.stats.disk_loaded == 1
    assert pool.allocate_slots(b, 4, hits) and b.block_table == [1, 2, 4, 5, 6]
    assert [blk.ref_cnt for blk in pool.blocks[1:]] == [1, 1, 0, 1, 1, 1]


# -- the engine -------------------------------------------------------------------------
def engine_for(model, tok, **kw):
    opts = dict(num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=8)
    return LLMEngine(model, tok, None, **{**opts, **kw})


def test_hits_give_the_same_tokens_as_cache_off_and_mlx_lm(load):
    model, tok = load("llama")
    rng = random.Random(0)
    r = lambda n: [rng.randrange(3, 300) for _ in range(n)]  # noqa: E731
    on_boundary, off_boundary = r(16), r(18)
    prompts = {
        "base": on_boundary + r(5),
        "on": on_boundary + r(7),  # shares exactly 4 full blocks
        "off": off_boundary + r(3),
        "off2": off_boundary + r(6),  # shares 4 blocks + 2 tokens of a 5th: 16 cached
        "same": on_boundary,  # equal to a cached prefix that ends on a block boundary
        "same2": on_boundary,
    }
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    # One after the other, so each later prompt finds the earlier ones cached.
    plan = [(i * 20, p, params, rid) for i, (rid, p) in enumerate(prompts.items())]
    cached = engine_for(model, tok)
    with_cache = run(cached, plan)
    without = run(engine_for(model, tok, enable_prefix_cache=False), plan)
    want_cached = {"base": 0, "on": 16, "off": 0, "off2": 16, "same": 12, "same2": 12}
    for rid, p in prompts.items():
        out = with_cache[rid][0]
        assert out.token_ids == without[rid][0].token_ids == oracle(model, p, 12)[0], rid
        assert out.metrics.cached_tokens == want_cached[rid], rid
        assert without[rid][0].metrics.cached_tokens == 0
        # "same": every full block before the last token was a hit; "on": 7 tokens left to compute.
        m = out.metrics
        assert m.prompt_cached == (rid in ("same", "same2")) and not without[rid][0].metrics.prompt_cached, rid
        assert m.prefill_tps == (None if m.prompt_cached else (len(p) - m.cached_tokens) / m.ttft), rid
    s = cached.kv_stats()
    assert s["prefix_hit_tokens"] == 56 and s["prefix_hit_rate"] == pytest.approx(56 / sum(map(len, prompts.values())))
    assert s["cached_blocks"] > 0 and s["blocks_evicted"] == 0
    assert_all_free(cached)


def test_many_concurrent_requests_sharing_a_prefix(load):
    model, tok = load("qwen3")
    rng = random.Random(1)
    system = [rng.randrange(3, 300) for _ in range(22)]
    prompts = [system + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 9))] for _ in range(10)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    # Two arrive together (both miss), the rest while they decode (they hit); a small pool
    # forces eviction and preemption of sequences whose prefix blocks are shared.
    plan = [(0 if i < 2 else 3 + i // 3, p, params, f"c{i}") for i, p in enumerate(prompts)]
    engine = engine_for(model, tok, num_blocks=24, max_num_batched_tokens=24)
    results = run(engine, plan)
    for i, p in enumerate(prompts):
        assert results[f"c{i}"][0].token_ids == oracle(model, p, 10)[0], i
    assert [results[f"c{i}"][0].metrics.cached_tokens for i in range(2)] == [0, 0]
    assert all(results[f"c{i}"][0].metrics.cached_tokens == 20 for i in range(2, 10))
    assert engine.kv_stats()["blocks_evicted"] > 0 and engine.scheduler.num_preemptions > 0
    assert_all_free(engine)


# -- the persistent tier ------------------------------------------------------------------
def persistent(model, tok, path, **kw):
    return engine_for(model, tok, persist_prefix_cache=True, prefix_cache_dir=str(path), **kw)


def test_persistent_tier_round_trips_across_engines(load, tmp_path):
    model, tok = load("llama")
    prompt = list(range(10, 40))  # 7 full blocks + 2 tokens
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first = persistent(model, tok, tmp_path)
    want = run(first, [(0, prompt, params, "a")])["a"][0]
    files = sorted((tmp_path / first.model_id).glob("*.safetensors"))
    # Saved at finish: the 7 prompt blocks and the full block of generated tokens.
    assert len(files) == 9 and first.kv_stats()["disk_saved_blocks"] == 9

    second = persistent(model, tok, tmp_path)  # a new process, as far as the cache knows
    out = run(second, [(0, prompt, params, "a")])["a"][0]
    assert out.metrics.cached_tokens == 28 and out.token_ids == want.token_ids
    s = second.kv_stats()
    assert s["disk_loaded_blocks"] == 7 and s["disk_saved_blocks"] == 0 and s["disk_blocks"] == 9
    assert_all_free(second)

    # The size limit keeps the most recently used files.
    limit = 5 * max(f.stat().st_size for f in files)
    third = persistent(model, tok, tmp_path, prefix_cache_disk_bytes=limit)
    b = list(range(100, 110))
    out = run(third, [(0, b, params, "b")])["b"][0]  # 4 new blocks written
    s = third.kv_stats()
    assert s["disk_saved_blocks"] == 4 and s["disk_blocks"] == 5 and s["disk_bytes"] <= limit
    kept = {f.stem for f in (tmp_path / first.model_id).glob("*.safetensors")}
    assert {h.hex() for h in hash_blocks(bytes.fromhex(first.model_id), b + out.token_ids[:-1], 4)} < kept


def test_corrupt_and_foreign_files_are_rejected_with_one_warning(load, tmp_path):
    model, tok = load("llama")
    other, _ = load("llama", seed=1)  # same shapes, other weights
    prompt = list(range(50, 75))  # 6 full blocks
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = oracle(model, prompt, 6)[0]
    first = persistent(model, tok, tmp_path)
    run(first, [(0, prompt, params, "a")])
    d = tmp_path / first.model_id
    hashes = hash_blocks(bytes.fromhex(first.model_id), prompt, 4)
    (d / f"{hashes[2].hex()}.safetensors").write_bytes(b"\x00garbage" * 100)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(persistent(model, tok, tmp_path), [(0, prompt, params, "a")])["a"][0]
    msgs = [str(w.message) for w in caught if "prefix cache" in str(w.message)]
    assert len(msgs) == 1 and f"ignoring {d / hashes[2].hex()}.safetensors: unreadable" in msgs[0]
    assert out.metrics.cached_tokens == 8 and out.token_ids == want  # blocks 0, 1 only

    # A file another model saved, dropped under this model's name for block 0.
    foreign = persistent(other, tok, tmp_path)
    assert foreign.model_id != first.model_id
    run(foreign, [(0, prompt, params, "a")])
    shutil.copy(next((tmp_path / foreign.model_id).glob("*.safetensors")), d / f"{hashes[0].hex()}.safetensors")
    with pytest.warns(RuntimeWarning, match="saved by another model") as record:
        out = run(persistent(model, tok, tmp_path), [(0, prompt, params, "a")])["a"][0]
    assert len([w for w in record if "prefix cache" in str(w.message)]) == 1
    assert out.metrics.cached_tokens == 0 and out.token_ids == want
    # The bad file was deleted, and block 0 saved again, this time by this model.
    _, meta = mx.load(str(d / f"{hashes[0].hex()}.safetensors"), return_metadata=True)
    assert meta["model_id"] == first.model_id


@pytest.mark.parametrize("damage", ["flip one byte", "scale the values"])
def test_damaged_tensor_data_is_rejected_not_decoded(load, tmp_path, damage):
    """A file whose metadata is intact but whose K/V bytes changed is never loaded: the output
    stays mlx-lm's and the block is recomputed (without the digest it loaded and decoded garbage)."""
    model, tok = load("llama")
    prompt = list(range(50, 75))  # 6 full blocks of 4
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = oracle(model, prompt, 6)[0]
    first = persistent(model, tok, tmp_path)
    run(first, [(0, prompt, params, "a")])
    path = tmp_path / first.model_id / f"{hash_blocks(bytes.fromhex(first.model_id), prompt, 4)[1].hex()}.safetensors"
    if damage == "flip one byte":
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x40  # inside the last tensor's data
        path.write_bytes(bytes(data))
    else:
        arrays, meta = mx.load(str(path), return_metadata=True)
        mx.save_safetensors(str(path), {k: v * 4 for k, v in arrays.items()}, metadata=meta)
    with pytest.warns(RuntimeWarning, match="does not match its checksum"):
        out = run(persistent(model, tok, tmp_path), [(0, prompt, params, "a")])["a"][0]
    assert out.metrics.cached_tokens == 4 and out.token_ids == want  # block 0 only, then recomputed


def test_macinfer_run_twice_skips_the_cached_system_prompt(tiny_models, tmp_path, monkeypatch):
    import json

    from click.testing import CliRunner

    from macinfer.cli.main import main

    monkeypatch.setenv("MACINFER_PREFIX_CACHE_DIR", str(tmp_path))
    path = str(tiny_models("llama"))
    system = "Paged attention stores the key value cache in fixed size blocks. " * 6
    argv = ["run", path, "What is the capital of France?", "--system", system, "-n", "6", "--peak-bandwidth", "100"]

    def run_cli(*extra):
        r = CliRunner().invoke(main, [*argv, *extra])
        assert r.exit_code == 0, r.output
        return r

    cold = json.loads(run_cli("--json").stdout.strip().splitlines()[-1])
    warm = run_cli()
    line = warm.stderr.strip().splitlines()[-1]
    assert "cached) | TTFT" in line and "| prompt cached |" in line and "prefill" not in line
    warm = json.loads(run_cli("--json").stdout.strip().splitlines()[-1])
    assert warm["prompt_cached"] and warm["prefill_tps"] is None
    assert not cold["prompt_cached"] and cold["prefill_tps"] == pytest.approx(cold["prompt_tokens"] / cold["ttft_s"])
    off = json.loads(run_cli("--json", "--no-prefix-cache").stdout.strip().splitlines()[-1])
    assert cold["cached_tokens"] == 0 == off["cached_tokens"]
    assert warm["cached_tokens"] == (warm["prompt_tokens"] - 1) // 16 * 16 > 0
    assert cold["token_ids"] == warm["token_ids"] == off["token_ids"]


def test_a_corrupt_cache_file_is_one_warning_line_for_a_user(tiny_models, tmp_path):
    """`macinfer run` meets a damaged block file: one `warning: prefix cache: ...` line on stderr, not
    Python's warning with a source path and a code line; the reply is the same."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MACINFER_PREFIX_CACHE_DIR": str(tmp_path)}
    argv = [sys.executable, "-m", "macinfer", "run", str(tiny_models("llama")), "x " * 40, "-n", "4",
            "--no-chat-template", "--peak-bandwidth", "100"]
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    # Every block file damaged: which one holds the prompt's first blocks depends on their hashes (the
    # first one sorted may hold only the reply's), and the first one read ends the lookup there.
    for block in tmp_path.glob("*/*.safetensors"):
        data = bytearray(block.read_bytes())
        data[-3] ^= 0x40
        block.write_bytes(bytes(data))
    second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and second.stdout == first.stdout
    warned = [line for line in second.stderr.splitlines() if "prefix cache" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: prefix cache: ignoring "), second.stderr
    assert "Warning:" not in second.stderr and ".py:" not in second.stderr


def pools(H, nb, bs, dims, dtype, seed):
    """One layer's k / v pools (head-major slots) of random values, as a PagedKVCache holds them."""
    from types import SimpleNamespace

    k, v = (mx.random.normal((H, nb * bs, d), key=mx.random.key(seed + i)).astype(dtype) for i, d in enumerate(dims))
    return SimpleNamespace(k_pool=k, v_pool=v, state=[k, v])


def test_block_files_stay_token_major_whatever_the_pool_layout(tmp_path):
    """A file is one safetensors tensor of the block's bytes: each pool's part (block_size,
    n_kv_heads, head_dim), token-major, as the layout in its metadata says (read back here with
    MLX's own safetensors reader); it loads into the right slots of another engine's pools.
    K and V head dims differ (MLA-style) and one layer is bfloat16 (no numpy dtype)."""
    import json

    from macinfer.prefix_cache.disk import FORMAT, DiskPrefixStore

    bs, H, nb = 4, 2, 6
    src = [pools(H, nb, bs, (8, 4), mx.float32, 0), pools(H, nb, bs, (8, 4), mx.bfloat16, 2)]
    store = DiskPrefixStore(tmp_path / "m", "m", src, bs, 1 << 30)
    h, ids_ = b"\x01" * 32, [5, 6, 7, 8]
    assert store.save([(h, ids_, 3)]) == 1  # block 3 = slots 12..15
    arrays, meta = mx.load(str(tmp_path / "m" / f"{h.hex()}.safetensors"), return_metadata=True)
    assert meta["format"] == FORMAT == "macinfer-prefix-block/3" and list(arrays) == ["kv"]
    layout = json.loads(meta["layout"])
    assert layout == [["k.0", [bs, H, 8], "float32"], ["v.0", [bs, H, 4], "float32"],
                      ["k.1", [bs, H, 8], "bfloat16"], ["v.1", [bs, H, 4], "bfloat16"]]
    offset = 0
    for (name, shape, dtype), c in zip(layout, [src[0], src[0], src[1], src[1]]):
        pool = c.k_pool if name[0] == "k" else c.v_pool
        size = shape[0] * shape[1] * shape[2] * pool.dtype.size
        part = arrays["kv"][offset: offset + size].view(getattr(mx, dtype)).reshape(shape)
        assert mx.array_equal(part, pool[:, 12:16].transpose(1, 0, 2)).item(), name
        offset += size
    assert offset == arrays["kv"].size

    dst = [pools(H, nb, bs, (8, 4), dt, 9) for dt in (mx.float32, mx.bfloat16)]
    before = [(c.k_pool, c.v_pool) for c in dst]
    store2 = DiskPrefixStore(tmp_path / "m", "m", dst, bs, 1 << 30)
    assert store2.load([(h, ids_, 5)]) == 1  # into block 5 = slots 20..23
    for c, s, (k0, v0) in zip(dst, src, before):
        assert mx.array_equal(c.k_pool[:, 20:24], s.k_pool[:, 12:16]).item()
        assert mx.array_equal(c.v_pool[:, 20:24], s.v_pool[:, 12:16]).item()
        assert mx.array_equal(c.k_pool[:, :20], k0[:, :20]).item() and mx.array_equal(c.v_pool[:, :20], v0[:, :20]).item()


@pytest.mark.skipif(not Path("/proc/self/io").is_file(), reason="counts read calls with Linux's /proc/self/io")
def test_a_load_reads_each_file_whole_whatever_the_layers(tmp_path):
    """Loading n blocks issues a few read calls per file (header, then all its bytes), not one per
    layer's K and V: the kernel's count of this process's read calls is the oracle. (Reading tensor
    by tensor took 62 read calls a file: 7,750 for the 125 files of a 2,000-token SmolLM2 prefix.)"""
    from macinfer.prefix_cache.disk import DiskPrefixStore

    def read_calls() -> int:
        return int(next(line for line in open("/proc/self/io") if line.startswith("syscr")).split()[1])

    bs, H, L, n = 16, 2, 30, 20
    src = [pools(H, n + 1, bs, (8, 8), mx.float32, i) for i in range(L)]
    entries = [(bytes([j]) * 32, list(range(j * bs, (j + 1) * bs)), j + 1) for j in range(n)]
    assert DiskPrefixStore(tmp_path / "m", "m", src, bs, 1 << 30).save(entries) == n
    dst = [pools(H, n + 1, bs, (8, 8), mx.float32, 100 + i) for i in range(L)]
    store = DiskPrefixStore(tmp_path / "m", "m", dst, bs, 1 << 30)
    before = read_calls()
    assert store.load(entries) == n
    assert read_calls() - before <= 3 * n + 5  # 8-byte length, header, data; + reading the counter
    for s, d in zip(src, dst):  # every block in its slots
        assert mx.array_equal(d.k_pool[:, bs:], s.k_pool[:, bs:]).item()
        assert mx.array_equal(d.v_pool[:, bs:], s.v_pool[:, bs:]).item()


@pytest.mark.parametrize("order", ["consecutive", "three runs", "scattered"])
def test_loaded_blocks_land_in_their_slots_however_the_ids_fall(tmp_path, order):
    """Blocks go into the pools by runs of consecutive ids: however many runs, block j's rows land in
    block id[j]'s slots and nothing else changes (float32 and bfloat16 pools)."""
    from macinfer.prefix_cache.block_file import slot_runs
    from macinfer.prefix_cache.disk import DiskPrefixStore

    bs, H, n, nb = 4, 2, 20, 64
    ids_ = {"consecutive": list(range(30, 30 + n)), "three runs": [*range(5, 12), *range(40, 47), *range(20, 26)],
            "scattered": list(range(60, 60 - 2 * n, -2))}[order]
    runs = len(slot_runs(ids_, bs))
    assert runs == {"consecutive": 1, "three runs": 3, "scattered": n}[order]
    src = [pools(H, nb, bs, (8, 4), mx.float32, 0), pools(H, nb, bs, (8, 4), mx.bfloat16, 2)]
    entries = [(bytes([j]) * 32, list(range(j * bs, (j + 1) * bs)), j + 1) for j in range(n)]
    assert DiskPrefixStore(tmp_path / "m", "m", src, bs, 1 << 30).save(entries) == n
    dst = [pools(H, nb, bs, (8, 4), dt, 9) for dt in (mx.float32, mx.bfloat16)]
    want = [[mx.array(c.k_pool), mx.array(c.v_pool)] for c in dst]
    for (k, v), s in zip(want, src):
        for j, b in enumerate(ids_):  # block j (saved from block j + 1) belongs in block b
            k[:, b * bs:(b + 1) * bs] = s.k_pool[:, (j + 1) * bs:(j + 2) * bs]
            v[:, b * bs:(b + 1) * bs] = s.v_pool[:, (j + 1) * bs:(j + 2) * bs]
    assert DiskPrefixStore(tmp_path / "m", "m", dst, bs, 1 << 30).load(
        [(h, t, b) for (h, t, _), b in zip(entries, ids_)]) == n
    for c, (k, v) in zip(dst, want):
        assert mx.array_equal(c.k_pool, k).item() and mx.array_equal(c.v_pool, v).item()


def test_files_of_an_older_format_are_all_removed_with_one_warning(load, tmp_path):
    """After an upgrade, the first file of the old format met removes every one of this model's
    (one warning, not one per run as each file is met); the prompt is recomputed and saved again."""
    model, tok = load("llama")
    prompt = list(range(50, 75))  # 6 full blocks of 4
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = oracle(model, prompt, 6)[0]
    first = persistent(model, tok, tmp_path)
    run(first, [(0, prompt, params, "a")])
    files = sorted((tmp_path / first.model_id).glob("*.safetensors"))
    for f in files:  # as an older macinfer wrote them (the format name is all that is read)
        arrays, meta = mx.load(str(f), return_metadata=True)
        mx.save_safetensors(str(f), arrays, metadata={**meta, "format": "macinfer-prefix-block/2"})
    with pytest.warns(RuntimeWarning, match="prefix-block/2") as record:
        out = run(persistent(model, tok, tmp_path), [(0, prompt, params, "a")])["a"][0]
    msgs = [str(w.message) for w in record if "prefix cache" in str(w.message)]
    assert len(msgs) == 1 and f"removed {len(files)} such file(s)" in msgs[0]
    assert out.metrics.cached_tokens == 0 and out.token_ids == want
    again = run(persistent(model, tok, tmp_path), [(0, prompt, params, "a")])["a"][0]
    assert again.metrics.cached_tokens == 24 and again.token_ids == want


def test_stale_temp_files_are_removed_when_a_store_opens(tmp_path):
    """A process killed mid-write leaves `.<hash>.<pid>.tmp` (outside the size limit): any model's,
    an hour old, is removed when a store opens; a fresh one (a live writer's) and block files stay."""
    import os

    from macinfer.prefix_cache.disk import DiskPrefixStore

    (tmp_path / "other").mkdir()
    names = {"m/.aa.1.tmp": 7200, "other/.bb.2.tmp": 7200, "m/.cc.3.tmp": 0, "other/dd.safetensors": 7200}
    for name, age in names.items():
        p = tmp_path / name
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"x" * 10)
        os.utime(p, (p.stat().st_mtime - age,) * 2)
    DiskPrefixStore(tmp_path / "m", "m", [], 16, 1 << 30)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("*/*"))
    assert left == ["m/.cc.3.tmp", "other/dd.safetensors"]
