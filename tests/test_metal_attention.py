"""The Metal paged-attention kernel's algorithm, its source, and backend selection, on the CPU.

Nothing here runs on Metal. Three oracles instead:
- a tiny gather + SDPA (below): the NumPy algorithm reference must match it;
- the NumPy algorithm reference: the kernels' source as MLX generates it, compiled as C++
  against a shim of the Metal built-ins and run by a small SIMT emulator (tests/metal_emulator.py,
  built with clang++, Apple's compiler, where present), must match it; the emulator also counts
  the K/V bytes each kernel reads;
- monkeypatched kernels for the selection logic (compile failure, run failure, mismatch, and
  the emulated kernel).
The full grid (every head size, block size, dtype and KV bits) is scripts/metal_emulator_grid.py.
"""

import math
import shutil
import tempfile
import warnings
from pathlib import Path

import metal_emulator as me
import metal_kernel_v1
import mlx.core as mx
import numpy as np
import pytest

from macinfer.errors import MacinferError
from macinfer.kv import kernel_dispatch as kd
from macinfer.kv import metal_attention as ma
from macinfer.kv.paged_attention import QuantPool, paged_attention


def gather_sdpa(queries, k_pool, v_pool, block_tables, context_lens, *, block_size, scale, window=None, sinks=None,
                softcap=None, chunk=None, memo=None):
    """Oracle: gather each row's slots (head-major pools) to contiguous K/V (quantised pools: then
    dequantised, with MLX's own mx.dequantize), then MLX's SDPA (soft-capped scores: by hand,
    tests/test_attention_variants.py checks that one)."""
    B, H, QL, D = queries.shape
    BS = block_size
    tables = np.asarray(ma.padded_tables(block_tables, context_lens, BS))
    out = []
    for b, C in enumerate(int(c) for c in context_lens):
        slots = mx.array([int(tables[b, pos // BS]) * BS + pos % BS for pos in range(C)])
        k, v = (p[:, slots][None] if isinstance(p, mx.array) else mx.dequantize(
            *(x[:, slots][None] for x in p[:3]), group_size=p.group_size, bits=p.bits) for p in (k_pool, v_pool))
        pos = mx.arange(C - QL, C)[:, None]
        key = mx.arange(C)[None]
        mask = key <= pos
        if window:
            mask = mask & (key > pos - window)
        if chunk:  # llama4: its own chunk only
            mask = mask & (key >= pos // chunk * chunk)
        if softcap is not None:
            from macinfer.kv.paged_attention import softcapped_attention

            out.append(softcapped_attention(queries[b: b + 1], k, v, scale=scale, mask=mask, softcap=softcap))
            continue
        out.append(mx.fast.scaled_dot_product_attention(queries[b: b + 1], k, v, scale=scale, mask=mask, sinks=sinks))
    return mx.concatenate(out)


def poison_unused_slots(args):
    """NaN in every pool slot no query may read: tails of last blocks, null and spare blocks."""
    BS = args["block_size"]
    used = np.zeros(args["k_pool"].shape[1], bool)  # per slot, in every head
    tables = np.asarray(ma.padded_tables(args["block_tables"], args["context_lens"], BS))
    for b, C in enumerate(args["context_lens"]):
        for pos in range(C):
            used[tables[b, pos // BS] * BS + pos % BS] = True
    for name in ("k_pool", "v_pool"):
        if isinstance(args[name], QuantPool):  # NaN scales: any unused slot read dequantises to NaN
            scales = np.array(args[name].scales)
            scales[:, ~used] = np.nan
            args[name] = args[name]._replace(scales=mx.array(scales))
            continue
        pool = np.array(args[name])
        pool[:, ~used] = np.nan
        args[name] = mx.array(pool)
    return args


def assert_close(got, want, tol=1e-5):
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    assert got.shape == want.shape
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


# ---------------------------------------------------------------- algorithm reference vs gather + SDPA


def lengths(BS, q_len):
    # ending on a block boundary, one past it, one short of it, and the shortest legal row
    return [2 * BS, 3 * BS + 1, 5 * BS - 1, q_len]


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("gqa", [1, 3, 4, 8])
@pytest.mark.parametrize("q_len", [1, 2, 3, 8])
def test_reference_matches_gather_sdpa(block_size, gqa, q_len):
    window = None if q_len % 2 else block_size + 3  # windows that start mid-block
    args = ma.random_problem(
        block_size * 10 + gqa * 3 + q_len, context_lens=lengths(block_size, q_len), q_len=q_len,
        n_heads=2 * gqa, n_kv_heads=2, head_dim=32, block_size=block_size, window=window)
    args = poison_unused_slots(args)
    want = gather_sdpa(**args)
    assert_close(ma.paged_attention_online(**args), want)
    assert_close(ma.paged_attention_online(**args, splits=3, tile=2), want)


@pytest.mark.parametrize("window", [1, 7, 16, 17, 1000])
def test_reference_windows(window):
    args = poison_unused_slots(ma.random_problem(
        window, context_lens=[40, 16, 5], q_len=4, n_heads=4, n_kv_heads=1, head_dim=16,
        block_size=8, window=window))
    assert_close(ma.paged_attention_online(**args, splits=2), gather_sdpa(**args))


@pytest.mark.parametrize("chunk,window", [(1, None), (5, None), (8, None), (13, None), (1000, None), (6, 4)])
def test_reference_chunks(chunk, window):
    """Chunked attention (llama4): chunks that end mid-block and on block ends; with a window inside them too."""
    args = ma.random_problem(chunk, context_lens=[40, 16, 5], q_len=4, n_heads=4, n_kv_heads=1, head_dim=16,
                             block_size=8, chunk=chunk, window=window)
    want = gather_sdpa(**args)
    assert_close(ma.paged_attention_online(**poison_unused_slots(dict(args)), splits=2), want)
    assert_close(paged_attention(**args), want)  # the engine's path (its pools hold no NaN: zeros, stale K/V)
    # The same rows as single rows (one-row path: only the chunk's blocks are read).
    for b, C in enumerate(args["context_lens"]):
        one = {**args, "queries": args["queries"][b: b + 1], "block_tables": args["block_tables"][b: b + 1],
               "context_lens": [C]}
        assert_close(paged_attention(**one), want[b: b + 1])
    if chunk < 40:
        assert not np.allclose(np.array(want), np.array(gather_sdpa(**{**args, "chunk": None})), atol=1e-3)


@pytest.mark.parametrize("context_lens", [[1], [9], [64], [3, 200, 17, 8, 33, 1]])
def test_reference_batch_shapes(context_lens):
    args = poison_unused_slots(ma.random_problem(
        len(context_lens), context_lens=context_lens, q_len=1, n_heads=3, n_kv_heads=3,
        head_dim=24, block_size=8))
    assert_close(ma.paged_attention_online(**args), gather_sdpa(**args))


def test_reference_accepts_lists_and_keeps_dtype():
    args = ma.random_problem(1, context_lens=[10, 3], q_len=2, head_dim=16, block_size=4, dtype=mx.bfloat16)
    want = gather_sdpa(**{**args, **{k: args[k].astype(mx.float32) for k in ("queries", "k_pool", "v_pool")}})
    tables = [[int(i) for i in row if i] for row in args["block_tables"].tolist()]
    got = ma.paged_attention_online(**{**args, "block_tables": tables})
    assert got.dtype == mx.bfloat16
    assert_close(got, want, tol=2e-2)


def test_reference_matches_engine_paged_attention():
    engine = pytest.importorskip("macinfer.kv.paged_attention")
    for i, case in enumerate(kd.class_cases(kd.layer_kind(mx.float32, 32), 8, 2, True)):
        args = ma.random_problem(i, **case)
        assert_close(ma.paged_attention_online(**args), engine.paged_attention(**args))


def test_padded_row_with_a_short_table_is_read_within_its_table():
    """A prefill chunk of 3 tokens batched with one of 8 (L = 8): the short row's context_len counts
    its 5 padding tokens (9 + 8 = 17 -> 5 blocks of 4) while its table holds the 3 blocks its 12
    real tokens need. The reference (and the kernel, same index arithmetic) read entry 4 of a
    3-entry table: IndexError before the tables were padded to every row's context."""
    from macinfer.kv.paged_attention import paged_attention

    bs, L = 4, 8
    args = ma.random_problem(0, context_lens=[16, 12], q_len=L, n_heads=4, n_kv_heads=2, head_dim=32, block_size=bs)
    tables = [list(map(int, row[:4])) for row in np.asarray(args["block_tables"])]
    tables[1] = tables[1][:3]
    args.update(block_tables=tables, context_lens=[16, 9 + L])
    got = ma.paged_attention_online(**args)
    want = paged_attention(**args)
    assert_close(got[0], want[0])
    assert_close(got[1, :, :3], want[1, :, :3])  # the short row's 3 real queries
    call = ma.kernel_call(**args)
    assert call.pass1["inputs"][3].shape == (2, 5)  # every table covers its row's context


# ---------------------------------------------------------------- the launch and the Metal source


def test_launch_plan():
    """Rows per KV head go to simdgroups; long contexts split until the GPU has work, each split >= 256 keys."""
    plan = ma.launch_plan(1, 32, 1, 8, 128, 16, 256)  # decode, GQA 4, 4096 tokens, one sequence
    assert (plan.rows, plan.simdgroups, plan.rows_per_simdgroup, plan.tile) == (4, 4, 1, 16)
    assert (plan.splits, plan.blocks_per_split) == (16, 16)  # 8 KV heads x 16 splits = 128 threadgroups
    assert ma.launch_plan(32, 32, 1, 8, 128, 16, 256).splits == 1  # 256 threadgroups already
    assert ma.launch_plan(1, 32, 1, 8, 128, 16, 8).splits == 1  # 128 tokens: too short to split
    verify = ma.launch_plan(1, 32, 8, 8, 128, 16, 4)  # 8 query tokens, GQA 4: 32 rows
    assert (verify.simdgroups, verify.rows_per_simdgroup) == (8, 4)
    assert ma.launch_plan(1, 9, 1, 3, 64, 16, 4).simdgroups == 4  # SmolLM2: 3 rows, 4 simdgroups
    assert ma.launch_plan(1, 32, 1, 8, 128, 16, 256, window=100).splits == 1  # a window reads 8 blocks at most
    assert ma.launch_plan(1, 32, 1, 8, 128, 16, 256, max_simdgroups=2).rows_per_simdgroup == 2
    assert [ma.tile_tokens(d, 16) for d in (64, 128, 256)] == [16, 16, 8]
    assert ma.tile_tokens(64, 32) == 32 and ma.tile_tokens(40, 8) == 8


def test_kernel_call():
    args = ma.random_problem(0, context_lens=[5, 40], q_len=3, n_heads=6, n_kv_heads=2, head_dim=64, block_size=16)
    call = ma.kernel_call(**args)
    # 9 rows per KV head: 8 simdgroups of 32 lanes, 2 rows each; one threadgroup per (KV head, sequence)
    assert call.pass1["grid"] == (256, 2, 2) and call.pass1["threadgroup"] == (256, 1, 1)
    assert call.pass1["template"] == [("T", mx.float32), ("D", 64), ("BS", 16), ("TK", 16), ("RPS", 2),
                                      ("SPLIT", False)]
    assert call.reduce is None and call.pipeline == ("float", mx.float32, 64, 16, 16, 2, False)
    assert [a.dtype for a in call.pass1["inputs"][3:]] == [mx.int32, mx.int32, mx.int32, mx.float32, mx.float32]
    split = ma.kernel_call(**args, splits=3)
    assert split.pass1["output_shapes"] == [(2, 6, 3, 3, 66)] and split.reduce["grid"] == (32, 18, 2)
    q = ma.kernel_call(**ma.random_problem(0, context_lens=[5], head_dim=64, kv_bits=8), n_simdgroups=1)
    assert q.pass1["template"][-2:] == [("BITS", 8), ("GS", 32)] and q.pass1["threadgroup"] == (32, 1, 1)
    assert [a.dtype for a in q.pass1["inputs"][:7]] == [mx.float32, mx.uint32, mx.float32, mx.float32, mx.uint32,
                                                        mx.float32, mx.float32]


def test_metal_source_builds_into_kernel_objects():
    ma.build_kernel.cache_clear()
    assert all(ma.build_kernel(kind) is not None for kind in ("float", "quant", "reduce"))
    if not mx.metal.is_available():
        args = ma.random_problem(0, context_lens=[5], block_size=4, head_dim=32)
        with pytest.raises(RuntimeError, match="Metal"):
            mx.eval(ma.paged_attention_metal(**args))


def test_one_kernel_variant_per_pipeline(tmp_path):
    """MLX passes an input of fewer than 8 elements in constant memory and names the kernel by it: one
    sequence (1 length, a 4-entry table) and 9 (9 lengths, 36 entries), 4 heads' sinks and 8, must still
    compile one kernel. Before the padding the start-up check of a class (its largest batch) compiled a
    different variant than the calls it admitted."""
    names = set()
    for lens, H in (([20], 4), ([20] * 9, 4), ([60, 3, 7, 1, 30], 8)):
        args = ma.random_problem(0, context_lens=lens, n_heads=H, n_kv_heads=H // 2, head_dim=32, block_size=8,
                                 sinks=True)
        call = ma.kernel_call(**args)
        names.add(me.kernel_name(me.generated_source(ma.build_kernel(call.kind), call.pass1, tmp_path)))
    assert len(names) == 1, names
    assert not any(n.endswith(("c", "s")) for n in names.pop().split("_")[:-8]), "a table, length or sink in constant"


# ---------------------------------------------------------------- the emulator

NAMES = {"float": ma.INPUT_NAMES, "quant": ma.QUANT_INPUT_NAMES, "reduce": ma.REDUCE_INPUT_NAMES}

NAMES = {"float": ma.INPUT_NAMES, "quant": ma.QUANT_INPUT_NAMES, "reduce": ma.REDUCE_INPUT_NAMES}
WINDOW_BUG = ma.HEADER.replace("p - W + 1", "p - W")  # an off-by-one the checks must catch
CHUNK_BUG = ma.HEADER.replace("(p / CH) * CH", "(p / CH) * CH + 1")  # a chunk's first key lost
SPLIT_BUG = ma.REDUCE_SOURCE.replace("L = simd_sum(L) + metal::exp(sink - M)", "L = simd_sum(L)")  # sinks lost
assert WINDOW_BUG != ma.HEADER != CHUNK_BUG and SPLIT_BUG != ma.REDUCE_SOURCE


def _bug(kind, name, source=None, header=ma.HEADER):
    source = source or {"float": ma.PASS1_SOURCE, "quant": ma.QUANT_PASS1_SOURCE}[kind]
    return {kind: mx.fast.metal_kernel(name=name, input_names=list(NAMES[kind]), output_names=["out"], source=source,
                                       header=header)}


BUGS = {"window": _bug("float", "window_bug", header=WINDOW_BUG), "chunk": _bug("float", "chunk_bug", header=CHUNK_BUG),
        "qchunk": _bug("quant", "qchunk_bug", header=CHUNK_BUG), "split": _bug("reduce", "split_bug", source=SPLIT_BUG)}


def emulated_problems():
    """(args, kernel_call options, kernel overrides) of every emulator run below, so their pipelines are built in
    one compiler run (a run not listed here still works: its pipeline is built when it first runs)."""
    for (BS, D), (QL, gqa, window, chunk) in ((x, y) for x in GRID_SHAPES for y in GRID_ROWS):
        for splits in (None, 3):
            yield grid_problem(BS, D, QL, gqa, window, chunk), dict(splits=splits), None
    for dtype in (mx.float16, mx.bfloat16):
        yield half_problem(dtype), {}, None
    for bits, dtype, BS in QUANT_CASES:
        for masking in ("window", "chunk"):
            for splits in (None, 2):
                yield quant_problem(bits, dtype, BS, masking), dict(splits=splits), None
    for q_len in (1, 2):
        yield long_problem(q_len), {}, None
    for gqa in (4, 8):
        for splits in (None, 4):
            yield bytes_problem(gqa), dict(splits=splits), None
    for seed, head_dim in ((s, d) for s in range(2) for d in PROPERTY_HEAD_DIMS):
        args, splits = property_problem(seed, head_dim)
        yield args, dict(splits=splits), None
    for kind in SELECTED_KINDS:
        for rps in ma.ROWS_PER_SIMDGROUP:
            for split in (False, True):
                for i, case in enumerate(kd.class_cases(kind, 16, rps, split)):
                    args = ma.random_problem(i, **case)
                    for bug in [None, *BUGS.values()]:
                        yield args, {}, bug


def prebuild(emu):
    for args, options, kernels in emulated_problems():
        call = ma.kernel_call(**args, **options)
        get = {**{k: ma.build_kernel(k) for k in NAMES}, **(kernels or {})}
        emu.key(get[call.kind], call.pass1, NAMES[call.kind])
        if call.reduce is not None:
            partials = mx.zeros(call.pass1["output_shapes"][0], mx.float32)
            emu.key(get["reduce"], {**call.reduce, "inputs": [partials, call.reduce["inputs"][1]]}, NAMES["reduce"])
    emu.build()


@pytest.fixture(scope="session")
def emulator():
    """emulate(args, kernels=None, **kernel_call options) -> (output, {pool name: bytes read}): the kernels'
    MLX-generated source run on the CPU (kernels: {"float" | "quant" | "reduce": kernel object} overrides)."""
    cxx = me.compiler()
    if cxx is None:
        pytest.skip("needs clang++ or g++ to build the Metal-source emulator (scripts/install.sh --test installs clang)")
    emu = me.Emulator(Path(tempfile.gettempdir()) / "macinfer-metal-emulator", cxx)
    prebuild(emu)

    def emulate(args, kernels=None, **options):
        call = ma.kernel_call(**args, **options)
        get = {**{k: ma.build_kernel(k) for k in NAMES}, **(kernels or {})}
        out, nbytes = emu.run(get[call.kind], call.pass1, NAMES[call.kind])
        if call.reduce is not None:
            out, _ = emu.run(get["reduce"], {**call.reduce, "inputs": [out, call.reduce["inputs"][1]]}, NAMES["reduce"])
        return out, nbytes

    emulate.emu = emu
    return emulate


@pytest.mark.parametrize("cxx", ["g++", "clang++"])
def test_emulator_builds_with(cxx, tmp_path):
    """Apple's compiler is clang: MLX's closing `template [[host_name(...)]] [[kernel]] ...;` must not reach it
    (clang: "an attribute list cannot appear here"); g++ accepts it either way."""
    if shutil.which(cxx) is None:
        pytest.skip(f"{cxx} is not installed (scripts/install.sh --test installs clang on Linux)")
    emu = me.Emulator(tmp_path, shutil.which(cxx))
    args = ma.random_problem(2, context_lens=[9, 30], q_len=2, n_heads=4, n_kv_heads=2, head_dim=32, block_size=8)
    call = ma.kernel_call(**args)
    out, _ = emu.run(ma.build_kernel(call.kind), call.pass1, NAMES[call.kind])
    assert_close(out, ma.paged_attention_online(**args), tol=2e-6)
    assert "[[host_name" not in me.emulator_cpp("k", emu.sources.popitem()[1], NAMES["float"])


def lengths(BS, q_len):
    # ending on a block boundary, one past it, one short of it, and the shortest legal row
    return [2 * BS, 3 * BS + 1, 5 * BS - 1, q_len]


GRID_SHAPES = [(8, 32), (16, 40), (32, 64)]  # (block_size, head_dim)
GRID_ROWS = [(1, 1, None, None), (3, 3, None, None), (2, 4, 11, None), (4, 2, 40, None), (3, 2, None, 13),
             (1, 8, None, 16), (8, 4, None, None), (4, 8, 9, None)]  # (q_len, gqa, window, chunk)


def grid_problem(block_size, head_dim, q_len, gqa, window, chunk):
    return poison_unused_slots(ma.random_problem(
        q_len * 7 + gqa, context_lens=lengths(block_size, q_len), q_len=q_len, n_heads=2 * gqa,
        n_kv_heads=2, head_dim=head_dim, block_size=block_size, window=window, chunk=chunk))


@pytest.mark.parametrize("block_size,head_dim", GRID_SHAPES)
@pytest.mark.parametrize("q_len,gqa,window,chunk", GRID_ROWS)
def test_kernel_matches_reference_in_emulator(emulator, block_size, head_dim, q_len, gqa, window, chunk):
    """One pass and split in 3 (a split may be empty for a short row), against the NumPy reference
    (same splits) and gather + SDPA; NaN in every slot no query may read."""
    args = grid_problem(block_size, head_dim, q_len, gqa, window, chunk)
    want = gather_sdpa(**args)
    for splits in (None, 3):
        got, _ = emulator(args, splits=splits)
        assert_close(got, ma.paged_attention_online(**args, splits=splits), tol=2e-6)
        assert_close(got, want)


def half_problem(dtype):
    return ma.random_problem(3, context_lens=[700, 33], q_len=2, n_heads=4, n_kv_heads=2, dtype=dtype, sinks=True)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_types_in_emulator(emulator, dtype):
    args = half_problem(dtype)
    got, _ = emulator(args)
    assert got.dtype == dtype
    assert_close(got, ma.paged_attention_online(**args), tol=ma.TOLERANCE[dtype])


QUANT_CASES = [(8, mx.float32, 8), (4, mx.float32, 8), (8, mx.float16, 16)]  # (bits, dtype, block_size)


def quant_problem(bits, dtype, BS, masking):
    return poison_unused_slots(ma.random_problem(
        bits, context_lens=[3 * BS + 2, BS, 7], q_len=3, n_heads=4, n_kv_heads=2, head_dim=64, block_size=BS,
        dtype=dtype, kv_bits=bits, **{masking: 2 * BS + 1 if masking == "window" else BS + 3}))


@pytest.mark.parametrize("bits,dtype,block_size", QUANT_CASES)
@pytest.mark.parametrize("masking", ["window", "chunk"])
def test_quantized_pools_in_emulator(emulator, bits, dtype, block_size, masking):
    """8-bit (and 4-bit) KV staged as uint4 codes and dequantised once per tile; a sliding window or
    chunks (llama4) that start mid-block; one pass and split."""
    args = quant_problem(bits, dtype, block_size, masking)
    tol = 1e-5 if dtype == mx.float32 else ma.TOLERANCE[dtype]
    for splits in (None, 2):
        got, _ = emulator(args, splits=splits)
        assert_close(got, ma.paged_attention_online(**args, splits=splits), tol=tol)
        assert_close(got, gather_sdpa(**args), tol=tol)  # gather + mx.dequantize + SDPA


@pytest.mark.parametrize("bits", [4, 8])
def test_numpy_dequantize_is_mlx_dequantize(bits):
    pool = ma.random_problem(0, context_lens=[20], head_dim=64, block_size=8, kv_bits=bits)["k_pool"]
    slots = np.array([3, 9, 17, 40])
    want = mx.dequantize(*(x[1][mx.array(slots)] for x in (pool.codes, pool.scales, pool.biases)),
                         group_size=32, bits=bits)
    np.testing.assert_allclose(ma.np_dequantize(pool, 1, slots), np.array(want), rtol=1e-6, atol=1e-6)


def long_problem(q_len):
    return ma.random_problem(q_len, context_lens=[32768], q_len=q_len, n_heads=16, n_kv_heads=2, head_dim=64,
                             block_size=32, kv_bits=8)


def test_long_context_gqa8_8bit_in_emulator(emulator):
    """32k tokens of 8-bit KV under GQA 8, one decode query and two verify queries, split as the launch plan
    splits them (64 splits of 512 keys): the kernel, the reference and gather + SDPA agree."""
    for q_len in (1, 2):
        args = long_problem(q_len)
        assert ma.kernel_call(**args).plan.splits == 64
        got, _ = emulator(args)
        assert_close(got, ma.paged_attention_online(**args), tol=1e-5)
        assert_close(got, gather_sdpa(**args), tol=1e-5)


def bytes_problem(gqa):
    return ma.random_problem(gqa, context_lens=[300, 77, 1000], n_heads=2 * gqa, n_kv_heads=2, head_dim=64,
                             block_size=16)


@pytest.mark.parametrize("gqa", [4, 8])
def test_each_kv_block_is_read_once_per_kv_head(emulator, gqa):
    """K/V bytes read from device memory per decode step, counted in the emulator: the kernel reads each
    visible token of each KV head once, 1/GQA of what the kernel before it read (one threadgroup per
    query head, tests/metal_kernel_v1.py); the same with the context split."""
    args = bytes_problem(gqa)
    once = 2 * 2 * sum(args["context_lens"]) * 64 * 4  # K and V of 2 KV heads, head_dim 64, float32
    got, nbytes = emulator(args)
    assert sum(nbytes.values()) == once
    _, split_bytes = emulator(args, splits=4)
    assert sum(split_bytes.values()) == once
    old_out, old_bytes = emulator.emu.run(metal_kernel_v1.build_kernel(), metal_kernel_v1.launch(**args),
                                          metal_kernel_v1.INPUT_NAMES)
    assert_close(old_out, got, tol=2e-6)
    assert sum(old_bytes.values()) == gqa * once


# ---------------------------------------------------------------- property tests (fixed seeds)


def random_args(rng, head_dim, *, block_size=None, kv_bits=None, max_rows=4, max_len=6):
    """A random problem: 1..max_rows rows of ragged lengths, some right-padded (a prefill chunk
    shorter than the batch's q_len: its table covers only its real tokens), GQA 1-8 and q_len 1-8
    (at most 32 rows per KV head), a window, a soft-cap, sinks or chunks, shuffled blocks; unused
    pool slots poisoned with NaN."""
    BS = block_size or int(rng.choice([8, 16]))
    B, gqa = int(rng.integers(1, max_rows + 1)), int(rng.choice([1, 2, 3, 4, 8]))
    QL = int(rng.integers(1, 32 // gqa + 1 if gqa > 4 else 9))
    kvh = int(rng.integers(1, 3))
    lens = [int(rng.integers(QL, max_len * BS)) for _ in range(B)]
    extra = [{}, {"window": int(rng.integers(1, 3 * BS))}, {"softcap": 4.0}, {"sinks": True}][int(rng.integers(4))]
    if rng.random() < 0.3:  # chunked attention (llama4), alone or beside the above
        extra["chunk"] = int(rng.integers(1, 3 * BS))
    args = ma.random_problem(int(rng.integers(1 << 30)), context_lens=lens, q_len=QL, n_heads=kvh * gqa,
                             n_kv_heads=kvh, head_dim=head_dim, block_size=BS, kv_bits=kv_bits, **extra)
    args["queries"] = args["queries"] * 3  # peakier softmax: a wrong key shows
    tables = [list(map(int, row)) for row in np.asarray(args["block_tables"])]
    if B > 1 and QL > 1 and rng.random() < 0.5:  # row 0 is padded: fewer real tokens than its context
        real = lens[0] - int(rng.integers(1, QL))
        tables[0] = tables[0][: -(-real // BS)]
    args["block_tables"] = ma.padded_tables(tables, lens, BS)
    return poison_unused_slots(args)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_property_reference_matches_gather_sdpa(seed, head_dim):
    rng = np.random.default_rng([seed, head_dim])
    bits = 8 if head_dim % 32 == 0 and seed % 2 else None
    args = random_args(rng, head_dim, kv_bits=bits)
    assert_close(ma.paged_attention_online(**args, splits=1 + seed % 3), gather_sdpa(**args))


PROPERTY_HEAD_DIMS = [64, 80, 96, 128, 256]


def property_problem(seed, head_dim):
    rng = np.random.default_rng([seed, head_dim, 1])
    bits = 8 if head_dim != 80 and seed else None  # MLX groups 32 / 64 / 128 do not divide 80
    args = random_args(rng, head_dim, block_size=16, kv_bits=bits, max_rows=3, max_len=4)
    return args, 1 + int(rng.integers(3))


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("head_dim", PROPERTY_HEAD_DIMS)
def test_property_kernel_matches_reference_in_emulator(emulator, seed, head_dim):
    args, splits = property_problem(seed, head_dim)
    got, _ = emulator(args, splits=splits)
    assert_close(got, ma.paged_attention_online(**args, splits=splits), tol=1e-5)
    assert_close(got, gather_sdpa(**args), tol=1e-5)


# ---------------------------------------------------------------- selection


@pytest.fixture
def no_kernel_calls(monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("the kernel must not be built or called here")

    monkeypatch.setattr(ma, "build_kernel", forbidden)
    monkeypatch.setattr(ma, "paged_attention_metal", forbidden)


def test_reference_mode_never_touches_the_kernel(no_kernel_calls, monkeypatch):
    monkeypatch.setattr(ma, "metal_available", lambda: True)
    assert kd.select_attention("reference", gather_sdpa) == (gather_sdpa, "reference")


def test_no_metal_means_reference_without_warning(no_kernel_calls, monkeypatch):
    monkeypatch.setattr(ma, "metal_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kd.select_attention("auto", gather_sdpa) == (gather_sdpa, "reference")
    with pytest.raises(MacinferError, match="needs Metal"):
        kd.select_attention("metal", gather_sdpa)


def test_this_host_selects_reference():
    if mx.metal.is_available():
        pytest.skip("Metal host")
    assert kd.select_attention("auto", gather_sdpa) == (gather_sdpa, "reference")


def test_bad_mode():
    with pytest.raises(ValueError, match="reference, metal, auto"):
        kd.select_attention("fast", gather_sdpa)


ONE_KIND = [kd.layer_kind(mx.float32, 64)]
SELECTED_KINDS = [kd.layer_kind(mx.float32, 64), kd.layer_kind(mx.float32, 64, kv_bits=8)]


def _select_with_one_warning(match):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn, backend = kd.select_attention("auto", gather_sdpa, layers=ONE_KIND)
    assert (fn, backend) == (gather_sdpa, "reference")
    assert len(caught) == 1 and caught[0].category is kd.MetalAttentionWarning
    assert match in str(caught[0].message)
    return str(caught[0].message)


def test_compile_failure_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(ma, "metal_available", lambda: True)

    def broken(*a, **k):
        raise RuntimeError("program_source:12:5: error: use of undeclared identifier 'qv'")

    monkeypatch.setattr(ma, "paged_attention_metal", broken)
    msg = _select_with_one_warning("failed to compile or run")
    assert "undeclared identifier" in msg
    with pytest.raises(MacinferError, match="failed to compile"):
        kd.select_attention("metal", gather_sdpa, layers=ONE_KIND)


def test_run_failure_of_real_kernel_falls_back(monkeypatch):
    """Pretend Metal exists: the real kernel builds, then raises when evaluated here."""
    if mx.metal.is_available():
        pytest.skip("Metal host")
    monkeypatch.setattr(ma, "metal_available", lambda: True)
    _select_with_one_warning("No Metal back-end")


def test_mismatch_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(ma, "metal_available", lambda: True)
    calls = []

    def slightly_wrong(queries, *a, n_simdgroups=None, lens=None, sink_array=None, **k):
        calls.append(queries.dtype)
        return ma.paged_attention_online(queries, *a, **k) * 1.01

    monkeypatch.setattr(ma, "paged_attention_metal", slightly_wrong)
    _select_with_one_warning("disagrees with the reference")
    assert calls == [mx.float32] * 6  # every class checked once: its first case already disagrees


def emulated_kernel(emulator, kernels=None):
    """metal_attention.paged_attention_metal run in the emulator."""
    def paged_attention_metal(queries, k_pool, v_pool, block_tables, context_lens, *, n_simdgroups=None, lens=None,
                              sink_array=None, **kw):
        args = dict(queries=queries, k_pool=k_pool, v_pool=v_pool, block_tables=block_tables,
                    context_lens=context_lens, **kw)
        return emulator(args, kernels, n_simdgroups=n_simdgroups, lens=lens, sink_array=sink_array)[0]

    return paged_attention_metal


def test_emulated_kernel_passes_every_class_and_is_selected(emulator, monkeypatch):
    """Every class of a float32 and an 8-bit layer kind checked at start-up, on the kernels' own source."""
    monkeypatch.setattr(ma, "metal_available", lambda: True)
    monkeypatch.setattr(ma, "paged_attention_metal", emulated_kernel(emulator))
    reference_calls = []

    def reference(*a, **k):
        reference_calls.append(k)
        return gather_sdpa(*a, **k)

    kinds = SELECTED_KINDS
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn, backend = kd.select_attention("metal", reference, layers=kinds)
    assert backend == "metal" and isinstance(fn, kd.KernelDispatch)
    assert len(fn.choices) == 2 * 6 and set(fn.choices.values()) == {"kernel"}
    assert len(reference_calls) == 2 * 6 * 3
    reference_calls.clear()
    args = ma.random_problem(9, context_lens=[20, 9], q_len=2, sinks=True)
    assert_close(fn(**args), gather_sdpa(**args))
    assert reference_calls == []


def test_emulated_buggy_source_is_rejected(emulator):
    """The start-up check has teeth: a window off by one key fails the windowed case, a chunk's first key dropped
    the chunked case (float or quantised source), sinks lost in the reduction the split classes."""
    kind = kd.layer_kind(mx.float32, 64)
    for bug, case, kinds in [(BUGS["window"], "case 1", [kind]), (BUGS["chunk"], "case 2", [kind]),
                             (BUGS["qchunk"], "case 2", [kd.layer_kind(mx.float32, 64, kv_bits=8)]),
                             (BUGS["split"], "case 0", [kind])]:
        dispatch = kd.KernelDispatch("metal", emulated_kernel(emulator, bug), gather_sdpa)
        failures = dispatch.prepare(kinds, 16)
        assert failures and all("disagrees" in f for f in failures), failures
        assert case in failures[0], failures[0]
        if "reduce" in bug:  # one-pass classes never run the reduction
            assert [k[-1] for k, v in dispatch.choices.items() if v == "reference"] == [True] * 3


def test_bench_script_runs_without_metal(capsys):
    if mx.metal.is_available():
        pytest.skip("Metal host")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "scripts" / "bench/attention.py"
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--contexts", "64,100", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "no Metal" in out and "timing the reference path only" in out
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[-3:-1]] == ["64", "100"]
    assert lines[-1].startswith("end-to-end decode: skipped (no Metal")


def test_bench_script_end_to_end_decode(capsys, tiny_models):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "scripts" / "bench/attention.py"
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--contexts", "64", "--repeats", "1", "--e2e", str(tiny_models("llama")),
                "--e2e-contexts", "100,600", "--e2e-tokens", "4"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].split()[:2] == ["100", "tokens:"] and "reference" in lines[-2] and "tok/s" in lines[-2]
    assert "beyond" in lines[-1] and "skipped" in lines[-1]  # 600 > the tiny model's 512-token context


@pytest.mark.skipif(mx.metal.is_available(), reason="asserts the engine's choice without Metal")
def test_engine_selects_reference_without_metal_and_refuses_metal(tiny_models):
    """Wired into the engine: auto -> reference here, metal -> one clear error."""
    from macinfer.engine.llm_engine import LLMEngine
    from macinfer.modelio.loader import load_model

    model, tok, info = load_model(str(tiny_models("llama")))
    engine = LLMEngine(model, tok, info, num_blocks=16)
    assert engine.attention_backend == "reference" and "attention: reference" in engine.describe()
    assert engine.runner.ctx.attention_fn is None
    with pytest.raises(MacinferError, match="needs Metal"):
        LLMEngine(model, tok, info, num_blocks=16, attention="metal")


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal: the real kernel in the engine")
def test_engine_on_metal_decodes_like_the_reference(tiny_models):
    """On a Mac: the engine with the kernel forced gives the reference engine's greedy tokens."""
    from macinfer.core.sampling import SamplingParams
    from macinfer.engine.llm_engine import LLMEngine
    from macinfer.modelio.loader import load_model

    model, tok, info = load_model(str(tiny_models("llama")))
    outs = []
    for attention in ("reference", "metal"):
        engine = LLMEngine(model, tok, info, num_blocks=64, attention=attention)
        assert engine.attention_backend == attention
        ids = [engine.add_request(tok.encode(p), SamplingParams(max_tokens=8, ignore_eos=True))
               for p in ("hello world", "the paged kernel reads blocks")]
        got = {}
        while engine.has_unfinished():
            for d in engine.step():
                if d.output is not None:
                    got[d.request_id] = d.output.token_ids
        outs.append([got[i] for i in ids])
    assert outs[0] == outs[1]


def test_engine_calls_the_kernel_hook_for_decode_rows_only(tiny_models):
    """A kernel set on the runner is what every layer calls for decode rows, with tables built once per forward."""
    from macinfer.engine.llm_engine import LLMEngine
    from macinfer.modelio.loader import load_model
    from macinfer.kv.paged_attention import paged_attention

    model, tok, info = load_model(str(tiny_models("llama")))
    engine = LLMEngine(model, tok, info, num_blocks=16, attention="reference")
    # A selected kernel is what every layer calls: count the calls through the hook.
    calls, tables = [], []

    def spy(*args, **kw):
        calls.append(1)
        tables.append(args[3])  # the padded int32 tables, built once per forward
        return paged_attention(*args, **kw)

    engine.runner.ctx.attention_fn = spy
    from macinfer.core.sampling import SamplingParams

    engine.add_request(tok.encode("hello world")[:4], SamplingParams(max_tokens=2))  # a 4-token prefill
    while engine.has_unfinished():
        engine.step()
    assert len(calls) == 2 * len(model.layers)  # prefill + one decode, every layer
    L = len(model.layers)
    assert all(isinstance(t, mx.array) for t in tables) and all(tables[i] is tables[i - i % L] for i in range(len(tables)))
    # A prefill chunk longer than KERNEL_MAX_Q_LEN goes to MLX's SDPA, never the decode kernel.
    from macinfer.kv.paged_cache import KERNEL_MAX_Q_LEN

    calls.clear()
    engine.add_request(list(range(5, 5 + 3 * KERNEL_MAX_Q_LEN)), SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    assert len(calls) == len(model.layers)  # the decode step only
