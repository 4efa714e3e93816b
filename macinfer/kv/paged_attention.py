"""Attention over a paged KV cache: the reference path, in plain MLX.

Everything the engine needs from attention goes through `paged_attention`, so a
fused Metal kernel that walks the block tables in place can replace this body
later without touching the callers.

Pool layout, per layer: head-major slots, [n_kv_heads, num_blocks * block_size, head_dim].

    slot = block * block_size + offset          block b owns slots [b*bs, (b+1)*bs) in every head

    pool[h] = | block 0 (null) | block 1 | block 2 | ... |     one (slots, head_dim) matrix per head
                 bs slots        bs slots

Why head-major: attention reads K/V as (B, n_kv_heads, S, head_dim), mlx-lm's
KVCache layout, with each head's (S, head_dim) matrix contiguous. A sequence whose
blocks are a contiguous run (the usual single stream: blocks are handed out in
order) is then ONE slice `pool[:, s0:s1]` -> (n_kv_heads, S, D) -> [None], with no
transpose; over a token-major pool the same read was slice + reshape + transpose
(a strided copy inside SDPA), which measured ~2x slower per layer on the CPU
backend. A batch gathers its slot ids in one take along the slot axis. The price:
writing a token touches n_kv_heads rows of head_dim values instead of one row, a
few microseconds at most (a single row's write is a slice update, not a scatter).

Reference algorithm: gather each sequence's slots into a dense
[B, n_kv_heads, S, head_dim] (S = its blocks * block_size, padded with the
null block), mask what must not be seen, and call
`mx.fast.scaled_dot_product_attention` (MLX's Metal kernel on a Mac).

Masking, for query i of a row with context length C and q_len queries:

    key slot j:   0 1 2 ... C-q_len ... C-1 | C ... S-1 (padding)
    query i sits at absolute position p = C - q_len + i and sees
    j <= p, and j > p - window for a sliding-window layer,
    and j >= p // chunk * chunk for a chunked layer (llama4's local attention):

    chunk = 4:  keys  0 1 2 3 | 4 5 6 7 | 8 9
                query p = 6 sees 4 5 6;  p = 8 sees 8 alone

plamo3's prompt window: mlx-lm's plamo3 asks its RotatingKVCache(W) for a (W + 1)-token mask.
That cache holds W keys in a one-token step but the W - 1 keys before a multi-token forward
plus its own, so in mlx-lm's generate_step (the prompt but its last token in forwards of
2048 tokens, then one token per forward) a query at p sees W + 1 tokens when p is a prompt
token before the last one and not the first of a 2048-token forward, else W tokens:

    prompt_window = W + 1 if p < prompt_len - 1 and p % 2048 != 0 else W
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, Sequence

import mlx.core as mx
import numpy as np


class QuantPool(NamedTuple):
    """A quantised K or V pool (macinfer.kv.quant): MLX affine codes with a scale and bias per group.

        codes            uint32 (n_kv_heads, slots, head_dim * bits / 32), element d of a slot in
                         word d // (32 / bits) at bit (d % (32 / bits)) * bits, lowest first
        scales, biases   (n_kv_heads, slots, head_dim / group_size):  x = scale * code + bias
    """

    codes: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """The dequantised pool's shape (n_kv_heads, slots, head_dim)."""
        H, S, words = self.codes.shape
        return (H, S, words * 32 // self.bits)

    @property
    def dtype(self) -> mx.Dtype:
        return self.scales.dtype


def take_slots(pool: mx.array | QuantPool, ids: mx.array) -> mx.array:
    """pool[:, ids] as floats: (n_kv_heads, *ids.shape, head_dim); a quantised pool is dequantised after the gather."""
    if isinstance(pool, QuantPool):
        return mx.dequantize(pool.codes[:, ids], pool.scales[:, ids], pool.biases[:, ids],
                             group_size=pool.group_size, bits=pool.bits)
    return pool[:, ids]


def take_blocks(pool: mx.array | QuantPool, tables: mx.array, bs: int, memo: dict | None = None) -> mx.array:
    """take_slots(pool, block_slots(tables, bs)), gathered a block at a time: (n_kv_heads, B, MB * bs, head_dim).

    The same values, cheaper on MLX's CPU backend, which pays per gathered slice and per graph op:
    whole blocks (~1/bs of the slices), indexed in the pool seen as (n_kv_heads * num_blocks)
    blocks, so one gather along one axis (`pool[:, tables]` adds an arange, broadcasts and casts;
    `mx.take(axis=1)` is ~8x slower). The flat block ids are built once per forward into `memo`.
    """
    B, MB = tables.shape

    def take(a):
        H, S, W = a.shape
        NB = S // bs
        key = ("head_blocks", id(tables), H, NB)
        rows = None if memo is None else memo.get(key)
        if rows is None:
            rows = tables[None] + (mx.arange(H, dtype=tables.dtype) * NB)[:, None, None]  # (H, B, MB)
            if memo is not None:
                memo[key] = rows
        return a.reshape(H * NB, bs, W)[rows].reshape(H, B, MB * bs, W)

    if isinstance(pool, QuantPool):
        return mx.dequantize(take(pool.codes), take(pool.scales), take(pool.biases),
                             group_size=pool.group_size, bits=pool.bits)
    return take(pool)


def slice_slots(pool: mx.array | QuantPool, s0: int, s1: int) -> mx.array:
    """pool[:, s0:s1] as floats (a view of a float pool: no copy)."""
    if isinstance(pool, QuantPool):
        return mx.dequantize(pool.codes[:, s0:s1], pool.scales[:, s0:s1], pool.biases[:, s0:s1],
                             group_size=pool.group_size, bits=pool.bits)
    return pool[:, s0:s1]


MLX_LM_PREFILL_STEP = 2048  # mlx-lm generate_step's prefill_step_size (plamo3's prompt window)
_SMALL_Q = 16  # up to this many queries per row, an additive causal mask built once per forward


def block_slots(block_tables: mx.array, block_size: int) -> mx.array:
    """int32 (B, MB) block ids -> (B, MB * block_size) slot ids, block by block."""
    B, MB = block_tables.shape
    return (block_tables[:, :, None] * block_size + mx.arange(block_size, dtype=mx.int32)).reshape(B, MB * block_size)


def contiguous_run(block_table: list[int]) -> bool:
    return all(b == block_table[0] + i for i, b in enumerate(block_table))


def row_blocks(table, C: int, q_len: int, bs: int, window: int | None, chunk: int | None = None,
               prompt_window: int | None = None) -> tuple[int, list[int]]:
    """The blocks one row's queries read: (first slot any query sees, rounded down to its block; their block ids).

    window, chunk: the layer's (module docstring); prompt_window: plamo3's wider window, when it applies.
    """
    first = 0
    if window is not None:
        first = max(0, C - q_len - max(window, prompt_window or 0) + 1)
    if chunk is not None:  # the first query's chunk starts no later than any later query's
        first = max(first, (C - q_len) // chunk * chunk)
    first = first // bs * bs
    return first, list(table[first // bs: -(-C // bs)])


def reads_one_slice(block_tables, context_lens, q_len: int, bs: int, window: int | None,
                    chunk: int | None = None) -> bool:
    """One row whose blocks in use are a contiguous run: the reference reads them as one slice, no copy
    (mlx-lm's own path: a KVCache slice into MLX's SDPA)."""
    if len(context_lens) != 1 or isinstance(block_tables, mx.array):
        return False
    return contiguous_run(row_blocks(block_tables[0], int(context_lens[0]), q_len, bs, window, chunk)[1])


def paged_attention(
    queries: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: list[list[int]] | mx.array,
    context_lens: Sequence[int],
    *,
    block_size: int,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
    memo: dict | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
    prompt_window: int | None = None,
    prompt_lens: Sequence[int] | None = None,
) -> mx.array:
    """Attention of the last q_len positions of each sequence over its paged context.

    Args:
        queries: (B, n_heads, q_len, head_dim), already rotated; the q_len queries
            are the last q_len positions of each row's context.
        k_pool, v_pool: (n_kv_heads, num_blocks * block_size, head_dim[_v]), head-major
            slots (module docstring), with this step's K/V already written; or `QuantPool`s,
            dequantised after the gather (only the slots read).
        block_tables: B block-id lists (or an int32 (B, max_blocks) array padded
            with the null block 0); a list shorter than context_lens[b] slots is
            padded with the null block.
        context_lens: tokens in each row's context, this step's included. Host ints:
            the reference path sizes its gather with them; a kernel would not.
            A row padded at the end (a shorter prefill chunk in a batch) counts its
            padding: its real queries then see only real keys, and nobody reads
            the padded queries' outputs.
        block_size: slots per block (the pools' shape does not carry it).
        scale: softmax scale.
        window: sliding-window size (a query sees itself and window-1 earlier
            tokens), or None for full attention.
        sinks: per-head attention sinks, passed through to MLX.
        memo: a dict shared by all layers of one forward, to build the padded
            table and the masks once instead of once per layer.
        softcap: logit soft-capping (Gemma 2): scores become tanh(s / softcap) * softcap
            before the mask and the softmax. MLX's fused SDPA has no such step, so the
            scores are then computed by hand (`softcapped_attention`).
        chunk: chunked local attention (llama4): a query at p sees only keys at
            positions >= p // chunk * chunk (its own chunk), or None.
        prompt_window, prompt_lens: plamo3's wider window for prompt queries (module
            docstring) and each row's prompt length; without prompt_lens, `window` only.

    Returns:
        (B, n_heads, q_len, head_dim_v), like mx.fast.scaled_dot_product_attention.
    """
    lens = [int(c) for c in context_lens]
    memo = {} if memo is None else memo
    prompt = None if prompt_window is None or prompt_lens is None else (prompt_window, list(prompt_lens))
    if queries.shape[0] == 1 and "tables" not in memo:  # a compiled forward's lone row: the batch path (host tables)
        table = block_tables[0] if not isinstance(block_tables, mx.array) else block_tables[0].tolist()
        k, v, mask = _one_row(queries, k_pool, v_pool, table, lens[0], block_size, window, chunk, prompt, memo)
    else:
        k, v, mask = _batch(queries, k_pool, v_pool, block_tables, lens, block_size, window, chunk, prompt, memo)
    return _sdpa(queries, k, v, scale=scale, mask=mask, sinks=sinks, softcap=softcap)


def visible(key, pos, window: int | None, chunk: int | None):
    """Boolean mask: which key positions the queries at `pos` see (module docstring); MLX or numpy arrays."""
    mask = key <= pos
    if window is not None:
        mask = mask & (key > pos - window)
    if chunk is not None:
        mask = mask & (key >= pos // chunk * chunk)
    return mask


def query_windows(pos: mx.array, window: int, prompt) -> int | mx.array:
    """Each query's window: `window`, or with prompt = (prompt_window, prompt lens) plamo3's rule.

    pos: (q_len, 1) positions of one row, or (B, q_len, 1) of a batch.
    """
    if prompt is None:
        return window
    prompt_window, plens = prompt
    plen = plens[0] if pos.ndim == 2 else mx.array(plens, dtype=mx.int32)[:, None, None]
    in_prompt = (pos < plen - 1) & (pos % MLX_LM_PREFILL_STEP != 0)
    return mx.where(in_prompt, prompt_window, window)


def _one_row(queries, k_pool, v_pool, table, C: int, bs: int, window, chunk, prompt, memo: dict):
    """One row (single stream or a prefill chunk): (k, v, mask) over exactly the slots in use.

    MLX applies the causal mask, the same shapes mlx-lm's own KVCache would produce. Only the
    window's (the chunk's) blocks are read when it applies.
    """
    q_len = queries.shape[2]
    first, blocks = row_blocks(table, C, q_len, bs, window, chunk, prompt and prompt[0])
    S = C - first
    if contiguous_run(blocks):
        # Blocks handed out in order (the usual single-stream case): one slice, no copy.
        s0 = blocks[0] * bs
        k, v = slice_slots(k_pool, s0, s0 + S)[None], slice_slots(v_pool, s0, s0 + S)[None]  # (1, n_kv, S, D)
    else:
        key_ = ("row_slots", first)
        if key_ not in memo:
            memo[key_] = block_slots(mx.array([blocks], dtype=mx.int32), bs)[0, :S]
        ids = memo[key_]
        k, v = take_slots(k_pool, ids)[None], take_slots(v_pool, ids)[None]  # (1, n_kv, S, D)
    if chunk is None and prompt is None and (window is None or S <= window and q_len == 1):
        mask = "causal" if q_len > 1 else None
        if mask and q_len <= _SMALL_Q and memo.setdefault("cpu", mx.default_device().type == mx.DeviceType.cpu):
            # A verify step's few queries: on the CPU backend SDPA builds its causal mask in
            # every layer; adding 0 or -inf to the scores, built once per forward, is exactly
            # what the causal mask does and cheaper there. Metal's fused kernel keeps "causal".
            key_ = ("causal_add", q_len, S, queries.dtype)
            if key_ not in memo:
                seen = mx.arange(S)[None] <= mx.arange(S - q_len, S)[:, None]
                memo[key_] = mx.where(seen, mx.array(0, queries.dtype), mx.array(-mx.inf, queries.dtype))
            mask = memo[key_]
    else:
        pos = mx.arange(C - q_len, C)[:, None]  # (q_len, 1) absolute query positions
        key = mx.arange(first, C)[None]  # (1, S)
        mask = visible(key, pos, query_windows(pos, window, prompt), chunk)
    return k, v, mask


def _batch(queries, k_pool, v_pool, block_tables, lens: list[int], bs: int, window, chunk, prompt, memo: dict):
    """Several rows: (k, v, mask) with every table padded to the longest with the null block, masked per row."""
    q_len = queries.shape[2]
    # One take of whole blocks: (n_kv, B, S, D) -> (B, n_kv, S, D).
    tables = batch_tables(memo, block_tables, lens, bs)
    k, v = (take_blocks(k_pool, tables, bs, memo).transpose(1, 0, 2, 3),
            take_blocks(v_pool, tables, bs, memo).transpose(1, 0, 2, 3))
    return k, v, batch_mask(memo, lens, bs, q_len, window, chunk, prompt)


def batch_tables(memo: dict, block_tables, lens: list[int], bs: int, min_blocks: int = 0) -> mx.array:
    """The (B, MB) block tables a batch gathers, each padded with the null block to the longest
    (or to min_blocks, if more: macinfer.core.decode_graph keeps shapes steady that way); once per forward."""
    if "tables" not in memo:
        if isinstance(block_tables, mx.array):
            memo["tables"] = block_tables
        else:
            MB = max(min_blocks, max(-(-c // bs) for c in lens))
            memo["tables"] = mx.array([list(t[:MB]) + [0] * (MB - len(t[:MB])) for t in block_tables], dtype=mx.int32)
    return memo["tables"]


def batch_mask(memo: dict, lens: list[int], bs: int, q_len: int, window, chunk, prompt=None) -> mx.array:
    """(B, 1, q_len, S) which of the keys `batch_tables` reads (S = MB * bs) each query sees (it hides the
    padding: pos < C); once per forward."""
    key_ = ("mask", window, chunk, q_len, prompt and prompt[0])
    if key_ not in memo:
        S = memo["tables"].shape[1] * bs
        if q_len == 1 and window is None and chunk is None and prompt is None:
            # A plain decode row sees the keys before its context length: two numpy ops. This runs on
            # the engine thread while the step before evaluates, where every allocation is dear
            # (docs/platform.md#cpu-host); the general path below allocates several times as much.
            memo[key_] = mx.array((_arange(S) < np.array(lens, dtype=np.int32)[:, None]).reshape(len(lens), 1, 1, S))
            return memo[key_]
        # Built with numpy when it can be (no prompt window): one array, not a dozen graph ops per step.
        xp = np if prompt is None else mx
        ctx = xp.array(lens, dtype=xp.int32)[:, None, None]  # (B, 1, 1)
        pos = ctx - q_len + xp.arange(q_len, dtype=xp.int32)[None, :, None]  # (B, q_len, 1)
        key = xp.arange(S, dtype=xp.int32)[None, None, :]  # (1, 1, S)
        mask = visible(key, pos, query_windows(pos, window, prompt), chunk)[:, None]
        memo[key_] = mx.array(mask) if xp is np else mask
    return memo[key_]


@lru_cache(maxsize=64)
def _arange(n: int) -> np.ndarray:
    """0..n-1 as int32, shared (read-only): the key positions of a batch mask."""
    a = np.arange(n, dtype=np.int32)
    a.flags.writeable = False
    return a


def _sdpa(queries, k, v, *, scale, mask, sinks, softcap):
    if softcap is None:
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask, sinks=sinks)
    if sinks is not None:
        raise ValueError("attention sinks together with logit soft-capping are not supported")
    return softcapped_attention(queries, k, v, scale=scale, mask=mask, softcap=softcap)


def softcapped_attention(queries, keys, values, *, scale: float, mask, softcap: float) -> mx.array:
    """Attention with soft-capped scores, op for op as mlx-lm's Gemma 2 computes it.

        scores = (q * scale) @ k^T;   scores = tanh(scores / softcap) * softcap
        masked scores -> dtype min (a boolean mask) or + mask (an additive one)
        out = softmax(scores, precise) @ v

    Args:
        queries: (B, n_heads, L, D); keys, values: (B, n_kv_heads, S, D[_v]).
        mask: None, "causal" (the last L of S positions), a boolean mask or an additive
            one, broadcastable to (B, 1, L, S) or (L, S).
    """
    B, H, L, D = queries.shape
    KVH, S = keys.shape[1], keys.shape[2]
    rep = H // KVH
    queries = queries * scale
    if rep > 1:  # grouped-query: (B, kvh, rep, L, D) against (B, kvh, 1, S, D), as mlx-lm does
        queries = queries.reshape(B, KVH, rep, L, D)
        keys, values = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
    scores = queries @ keys.swapaxes(-1, -2)
    scores = mx.tanh(scores / softcap)
    scores *= softcap
    if isinstance(mask, str):
        mask = mx.arange(S)[None] <= mx.arange(S - L, S)[:, None]
    if mask is not None:
        if rep > 1 and mask.ndim == 4:
            mask = mx.expand_dims(mask, 2)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    out = mx.softmax(scores, precise=True, axis=-1) @ values
    return out.reshape(B, H, L, -1) if rep > 1 else out
