"""Attention over a paged KV cache: the reference path, in plain MLX.

Everything the engine needs from attention goes through `paged_attention`, so a
fused Metal kernel that walks the block tables in place can replace this body
later without touching the callers.

Pool layout, per layer: [num_blocks, block_size, n_kv_heads, head_dim]. A token's
K/V is one contiguous row of n_kv_heads * head_dim values, so writing a step's
new tokens is a single scatter of whole rows, and a block is one contiguous
chunk (what a kernel streaming blocks wants to read).

Reference algorithm: gather each sequence's blocks into a dense
[B, n_kv_heads, S, head_dim] (S = its blocks * block_size, padded with the
null block), mask what must not be seen, and call
`mx.fast.scaled_dot_product_attention` (MLX's Metal kernel on a Mac).

Masking, for query i of a row with context length C and q_len queries:

    key slot j:   0 1 2 ... C-q_len ... C-1 | C ... S-1 (padding)
    query i sits at absolute position p = C - q_len + i and sees
    j <= p, and j > p - window for a sliding-window layer.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx


def _gather(pool: mx.array, block_tables: mx.array) -> mx.array:
    """[num_blocks, bs, H, D] gathered by [B, MB] -> [B, H, MB * bs, D]."""
    B, MB = block_tables.shape
    _, bs, H, D = pool.shape
    x = pool[block_tables]  # (B, MB, bs, H, D)
    return x.reshape(B, MB * bs, H, D).transpose(0, 2, 1, 3)


def _contiguous_run(block_table: list[int]) -> bool:
    return all(b == block_table[0] + i for i, b in enumerate(block_table))


def paged_attention(
    queries: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: list[list[int]] | mx.array,
    context_lens: Sequence[int],
    *,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
    memo: dict | None = None,
) -> mx.array:
    """Attention of the last q_len positions of each sequence over its paged context.

    Args:
        queries: (B, n_heads, q_len, head_dim), already rotated; the q_len queries
            are the last q_len positions of each row's context.
        k_pool, v_pool: (num_blocks, block_size, n_kv_heads, head_dim[_v]), with this
            step's K/V already written.
        block_tables: B block-id lists (or an int32 (B, max_blocks) array padded
            with the null block 0); a list shorter than context_lens[b] slots is
            padded with the null block.
        context_lens: tokens in each row's context, this step's included. Host ints:
            the reference path sizes its gather with them; a kernel would not.
            A row padded at the end (a shorter prefill chunk in a batch) counts its
            padding: its real queries then see only real keys, and nobody reads
            the padded queries' outputs.
        scale: softmax scale.
        window: sliding-window size (a query sees itself and window-1 earlier
            tokens), or None for full attention.
        sinks: per-head attention sinks, passed through to MLX.
        memo: a dict shared by all layers of one forward, to build the padded
            table and the masks once instead of once per layer.

    Returns:
        (B, n_heads, q_len, head_dim_v), like mx.fast.scaled_dot_product_attention.
    """
    B, _, q_len, _ = queries.shape
    bs = k_pool.shape[1]
    lens = [int(c) for c in context_lens]

    if B == 1:
        # One row (single stream or a prefill chunk): gather exactly the blocks
        # in use and let MLX apply the causal mask, the same shapes mlx-lm's own
        # KVCache would produce. Only the window's blocks are read when it applies.
        table = block_tables[0] if not isinstance(block_tables, mx.array) else block_tables[0].tolist()
        C = lens[0]
        first = 0
        if window is not None:
            first = max(0, C - q_len - window + 1) // bs * bs  # oldest slot any query sees
        blocks = list(table[first // bs: -(-C // bs)])
        if _contiguous_run(blocks):
            # Blocks handed out in order (the usual single-stream case): a slice, no gather.
            k = k_pool[blocks[0]: blocks[-1] + 1]
            v = v_pool[blocks[0]: blocks[-1] + 1]
            k = k.reshape(1, -1, *k.shape[2:]).transpose(0, 2, 1, 3)
            v = v.reshape(1, -1, *v.shape[2:]).transpose(0, 2, 1, 3)
        else:
            ids = mx.array([blocks], dtype=mx.int32)
            k, v = _gather(k_pool, ids), _gather(v_pool, ids)
        k, v = k[:, :, : C - first], v[:, :, : C - first]
        if window is None or C - first <= window and q_len == 1:
            mask = "causal" if q_len > 1 else None
        else:
            pos = mx.arange(C - q_len, C)[:, None]  # (q_len, 1) absolute query positions
            key = mx.arange(first, C)[None]  # (1, S)
            mask = (key <= pos) & (key > pos - window)
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask, sinks=sinks)

    # Batch: pad every table to the longest with the null block, mask per row.
    memo = {} if memo is None else memo
    if "tables" not in memo:
        if isinstance(block_tables, mx.array):
            memo["tables"] = block_tables
        else:
            MB = max(-(-c // bs) for c in lens)
            memo["tables"] = mx.array([list(t[:MB]) + [0] * (MB - len(t[:MB])) for t in block_tables], dtype=mx.int32)
    tables = memo["tables"]
    k, v = _gather(k_pool, tables), _gather(v_pool, tables)  # (B, n_kv, S, D)
    key_ = ("mask", window, q_len)
    if key_ not in memo:
        S = k.shape[2]
        ctx = mx.array(lens, dtype=mx.int32)[:, None, None]  # (B, 1, 1)
        pos = ctx - q_len + mx.arange(q_len, dtype=mx.int32)[None, :, None]  # (B, q_len, 1)
        key = mx.arange(S, dtype=mx.int32)[None, None, :]  # (1, 1, S)
        mask = key <= pos  # also hides padding: pos < C
        if window is not None:
            mask = mask & (key > pos - window)
        memo[key_] = mask[:, None]  # (B, 1, q_len, S)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=memo[key_], sinks=sinks)
