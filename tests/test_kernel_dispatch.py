"""KernelDispatch on the CPU: per-class checks, the thread-limit retry, run-time fallback, auto's timing.

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


class StubKernel:
    """The kernel's signature over the NumPy reference; records each call's simdgroups."""

    def __init__(self, limit=None, wrong_for=None, raise_at_call=False):
        self.limit, self.wrong_for, self.raise_at_call = limit, wrong_for, raise_at_call
        self.calls = []

    def __call__(self, queries, *a, n_simdgroups=None, **k):
        nsg = n_simdgroups or ma.default_simdgroups(queries.shape[-1])
        self.calls.append((queries.shape, nsg))
        if self.raise_at_call:
            raise RuntimeError("[metal::Device] Unable to build pipeline")
        if self.limit and 32 * nsg > self.limit:  # MLX's own message (custom_kernel.cpp)
            raise ValueError(f"Thread group size ({32 * nsg}) is greater than  the maximum allowed threads "
                             f"per threadgroup ({self.limit}).")
        out = ma.paged_attention_online(queries, *a, n_partitions=nsg, **k)
        return out * 1.01 if self.wrong_for and queries.shape[0] in self.wrong_for else out


def call_args(B, width, *, q_len=1, head_dim=32, block_size=8, seed=0):
    """The reference's keyword arguments for one decode call, and the padded tables the kernel reads."""
    lens = [width * block_size - 3] + [q_len + 2 * b for b in range(1, B)]
    args = ma.random_problem(seed, context_lens=lens, q_len=q_len, n_heads=4, n_kv_heads=2, head_dim=head_dim,
                             block_size=block_size)
    tables = args["block_tables"]
    args["block_tables"] = [[int(x) for x in row if x] for row in np.asarray(tables)]
    return args, ma.padded_tables(args["block_tables"], lens, block_size)


def never_timed(fn):
    raise AssertionError("metal mode does not time")


def test_each_shape_class_is_checked_once_before_use():
    kernel = StubKernel()
    dispatch = kd.KernelDispatch("metal", kernel, paged_attention, timer=never_timed)
    for B, width in [(1, 3), (3, 3), (3, 4), (4, 4), (8, 3), (9, 3)]:
        args, tables = call_args(B, width)
        assert dispatch.use_kernel(args, tables)
    # classes: batch 1, 3-4 (x 3-4 blocks) once, 8, then 9 -> 16: four checks, each at the class's largest size
    assert sorted(dispatch.choices.values()) == ["kernel"] * 4
    assert [shape[0] for shape, _ in kernel.calls] == [1, 4, 8, 16]
    n = len(kernel.calls)
    args, tables = call_args(4, 4)
    assert dispatch.use_kernel(args, tables) and len(kernel.calls) == n  # a known class: no new check


def test_a_class_that_fails_its_check_uses_the_reference_with_one_warning():
    dispatch = kd.KernelDispatch("metal", StubKernel(wrong_for={8}), paged_attention)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert dispatch.use_kernel(*call_args(2, 3))
        assert not dispatch.use_kernel(*call_args(7, 3))  # batch class 8: the stub is wrong there
        assert not dispatch.use_kernel(*call_args(6, 3))
    assert len(caught) == 1 and caught[0].category is kd.MetalAttentionWarning
    assert "disagrees" in str(caught[0].message)


def test_threadgroup_sized_from_the_pipeline_limit():
    """MLX refuses 256 threads where the pipeline allows 192: the check retries at 6 simdgroups,
    and the kernel runs at 6 from then on."""
    kernel = StubKernel(limit=192)
    dispatch = kd.KernelDispatch("metal", kernel, paged_attention)
    args, tables = call_args(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.use_kernel(args, tables)
    assert [n for _, n in kernel.calls] == [8, 6]
    out = dispatch(**{**args, "block_tables": tables})
    assert kernel.calls[-1][1] == 6
    np.testing.assert_allclose(np.array(out), np.array(paged_attention(**args)), rtol=1e-5, atol=1e-5)


def test_run_time_kernel_error_falls_back_to_the_reference_logged_once():
    kernel = StubKernel(raise_at_call=True)
    dispatch = kd.KernelDispatch("metal", kernel, paged_attention)
    args, tables = call_args(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [dispatch(**{**args, "block_tables": tables}) for _ in range(3)]
    assert len(kernel.calls) == 1  # tried once, then the reference for good
    assert len(caught) == 1 and "failed at run time" in str(caught[0].message)
    for out in outs:
        np.testing.assert_allclose(np.array(out), np.array(paged_attention(**args)), rtol=1e-6, atol=1e-6)
    assert not dispatch.use_kernel(args, tables)


@pytest.mark.parametrize("kernel_s,reference_s,want", [(1.0, 2.0, True), (2.0, 1.0, False)])
def test_auto_chooses_the_faster_once_per_class(kernel_s, reference_s, want):
    timed = []

    def timer(fn):
        before = len(kernel.calls)
        fn()
        who = "kernel" if len(kernel.calls) > before else "reference"
        timed.append(who)
        return kernel_s if who == "kernel" else reference_s

    kernel = StubKernel()
    dispatch = kd.KernelDispatch("auto", kernel, paged_attention, timer=timer)
    for _ in range(3):
        assert dispatch.use_kernel(*call_args(3, 4)) is want
    assert timed == ["kernel", "reference"]  # once per class
    dispatch.use_kernel(*call_args(20, 4))
    assert timed == ["kernel", "reference"] * 2  # a new batch class is timed again


def test_quantized_pools_and_unsupported_calls():
    dispatch = kd.KernelDispatch("metal", StubKernel(), paged_attention)
    args, tables = call_args(2, 3, head_dim=64)
    q8 = ma.random_problem(1, context_lens=args["context_lens"], n_heads=4, n_kv_heads=2, head_dim=64,
                           block_size=8, kv_bits=8)
    qargs = {**args, "k_pool": q8["k_pool"], "v_pool": q8["v_pool"]}
    assert dispatch.use_kernel(qargs, tables)
    assert dispatch.use_kernel(args, tables)
    assert len(dispatch.choices) == 2  # the quantised pipeline is its own class
    assert not dispatch.use_kernel({**args, "v_pool": args["v_pool"][..., :32]}, tables)  # head_dim_v != head_dim
    assert not dispatch.use_kernel({**args, "v_pool": q8["v_pool"]}, tables)  # float K with quantised V


def test_chunk_is_part_of_the_shape_class():
    """Chunked attention (llama4) is its own class, checked with its chunk: a kernel that ignores the chunk
    passes the unchunked class and fails the chunked one."""

    class IgnoresChunk(StubKernel):
        def __call__(self, queries, *a, chunk=None, **k):
            return super().__call__(queries, *a, **k)

    dispatch = kd.KernelDispatch("metal", IgnoresChunk(), paged_attention, timer=never_timed)
    args, tables = call_args(2, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert dispatch.use_kernel(args, tables)
        assert not dispatch.use_kernel({**args, "chunk": 8}, tables)
        assert not dispatch.use_kernel({**args, "chunk": 8}, tables)
    assert len(caught) == 1 and "disagrees" in str(caught[0].message)
    assert sorted(dispatch.choices.values()) == ["kernel", "reference"]
    good = kd.KernelDispatch("metal", StubKernel(), paged_attention, timer=never_timed)
    assert good.use_kernel({**args, "chunk": 8}, tables) and good.use_kernel({**args, "chunk": 13}, tables)
    assert len(good.choices) == 2
    out = good(**{**args, "block_tables": tables, "chunk": 8})
    np.testing.assert_allclose(np.array(out), np.array(paged_attention(**args, chunk=8)), rtol=1e-5, atol=1e-5)


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


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal: the real kernel")
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_real_kernel_matches_reference_on_metal(head_dim):
    assert ma.self_check(ma.paged_attention_metal, paged_attention, head_dim=head_dim, block_size=16) is None
    if head_dim % 32 == 0:
        assert ma.self_check(ma.paged_attention_metal, paged_attention, head_dim=head_dim, block_size=16,
                             kv_bits=8) is None


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal: the real kernel")
def test_real_dispatch_checks_every_class_on_metal():
    dispatch = kd.KernelDispatch("metal", ma.paged_attention_metal, paged_attention)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for B, width in [(1, 2), (3, 5), (8, 40), (33, 3)]:
            for dtype in ma.SUPPORTED_DTYPES:
                args, tables = call_args(B, width, head_dim=128, block_size=16)
                args["queries"] = args["queries"].astype(dtype)
                args["k_pool"], args["v_pool"] = args["k_pool"].astype(dtype), args["v_pool"].astype(dtype)
                assert dispatch.use_kernel(args, tables)
