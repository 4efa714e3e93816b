"""KernelDispatch on the CPU: classes checked at start-up only, the thread-limit retry, fallback, auto's timing.

The kernel is a stub (the NumPy algorithm reference, optionally wrong or raising) and the
timer is injected, so every decision is exact and nothing here needs Metal.
"""

import warnings

import mlx.core as mx
import numpy as np
import pytest

from macinfer.kv import kernel_dispatch as kd
from macinfer.kv import metal_attention as ma
from macinfer.kv.paged_attention import paged_attention
from macinfer.kv.paged_cache import ForwardContext

KIND = kd.layer_kind(mx.float32, 32)


class StubKernel:
    """The kernel's signature over the NumPy reference; records each call's shape and simdgroups."""

    def __init__(self, limit=None, wrong_when=None, raise_at_call=False):
        self.limit, self.wrong_when, self.raise_at_call = limit, wrong_when, raise_at_call
        self.calls = []

    def __call__(self, queries, *a, n_simdgroups=None, lens=None, sink_array=None, **k):
        nsg = n_simdgroups or ma.MAX_SIMDGROUPS
        self.calls.append((queries.shape, nsg))
        if self.raise_at_call:
            raise RuntimeError("[metal::Device] Unable to build pipeline")
        if self.limit and 32 * nsg > self.limit:  # MLX's own message (custom_kernel.cpp)
            raise ValueError(f"Thread group size ({32 * nsg}) is greater than  the maximum allowed threads "
                             f"per threadgroup ({self.limit}).")
        out = ma.paged_attention_online(queries, *a, **k)
        return out * 1.01 if self.wrong_when and self.wrong_when(queries, k) else out


def call_args(B, width, *, q_len=1, head_dim=32, block_size=8, n_heads=4, seed=0):
    """The reference's keyword arguments for one decode call, and the padded tables the kernel reads."""
    lens = [width * block_size - 3] + [q_len + 2 * b for b in range(1, B)]
    args = ma.random_problem(seed, context_lens=lens, q_len=q_len, n_heads=n_heads, n_kv_heads=2, head_dim=head_dim,
                             block_size=block_size)
    tables = args["block_tables"]
    args["block_tables"] = [[int(x) for x in row if x] for row in np.asarray(tables)]
    return args, ma.padded_tables(args["block_tables"], lens, block_size)


def never_timed(fn):
    raise AssertionError("metal mode does not time")


def test_classes_are_few_and_known_at_start_up():
    """Every batch, width, query length and head count maps to one of 6 classes per layer kind, all prepared
    before the first call; deciding never runs the kernel."""
    kernel = StubKernel()
    dispatch = kd.KernelDispatch("metal", kernel, paged_attention, timer=never_timed)
    assert dispatch.prepare([KIND], 8) == []
    checks = len(kernel.calls)
    assert checks == 6 * 3 and len(dispatch.choices) == 6  # 3 cases per class
    for B in (1, 2, 3, 5, 9, 33):
        for width in (1, 3, 40, 200):
            for q_len in (1, 2, 5, 8):
                for n_heads in (2, 4, 8):
                    assert dispatch.use_kernel(*call_args(B, width, q_len=q_len, n_heads=n_heads))
    assert len(kernel.calls) == checks and dispatch.misses == 0
    assert dispatch.met == set(dispatch.choices)  # every class met, none unknown


def test_a_class_that_fails_its_check_is_a_start_up_failure():
    """A stub wrong whenever the context is split: the split classes fail, the one-pass ones pass; the
    engine then uses the reference everywhere (select_attention) or refuses (metal)."""
    kernel = StubKernel(wrong_when=lambda q, k: max(k.get("context_lens", [0])) > 2 * ma.MIN_SPLIT_TOKENS)
    dispatch = kd.KernelDispatch("metal", kernel, paged_attention, timer=never_timed)
    failures = dispatch.prepare([KIND], 8)
    assert len(failures) == 3 and all("disagrees" in f and "True)" in f for f in failures)
    assert sorted((k[-1], v) for k, v in dispatch.choices.items()) == [(False, "kernel")] * 3 + [(True, "reference")] * 3


def test_threadgroup_sized_from_the_pipeline_limit():
    """MLX refuses 256 threads where the pipeline allows 192: the check retries at 6 simdgroups, and calls
    run at 6 from then on (a class of 12 rows: 6 simdgroups of 2 rows)."""
    kernel = StubKernel(limit=192)
    dispatch = kd.KernelDispatch("metal", kernel, paged_attention)
    assert dispatch.prepare([KIND], 8) == []
    assert [n for _, n in kernel.calls[:2]] == [8, 6] and dispatch.simdgroups[KIND] == 6
    args, tables = call_args(2, 3, q_len=3, n_heads=8)
    assert dispatch.use_kernel(args, tables)
    out = dispatch(**{**args, "block_tables": tables})
    assert kernel.calls[-1][1] == 6
    np.testing.assert_allclose(np.array(out), np.array(paged_attention(**args)), rtol=1e-5, atol=1e-5)


def test_kernel_error_while_a_call_is_built_falls_back_to_the_reference_logged_once():
    kernel = StubKernel(raise_at_call=True)
    dispatch = kd.KernelDispatch("metal", kernel, paged_attention)
    args, tables = call_args(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [dispatch(**{**args, "block_tables": tables}) for _ in range(3)]
    assert len(kernel.calls) == 1  # tried once, then the reference for good
    assert len(caught) == 1 and "failed while a call was built" in str(caught[0].message)
    for out in outs:
        np.testing.assert_allclose(np.array(out), np.array(paged_attention(**args)), rtol=1e-6, atol=1e-6)
    assert not dispatch.use_kernel(args, tables)


@pytest.mark.parametrize("kernel_s,reference_s,want", [(1.0, 2.0, "kernel"), (2.0, 1.0, "reference")])
def test_auto_chooses_the_faster_per_class_at_start_up(kernel_s, reference_s, want):
    timed = []

    def timer(fn):
        before = len(kernel.calls)
        fn()
        who = "kernel" if len(kernel.calls) > before else "reference"
        timed.append(who)
        return kernel_s if who == "kernel" else reference_s

    kernel = StubKernel()
    dispatch = kd.KernelDispatch("auto", kernel, paged_attention, timer=timer)
    dispatch.prepare([KIND], 8)
    assert timed == ["kernel", "reference"] * 6  # once per class
    assert set(dispatch.choices.values()) == {want}
    assert dispatch.use_kernel(*call_args(3, 4)) is (want == "kernel")
    assert len(timed) == 12  # nothing timed at a call


def test_quantized_pools_and_unsupported_calls():
    dispatch = kd.KernelDispatch("metal", StubKernel(), paged_attention)
    q8kind = kd.layer_kind(mx.float32, 64, kv_bits=8)
    dispatch.prepare([kd.layer_kind(mx.float32, 64)], 8)
    args, tables = call_args(2, 3, head_dim=64)
    q8 = ma.random_problem(1, context_lens=args["context_lens"], n_heads=4, n_kv_heads=2, head_dim=64,
                           block_size=8, kv_bits=8)
    qargs = {**args, "k_pool": q8["k_pool"], "v_pool": q8["v_pool"]}
    assert dispatch.use_kernel(args, tables)
    assert not dispatch.use_kernel(qargs, tables) and dispatch.misses == 1  # its kind was not prepared
    dispatch.prepare([q8kind], 8)
    assert dispatch.use_kernel(qargs, tables) and len(dispatch.choices) == 12
    assert not dispatch.use_kernel({**args, "v_pool": args["v_pool"][..., :32]}, tables)  # head_dim_v != head_dim
    assert not dispatch.use_kernel({**args, "v_pool": q8["v_pool"]}, tables)  # float K with quantised V
    many = {**args, "queries": mx.zeros((2, 16, 5, 64))}  # GQA 8 x 5 query tokens: 40 rows > 32
    assert not dispatch.use_kernel(many, tables)
    assert dispatch.misses == 1


def test_attention_layers_from_specs():
    from macinfer.kv.paged_cache import LayerSpec

    specs = [LayerSpec(2, 64, 64, None, mx.float16), LayerSpec(2, 64, 64, 128, mx.float16),
             LayerSpec(2, 192, 128, None, mx.float16), LayerSpec(1, 36, 36, None, mx.float16)]
    assert kd.attention_layers(specs) == [("mlx.core.float16", 64, None)]  # MLA (192 / 128) and 36 left out
    assert kd.attention_layers(specs, kv_bits=8) == [("mlx.core.float16", 64, (8, 32))]


def test_forward_context_routes_one_contiguous_row_to_the_slice():
    """auto: batch 1 over a contiguous run of blocks is mlx-lm's zero-copy slice path, never the kernel;
    a shuffled row and a batch go to the dispatch."""
    asked = []

    class Spy(kd.KernelDispatch):
        def use_kernel(self, args, tables):
            asked.append(len(args["context_lens"]))
            return True

    spy = Spy("auto", StubKernel(), paged_attention)
    q = mx.zeros((1, 4, 1, 32))
    pool = mx.zeros((2, 10 * 8, 32))
    for tables, lens, want in [([[3, 4, 5]], [20], []), ([[3, 5, 4]], [20], [1]), ([[3, 4], [5, 6]], [10, 12], [2])]:
        asked.clear()
        ctx = ForwardContext(block_tables=tables, context_lens=lens, attention_fn=spy)
        q_b = mx.zeros((len(lens), 4, 1, 32)) if len(lens) > 1 else q
        ctx.attend(q_b, pool, pool, tables, block_size=8, scale=1.0, window=None, sinks=None, memo={})
        assert asked == want
    # A chunked layer (llama4) reads its chunk's blocks only: [6] is one slice where [3, 5, 6] is not,
    # in the same forward (one memo).
    asked.clear()
    ctx, memo = ForwardContext(block_tables=[[3, 5, 6]], context_lens=[20], attention_fn=spy), {}
    for chunk in (None, 8):
        ctx.attend(q, pool, pool, [[3, 5, 6]], block_size=8, scale=1.0, window=None, sinks=None, memo=memo,
                   chunk=chunk)
    assert asked == [1]
    asked.clear()
    spy.prefers_slice = False  # "metal": the kernel even there
    ctx = ForwardContext(block_tables=[[3, 4, 5]], context_lens=[20], attention_fn=spy)
    ctx.attend(q, pool, pool, [[3, 4, 5]], block_size=8, scale=1.0, window=None, sinks=None, memo={})
    assert asked == [1]


def test_lengths_and_sinks_are_built_once_per_forward():
    """Every layer of a forward gets the same padded lengths array, and one sinks array per layer's sinks."""
    seen = []

    def kernel(*a, lens=None, sink_array=None, **k):
        seen.append((lens, sink_array))
        return mx.zeros(a[0].shape)

    dispatch = kd.KernelDispatch("metal", kernel, paged_attention)
    args, tables = call_args(3, 4)
    sinks = mx.zeros((4,))
    for _ in range(3):  # three layers, one forward
        dispatch(**{**args, "block_tables": tables, "sinks": sinks})
    assert all(lens is seen[0][0] and s is seen[0][1] for lens, s in seen)
    assert seen[0][0].shape == (8,) and seen[0][1].shape == (8,)
    dispatch(**{**args, "block_tables": ma.padded_tables(args["block_tables"], args["context_lens"], 8)})
    assert seen[-1][0] is not seen[0][0]  # a new forward's tables: its own lengths


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal: the real kernel")
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_real_kernel_matches_reference_on_metal(head_dim):
    dispatch = kd.KernelDispatch("metal", ma.paged_attention_metal, paged_attention)
    kinds = [kd.layer_kind(d, head_dim) for d in ma.SUPPORTED_DTYPES]
    kinds += [kd.layer_kind(mx.float16, head_dim, kv_bits=8)] if head_dim % 32 == 0 else []
    assert dispatch.prepare(kinds, 16) == []


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal: the real kernel")
def test_real_dispatch_serves_every_class_on_metal():
    dispatch = kd.KernelDispatch("metal", ma.paged_attention_metal, paged_attention)
    assert dispatch.prepare([kd.layer_kind(d, 128) for d in ma.SUPPORTED_DTYPES], 16) == []
    for B, width, q_len in [(1, 2, 1), (3, 5, 4), (8, 40, 8), (33, 3, 1), (1, 600, 1)]:
        for dtype in ma.SUPPORTED_DTYPES:
            args, tables = call_args(B, width, head_dim=128, block_size=16, q_len=q_len)
            args["queries"] = args["queries"].astype(dtype)
            args["k_pool"], args["v_pool"] = args["k_pool"].astype(dtype), args["v_pool"].astype(dtype)
            assert dispatch.use_kernel(args, tables)
            out = dispatch(**{**args, "block_tables": tables})
            np.testing.assert_allclose(np.array(out.astype(mx.float32)),
                                       np.array(paged_attention(**args).astype(mx.float32)),
                                       rtol=ma.TOLERANCE[dtype], atol=ma.TOLERANCE[dtype])
    assert dispatch.misses == 0


def test_a_serving_run_meets_few_classes_none_checked_inside_a_forward(load, monkeypatch):
    """Metal faked present and the kernel a stand-in (the engine's reference behind the kernel's signature):
    200 requests of mixed prompt and output lengths, with n-gram speculation (verify rows of up to 8 query
    tokens), and contexts long enough to be split (MIN_SPLIT_TOKENS lowered to the tiny model's scale). Every
    class a call meets was prepared at start-up (no miss), there are at most 12, and no check ran after the
    engine was built."""
    from macinfer.core.sampling import SamplingParams
    from macinfer.engine.llm_engine import LLMEngine

    model, tok = load("llama")
    monkeypatch.setattr(ma, "metal_available", lambda: True)
    monkeypatch.setattr(ma, "MIN_SPLIT_TOKENS", 32)
    events = []

    def kernel(queries, k_pool, v_pool, block_tables, context_lens, *, n_simdgroups=None, lens=None,
               sink_array=None, **k):
        events.append("call")
        return paged_attention(queries, k_pool, v_pool, block_tables, context_lens, **k)

    check_case = ma.check_case

    def counted_check(*a, **k):
        events.append("check")
        return check_case(*a, **k)

    monkeypatch.setattr(ma, "paged_attention_metal", kernel)
    monkeypatch.setattr(ma, "check_case", counted_check)
    engine = LLMEngine(model, tok, None, num_blocks=1200, block_size=16, max_num_seqs=16, attention="metal",
                       draft="ngram", num_speculative_tokens=7, adaptive_speculation=False, enable_prefix_cache=False)
    dispatch = engine.runner.ctx.attention_fn
    assert engine.attention_backend == "metal" and isinstance(dispatch, kd.KernelDispatch)
    assert events.count("check") == len(dispatch.choices) * 3 and len(dispatch.choices) == 6
    start = len(events)  # what the start-up checks did
    rng = np.random.default_rng(0)
    vocab = model.args.vocab_size
    for i in range(200):
        n = int(rng.choice([3, 6, 8, 9, 40, 120, 300]))  # 3-8: prefills of up to 8 query rows
        if i % 3:  # a repeating prompt: the n-gram drafter proposes long runs
            unit = [int(x) for x in rng.integers(3, vocab, 5)]
            prompt = (unit * (n // 5 + 1))[:n]
        else:
            prompt = [int(x) for x in rng.integers(3, vocab, n)]
        engine.add_request(prompt, SamplingParams(max_tokens=int(rng.integers(1, 12)), ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert "call" in events[start:] and "check" not in events[start:]  # nothing checked while serving
    assert dispatch.misses == 0 and 2 <= len(dispatch.met) <= 12
    assert {key[-1] for key in dispatch.met} == {False, True}  # one-pass and split calls both met
    assert {key[-2] for key in dispatch.met} == {1, 2}  # rows per simdgroup: 1-4 query tokens, and 5-8
