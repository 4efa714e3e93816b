"""The paged KV pool layout: head-major slots, and attention reading them.

    pool (n_kv_heads, num_blocks * block_size, head_dim); slot = block * block_size + offset

Checked against an oracle at the smallest scale: where each new token's K lands,
and attention over contiguous, shuffled and batched block tables equal to SDPA
over the dense K/V of each row.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from macinfer.kv.paged_attention import QuantPool, block_slots, paged_attention, take_blocks
from macinfer.kv.paged_cache import ForwardContext, LayerSpec, PagedKVCache, write_pool

BS, H, D = 4, 2, 8


def cache_with_rows(starts, L, tables):
    """A PagedKVCache whose context describes rows of L new tokens at starts (as ModelRunner sets it)."""
    ctx = ForwardContext()
    blocks = [t[p // BS] for s, t in zip(starts, tables) for p in range(s, s + L)]
    ctx.offsets = starts[0] if len(starts) == 1 else mx.array(starts, dtype=mx.int32)
    ctx.block_tables = tables
    ctx.context_lens = [s + L for s in starts]
    ctx.slot_ids = mx.array([b * BS + p % BS for b, p in zip(blocks, (p for s in starts for p in range(s, s + L)))],
                            dtype=mx.int32)
    return PagedKVCache(ctx, LayerSpec(H, D, D, None, mx.float32), num_blocks=8, block_size=BS)


@pytest.mark.parametrize("starts,L,tables,want_slots", [
    ([5], 3, [[3, 4]], [17, 18, 19]),  # one row, one block: a slice update at slot 4 * 4 + 1
    ([2], 4, [[3, 5]], [14, 15, 20, 21]),  # one row, a contiguous run of two blocks
    ([2], 4, [[3, 1]], [14, 15, 4, 5]),  # one row across non-adjacent blocks: a scatter
    ([6, 0], 1, [[2, 7], [6]], [30, 24]),  # a decode batch
    ([0, 3], 2, [[1], [2, 5]], [4, 5, 11, 20]),  # a padded prefill batch
])
def test_new_tokens_land_in_head_major_slots(starts, L, tables, want_slots):
    c = cache_with_rows(starts, L, tables)
    B = len(starts)
    keys = mx.arange(B * H * L * D, dtype=mx.float32).reshape(B, H, L, D) + 1
    c.update_and_fetch(keys, -keys)
    k, v = np.array(c.k_pool), np.array(c.v_pool)
    assert k.shape == (H, 8 * BS, D)
    want = np.array(keys).transpose(1, 0, 2, 3).reshape(H, B * L, D)  # (H, T, D), row-major tokens
    np.testing.assert_array_equal(k[:, want_slots], want)
    np.testing.assert_array_equal(v[:, want_slots], -want)
    untouched = np.ones(8 * BS, bool)
    untouched[want_slots] = False
    assert not k[:, untouched].any() and not v[:, untouched].any()


def test_write_pool_writes_in_place():
    """Slot ids scatter into the pool's own buffer: no second pool in peak memory, only the named slots change."""
    pool = mx.zeros((H, 1 << 18, D))  # 16 MB
    x = mx.arange(H * 3 * D, dtype=mx.float32).reshape(H, 3, D) + 1
    slots = mx.array([5, 70000, 9], dtype=mx.int32)
    mx.eval(pool, x, slots)
    mx.reset_peak_memory()
    pool = write_pool(pool, slots, x)
    mx.eval(pool)
    assert mx.get_peak_memory() < pool.nbytes // 2
    got = np.array(pool)
    np.testing.assert_array_equal(got[:, [5, 70000, 9]], np.array(x))
    assert np.count_nonzero(got) == np.count_nonzero(np.array(x))


def test_block_slots():
    assert block_slots(mx.array([[2, 0], [1, 3]]), 3).tolist() == [[6, 7, 8, 0, 1, 2], [3, 4, 5, 9, 10, 11]]


@pytest.mark.parametrize("bits", [None, 8])
def test_take_blocks_gathers_what_the_slot_ids_name(bits):
    """Whole blocks at a time (the batched read): the same keys, in the same order, as pool[:, slots]."""
    tables = [[2, 0, 5], [1, 7, 3]]
    pool = mx.arange(H * 8 * BS * 64, dtype=mx.float32).reshape(H, 8 * BS, 64)
    got = take_blocks(pool if bits is None else QuantPool(*mx.quantize(pool, 64, bits), bits, 64),
                      mx.array(tables, dtype=mx.int32), BS)
    want = np.array(pool)[:, [[b * BS + o for b in t for o in range(BS)] for t in tables]]
    assert got.shape == (H, 2, 3 * BS, 64)
    memo, t = {}, mx.array(tables, dtype=mx.int32)  # the flat block ids, built once, serve a second pool too
    wide = mx.concatenate([pool, pool + 1], axis=0)  # 2H heads: other ids, same memo
    for p_, want_ in ((pool, want), (wide, np.array(wide)[:, block_slots(t, BS)]), (pool, want)):
        np.testing.assert_array_equal(np.array(take_blocks(p_, t, BS, memo)), want_)
    assert len(memo) == 2
    if bits is None:
        np.testing.assert_array_equal(np.array(got), want)
    else:
        np.testing.assert_allclose(np.array(got), want, rtol=0.02)
        want_q = mx.dequantize(*mx.quantize(pool, 64, bits), group_size=64, bits=bits)[:, block_slots(mx.array(tables), BS)]
        np.testing.assert_array_equal(np.array(got), np.array(want_q))


def dense_oracle(q, k, v, C, window=None):
    """SDPA over one row's dense (1, H, C, D) K/V, its q_len queries the last positions."""
    q_len = q.shape[2]
    pos = mx.arange(C - q_len, C)[:, None]
    key = mx.arange(C)[None]
    mask = key <= pos
    if window:
        mask = mask & (key > pos - window)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask)


def place(pool_k, pool_v, k, v, table):
    """Write one row's dense K/V (1, H, C, D) into the pools along its block table."""
    C = k.shape[2]
    slots = mx.array([table[p // BS] * BS + p % BS for p in range(C)])
    pool_k[:, slots] = k[0]
    pool_v[:, slots] = v[0]


@pytest.mark.parametrize("q_len,window", [(1, None), (3, None), (1, 6), (2, 5)])
def test_attention_over_contiguous_shuffled_and_batched_tables(q_len, window):
    rng = np.random.default_rng(q_len * 10 + (window or 0))
    n_heads, num_blocks = 2 * H, 16
    lens = [13, 7]
    tables = {"contiguous": [[2, 3, 4, 5], [9, 10]], "shuffled": [[11, 6, 14, 1], [15, 8]]}
    rows = [(mx.array(rng.standard_normal((1, H, C, D)), mx.float32),
             mx.array(rng.standard_normal((1, H, C, D)), mx.float32),
             mx.array(rng.standard_normal((1, n_heads, q_len, D)), mx.float32)) for C in lens]
    want = [dense_oracle(q, k, v, C, window) for (k, v, q), C in zip(rows, lens)]
    for name, tabs in tables.items():
        kp = mx.full((H, num_blocks * BS, D), float("nan"))  # unused slots must never be read
        vp = mx.full((H, num_blocks * BS, D), float("nan"))
        for (k, v, _), t in zip(rows, tabs):
            place(kp, vp, k, v, t)
        for b, ((_, _, q), C) in enumerate(zip(rows, lens)):  # one row: slice or slot gather
            got = paged_attention(q, kp, vp, [tabs[b]], [C], block_size=BS, scale=D**-0.5, window=window)
            np.testing.assert_allclose(np.array(got), np.array(want[b]), rtol=1e-5, atol=1e-5, err_msg=name)
        kp0 = mx.where(mx.isnan(kp), 0.0, kp)  # a batch reads the null block's padding (masked)
        vp0 = mx.where(mx.isnan(vp), 0.0, vp)
        q = mx.concatenate([r[2] for r in rows])
        got = paged_attention(q, kp0, vp0, tabs, lens, block_size=BS, scale=D**-0.5, window=window)
        for b in range(2):
            np.testing.assert_allclose(np.array(got[b:b + 1]), np.array(want[b]), rtol=1e-5, atol=1e-5,
                                       err_msg=f"{name} batch row {b}")


@pytest.mark.parametrize("q_len", [2, 5, 17])
def test_few_queries_use_an_additive_mask_bit_identical_to_causal(q_len):
    """A verify step's few queries get a memoised additive mask instead of SDPA's "causal"
    (cheaper on the CPU backend); the outputs are the same bits, so greedy stays mlx-lm's."""
    import macinfer.kv.paged_attention as pa

    rng = np.random.default_rng(q_len)
    C, n_heads = 29, 2 * H
    k, v = (mx.array(rng.standard_normal((1, H, C, D)), mx.float32) for _ in range(2))
    q = mx.array(rng.standard_normal((1, n_heads, q_len, D)), mx.float32)
    kp, vp = mx.zeros((H, 16 * BS, D)), mx.zeros((H, 16 * BS, D))
    table = list(range(3, 3 + -(-C // BS)))
    place(kp, vp, k, v, table)
    memo = {}
    got = paged_attention(q, kp, vp, [table], [C], block_size=BS, scale=D**-0.5, memo=memo)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask="causal")
    assert mx.array_equal(got, want).item()
    assert any(key[0] == "causal_add" for key in memo) == (q_len <= pa._SMALL_Q)


def test_decode_mask_shortcut_equals_the_general_rule():
    """One query per row, no window: batch_mask's two-op shortcut marks what `visible` marks."""
    from macinfer.kv.paged_attention import batch_mask, batch_tables, visible

    rng = np.random.default_rng(3)
    for B in (1, 2, 5, 16):
        lens = [int(x) for x in rng.integers(1, 7 * BS, B)]
        tables = [list(range(-(-c // BS))) for c in lens]
        memo = {}
        batch_tables(memo, tables, lens, BS, min_blocks=8)
        got = np.array(batch_mask(memo, lens, BS, 1, None, None))
        S = memo["tables"].shape[1] * BS
        pos = np.array(lens)[:, None, None] - 1
        want = visible(np.arange(S)[None, None, :], pos, None, None)[:, None]
        assert got.shape == (B, 1, 1, S) and got.dtype == np.bool_
        assert (got == want).all()
