"""Attention that mlx-lm's models compute their own way, routed onto the paged KV cache.

`macinfer.kv.paged_cache` pages every model whose attention is the usual
rope -> cache.update_and_fetch -> scaled_dot_product_attention, by patching that function in
the model's module. Some families step outside it; here each one is intercepted at the
narrowest point mlx-lm's code allows, without copying a model file. The model's attention
module keeps its parameters and tree path; only its class becomes a subclass of mlx-lm's
(`_retype`), whose __call__ takes the paged path for a PagedKVCache and calls mlx-lm's own
code for anything else (so mlx-lm keeps working on the same model object):

- gemma2: the attention is written out by hand (q * scale @ k^T, tanh soft-capping, softmax),
  and the model asks `create_attention_mask(..., return_array=True)`. The subclass does the
  projections and rope as mlx-lm does, writes K/V through the cache and calls paged attention
  with `softcap` (the reference path, or the Metal kernel's soft-capped scores); the module's
  `create_attention_mask` hands a paged cache's PagedMask back instead of an array.
  (mlx-lm's gemma2 gives every layer a plain KVCache, no sliding window; neither do we.)

- gemma3n, gemma4_text: the last num_kv_shared_layers layers reuse the K/V of the last earlier
  layer of the same type, and mlx-lm's make_cache makes caches for the other layers only. A
  sharing layer gets a `SharedKVView` of its source layer's cache: it reads the source's pools
  (K/V paged once, read by two layers) and never writes. gemma3n hands the sharing layer the
  source cache itself (its keys_and_values() is what breaks); gemma4 hands it the (keys, values)
  the source layer's update_and_fetch returned (only this step's tokens on a paged cache), which
  the source's subclass replaces with a marker pointing at its cache.

- afm7: its last num_kv_reuse_layers layers attend to the last K/V layer's cache with queries
  of their own; mlx-lm's model body hands them cache[-1].keys_and_values() and they rotate their
  queries at S - L (the number of keys minus the forward's length: right for one unpadded row,
  wrong for a left-padded row of mlx-lm's BatchGenerator). The body is subclassed to hand them a
  SharedKVView instead, and they rotate at each row's position.

- iquestloopcoder: runs its layers twice; the second pass attends globally over the K/V the first
  pass wrote (mlx-lm hands sdpa those keys with the second pass's own cache) and locally over
  its own sliding window. The body is subclassed to hand the global call a SharedKVView of the
  first pass's cache.

- minimax_m3_vl: its block-sparse layers' indexer cuts key blocks over cache slots and places
  queries at slots S - L ... S - 1, which only one unpadded row satisfies; those layers run row
  by row on each row's own context (`_RowContext`).

- plamo2: its attention calls mx.fast.scaled_dot_product_attention itself; the subclass runs
  mlx-lm's code up to that call and sends it to paged attention.

- deepseek_v3, kimi_k25, glm4_moe_lite, mistral4, bailing_hybrid, bailing_moe_v3, kimi_linear,
  longcat_flash (two MLA attentions per layer, a CacheList of two latents) (MLA): mlx-lm
  already caches the compressed latent (kv_latent, k_pe: kv_lora_rank + qk_rope_head_dim values
  per token) and expands or absorbs it inside attention, asking its cache for the whole context
  back and for a mask array. The pools
  page exactly that latent (one "KV head": K = latent, V = rope key); the layer is handed a
  `_LatentContext` whose update_and_fetch writes the pools and returns the dense context of
  this forward's rows (`dense_context`), plus a boolean mask with each row's causality and
  padding, so mlx-lm's own MLA code and sdpa run unchanged on it. (A gather per layer, like
  the reference paged attention's; the fused kernel does not cover MLA.)

- deepseek_v32, glm_moe_dsa (MLA with an indexer): a CacheList(latent, indexer keys) per layer,
  both paged (the runner hands the layer a CacheList of its two paged caches, ModelSpecs.layout
  "kvlist"); both get a _LatentContext, so mlx-lm's own indexer picks its top-k keys from each
  row's dense context (other rows' padding masked) and its attention runs on the picked ones.

While `inspect_model` probes the model with mlx-lm's caches, a sharing layer's attention is
kept out of the count (it adds no cache), gemma2's goes through the probe's sdpa hook, and an
MLA layer reports the latent's shapes (what it pages) instead of the expanded K/V it attends.

- llama4: three layers in four attend within fixed chunks (ChunkedKVCache); their caches mask
  their chunk in paged attention (`chunk`), and the model body hands each layer its cache's mask
  instead of mlx-lm's chunk mask array. Its NoPE layers' query scaling takes per-row offsets.

- gpt_bigcode builds its learned position ids with np.arange(cache.offset, ...), a Python int:
  its model body is subclassed to take one position per row from a (B,) offset array.

`batched_offsets_work(model)` answers the other question the engine asks of a model: can it
take one offset per row? A lazy forward with (B,) offsets finds out; a model that makes a
Python int of cache.offset (as gpt_bigcode would without the above) fails it, and the engine
then runs one row per forward (a correct, slower fallback).
"""

from __future__ import annotations

import contextlib
import sys

import mlx.core as mx
import mlx.nn as nn

from mlx_lm.models.base import create_attention_mask

from macinfer.errors import MacinferError
from macinfer.kv import paged_cache as _pc
from macinfer.kv.paged_attention import block_slots, contiguous_run, slice_slots, take_blocks, take_slots
from macinfer.kv.paged_cache import PagedKVCache, head_major, write_pool


# -- the cache view of a KV-sharing layer ------------------------------------------------------------


class SharedKVView(PagedKVCache):
    """A KV-sharing layer's cache: attention over its source layer's pools; writes nothing."""

    def __init__(self, source: PagedKVCache):  # no pools of its own
        self.source = source
        self.ctx, self.window, self.chunk, self.block_size = source.ctx, source.window, source.chunk, source.block_size

    @property
    def offset(self):
        return self.source.offset

    def update_and_fetch(self, keys, values):
        return keys, values  # the source layer wrote this step's K/V already

    def keys_and_values(self):
        return None, None  # attention reads the pools (gemma3n asks, then calls sdpa with us)

    def make_mask(self, *args, **kwargs):
        return self.source.make_mask(*args, **kwargs)

    def attention(self, queries, mask, scale, sinks=None, softcap=None):
        return self.source.attention(queries, mask, scale, sinks, softcap=softcap)

    @property
    def state(self):
        return []

    @property
    def nbytes(self) -> int:
        return 0


class _SharedPages(tuple):
    """What a gemma4 source layer hands its sharing layers instead of (keys, values)."""

    def __new__(cls, view: SharedKVView):
        obj = super().__new__(cls, (None, None))  # unpacks like (keys, values)
        obj.view = view
        return obj


@contextlib.contextmanager
def _unprobed():
    """Keep an attention call out of inspect_model's count (a sharing layer adds no cache)."""
    saved = getattr(_pc, "probe_calls", None)
    _pc.probe_calls = None
    try:
        yield
    finally:
        _pc.probe_calls = saved


def _probing() -> bool:
    return getattr(_pc, "probe_calls", None) is not None


# -- per-family subclasses ---------------------------------------------------------------------------


def _project(attn, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """mlx-lm's usual q/k/v projections: (B, L, dim) -> (B, n_heads | n_kv_heads, L, head_dim) each."""
    B, L, _ = x.shape
    queries, keys, values = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    queries = queries.reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
    keys = keys.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    return queries, keys, values.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)


class _Gemma2Attention:
    """gemma2.Attention with soft-capped paged attention (mixed in before mlx-lm's class)."""

    def __call__(self, x, mask=None, cache=None):
        if not (isinstance(cache, PagedKVCache) or (_probing() and cache is not None)):
            return super().__call__(x, mask, cache)
        # mlx-lm's gemma2 Attention up to the scores, unchanged.
        B, L, _ = x.shape
        queries, keys, values = _project(self, x)
        queries = self.rope(queries, offset=cache.offset)
        keys = self.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
        if isinstance(cache, PagedKVCache):
            out = cache.attention(queries, mask, self.scale, softcap=self.attn_logit_softcapping)
        else:  # inspect_model's probe: record this layer's K/V shapes (lazy, nothing computed)
            out = _pc.paged_sdpa(queries, keys, values, cache, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class _Plamo2Attention:
    """plamo2's Attention calls mx.fast's sdpa itself; on a paged cache it goes to paged attention."""

    def __call__(self, hidden_states, mask=None, cache=None):
        if not (isinstance(cache, PagedKVCache) or (_probing() and cache is not None)):
            return super().__call__(hidden_states, mask, cache)
        # mlx-lm's plamo2 Attention up to the sdpa call, unchanged.
        B, T, _ = hidden_states.shape
        q, k, v = mx.split(self.qkv_proj(hidden_states), [self.q_proj_dim, self.q_proj_dim + self.k_proj_dim], axis=-1)
        q = q.reshape(B, T, self.q_num_heads, self.qk_dim).transpose(0, 2, 1, 3)
        k = k.reshape(B, T, self.k_num_heads, self.qk_dim).transpose(0, 2, 1, 3)
        v = v.reshape(B, T, self.v_num_heads, self.v_dim).transpose(0, 2, 1, 3)
        q = mx.fast.rms_norm(q, weight=None, eps=1e-6) * self.q_weight[:, None]
        k = mx.fast.rms_norm(k, weight=None, eps=1e-6) * self.k_weight[:, None]
        q = self.rope(q, offset=cache.offset)
        k = self.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        out = _pc.paged_sdpa(q, k, v, cache, self.scale, mask)  # the probe records the K/V shapes
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, self.q_num_heads * self.v_dim))


class _Gemma3nAttention:
    """Gemma3nAttention whose KV-shared layers read their source layer's pools through a view."""

    def __call__(self, x, mask=None, cache=None, offset=0):
        if not self.is_kv_shared_layer:
            return super().__call__(x, mask, cache, offset=offset)
        if isinstance(cache, PagedKVCache):
            return super().__call__(x, mask, SharedKVView(cache), offset=offset)
        with _unprobed():
            return super().__call__(x, mask, cache, offset=offset)


class _Gemma4Attention:
    """gemma4_text Attention: sources hand their cache on, sharing layers read it through a view."""

    def __call__(self, x, mask=None, cache=None, shared_kv=None, offset=None):
        if isinstance(shared_kv, _SharedPages):
            return super().__call__(x, mask, shared_kv.view, shared_kv=shared_kv, offset=offset)
        if shared_kv is not None or not self.has_kv:
            with _unprobed():
                return super().__call__(x, mask, cache, shared_kv=shared_kv, offset=offset)
        out, kvs, offset = super().__call__(x, mask, cache, shared_kv=shared_kv, offset=offset)
        if isinstance(cache, PagedKVCache):
            kvs = _SharedPages(SharedKVView(cache))  # the step's K/V alone would be wrong to share
        return out, kvs, offset


class _AFMModel:
    """afm7's AFMModel on paged caches: its KV-reuse layers read the last K/V layer's pools.

    mlx-lm hands those layers cache[-1].keys_and_values() (the dense K/V) and rotates their
    queries at S - L, where S counts the keys: with one row, the forward's first position.
    Here they get a SharedKVView of that cache instead, and their queries each row's position.
    """

    def __call__(self, inputs, cache=None):
        if cache is None or not isinstance(cache[-1], PagedKVCache):
            return super().__call__(inputs, cache)
        h = self.embedding(inputs)
        mask = cache[0].make_mask(h.shape[1])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)
        shared = SharedKVView(cache[-1])
        for layer in self.kv_reuse_layers:
            h = layer(h, shared, None, mask)
        return self.output_norm(h)


class _LoopCoderModel:
    """iquestloopcoder's body on paged caches: its second loop's global attention reads the first loop's pools.

    mlx-lm runs the layers twice. The second pass attends twice per layer: globally, over the K/V
    the first pass wrote (handed to sdpa with the second pass's own cache), then locally, over its
    own sliding-window cache. Paged, the global call gets a SharedKVView of the first pass's
    cache (the pools it must read; a paged sdpa reads its cache's pools, not the keys passed),
    and inspect_model does not count it (it adds no cache). Otherwise mlx-lm's code, line for line.
    """

    def __call__(self, inputs, cache=None):
        if cache is None:
            return super().__call__(inputs, cache)
        B, L = inputs.shape[:2]
        h = self.embed_tokens(inputs)
        n = len(self.layers)
        mask = create_attention_mask(h, cache[0])
        window_mask = create_attention_mask(h, cache[n], window_size=self.loop_window_size)
        first = []
        for layer, c in zip(self.layers, cache):
            q1, k1, v1 = layer.self_attn.get_qkv(layer.input_layernorm(h), c.offset)
            k1, v1 = c.update_and_fetch(k1, v1)
            first.append((c, k1, v1))
            out = layer.self_attn.attention(q1, k1, v1, mask, cache=c)
            h = h + layer.self_attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        for layer, gate_proj, c, (c1, k1, v1) in zip(self.layers, self.gate_projections, cache[n:], first):
            q2, k2, v2 = layer.self_attn.get_qkv(layer.input_layernorm(h), c.offset)
            gate = gate_proj(q2)
            with _unprobed():
                attn_global = layer.self_attn.attention(
                    q2, k1, v1, mask, cache=SharedKVView(c1) if isinstance(c1, PagedKVCache) else c)
            k2, v2 = c.update_and_fetch(k2, v2)
            attn_local = layer.self_attn.attention(q2, k2, v2, window_mask, cache=c)
            mixed = gate * attn_global + (1 - gate) * attn_local
            h = h + layer.self_attn.o_proj(mixed.transpose(0, 2, 1, 3).reshape(B, L, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)


class _AFMKVReuseAttention:
    """afm7's KVReuseAttention over a SharedKVView (from _AFMModel); mlx-lm's own for dense K/V."""

    def __call__(self, x, keys, values, mask=None):
        if not isinstance(keys, SharedKVView):
            with _unprobed():  # no cache of its own: kept out of inspect_model's count
                return super().__call__(x, keys, values, mask)
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        queries = self.q_norm(self.rope(queries, offset=keys.offset))  # (B,) row positions, not S - L
        out = keys.attention(queries, mask, self.scale)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class _LatentContext:
    """What an MLA layer's attention sees of a paged cache: the pools' latent context, dense.

    Not a PagedKVCache, so the model's sdpa call goes to mlx-lm's own (with the K/V it built
    from what update_and_fetch returned): exactly the ops mlx-lm runs on its KVCache.
    """

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.keys = self.values = None  # deepseek_v32 reads them (and sets them: mx.depends)

    @property
    def offset(self):
        return self.cache.offset

    def update_and_fetch(self, latent, k_pe):
        self.cache.update_and_fetch(latent, k_pe)  # pages the compressed latent and the rope key
        self.keys, self.values = dense_context(self.cache)
        return self.keys, self.values

    def mask(self, L: int, arrays: bool = True):
        """mlx-lm's mask for this forward (None for one row of one token).

        One row: what mlx-lm's KVCache.make_mask gives, an (L, S) boolean array if the model
        asks for arrays, else "causal". A batch: (B, 1, L, S) booleans, hiding other rows' padding.
        """
        ctx, memo = self.cache.ctx, self.cache.ctx.memo
        key = ("latent_mask", L, arrays)
        if key not in memo:
            lens = ctx.context_lens
            if len(lens) == 1:
                from mlx_lm.models.base import create_causal_mask

                memo[key] = None if L == 1 else create_causal_mask(L, offset=lens[0] - L) if arrays else "causal"
            else:
                S = max(-(-c // self.cache.block_size) for c in lens) * self.cache.block_size  # dense_context's width
                pos = mx.array(lens, dtype=mx.int32)[:, None, None] - L + mx.arange(L, dtype=mx.int32)[None, :, None]
                memo[key] = (mx.arange(S, dtype=mx.int32)[None, None] <= pos)[:, None]  # (B, 1, L, S)
        return memo[key]


def row_context(pools, ctx, row: int, C: int, bs: int) -> list[mx.array]:
    """One row's first C slots of each pool as mlx-lm's KVCache returns them for that row alone:
    (1, n_kv_heads, C, D) each, one slice when its blocks are a contiguous run, else one gather
    (its slot ids built once per forward)."""
    blocks = list(ctx.block_tables[row][: -(-C // bs)])
    if contiguous_run(blocks):
        s0 = blocks[0] * bs
        return [slice_slots(p, s0, s0 + C)[None] for p in pools]
    key = ("row_ids", row, C)
    if key not in ctx.memo:
        ctx.memo[key] = block_slots(mx.array([blocks], dtype=mx.int32), bs)[0, :C]
    return [take_slots(p, ctx.memo[key])[None] for p in pools]


def dense_context(cache: PagedKVCache) -> tuple[mx.array, mx.array]:
    """This forward's context of every row from a cache's pools: (B, n_kv_heads, S, D) K and V.

    One row reads exactly its C slots (one slice when its blocks are a contiguous run), as
    mlx-lm's KVCache returns them; a batch gathers every row's padded block table.
    """
    if cache.window is not None:
        raise NotImplementedError("a dense context of a sliding-window layer")
    ctx, bs = cache.ctx, cache.block_size
    # quantised pools (QuantPool): dequantised after the slice or gather
    k_pool, v_pool = cache.pools() if hasattr(cache, "pools") else (cache.k_pool, cache.v_pool)
    tables = ctx.block_tables
    lens = ctx.context_lens
    if len(lens) == 1:
        return tuple(row_context((k_pool, v_pool), ctx, 0, lens[0], bs))
    key = ("dense_tables", id(tables))
    if key not in ctx.memo:
        MB = max(-(-c // bs) for c in lens)
        padded = mx.array([list(t[:MB]) + [0] * (MB - len(t[:MB])) for t in tables], dtype=mx.int32)
        ctx.memo[key] = (padded, tables)  # tables kept alive: its id is the key
    padded = ctx.memo[key][0]
    return (take_blocks(k_pool, padded, bs, ctx.memo).transpose(1, 0, 2, 3),
            take_blocks(v_pool, padded, bs, ctx.memo).transpose(1, 0, 2, 3))


class _ShapeRecorder:
    """inspect_model's probe of an MLA layer: what it pages is what update_and_fetch gets."""

    def __init__(self, cache):
        self.cache, self.shapes = cache, None

    @property
    def offset(self):
        return self.cache.offset

    def update_and_fetch(self, keys, values):
        self.shapes = (keys.shape, values.shape, keys.dtype)
        self.keys, self.values = self.cache.update_and_fetch(keys, values)
        return self.keys, self.values


class _LatentAttention:
    """MLA attention (deepseek_v3, kimi_k25, glm4_moe_lite): the paged pools hold the compressed latent.

    mlx-lm's MLA layers already cache (kv_latent, k_pe), kv_lora_rank + qk_rope_head_dim values
    per token, and expand or absorb them in attention: so a layer pages exactly those, in one
    "KV head" (K = latent, V = rope key), and runs mlx-lm's own code over the dense context.
    """

    mask_arrays = True  # the model asks create_attention_mask(..., return_array=True)

    def __call__(self, x, mask=None, cache=None):
        return self._latent(lambda m, c: super(_LatentAttention, self).__call__(x, m, c), x, mask, cache)

    def _latent(self, call, x, mask, cache):
        """call(mask, cache) runs mlx-lm's attention."""
        if isinstance(cache, PagedKVCache):
            context = _LatentContext(cache)
            return call(context.mask(x.shape[1], self.mask_arrays), context)
        if _probing() and cache is not None:
            calls, rec = _pc.probe_calls, _ShapeRecorder(cache)
            with _unprobed():
                out = call(mask, rec)
            calls.append((cache, *rec.shapes))  # the latent's shapes, not the expanded K/V's
            return out
        return call(mask, cache)


class _SparseLatentAttention:
    """deepseek_v32's MLA with its indexer (also glm_moe_dsa's): a CacheList(latent, indexer keys).

    Both are paged like an MLA latent (the indexer's one key head in K and, as mlx-lm's
    update_and_fetch(k, k) asks, again in V), and mlx-lm's code runs on their dense context:
    its top-k over each row's own keys (padding masked) picks what it picks for the row alone.
    """

    def __call__(self, x, mask=None, cache=None):
        if cache is not None and isinstance(cache[0], PagedKVCache):
            latent = _LatentContext(cache[0])
            return super().__call__(x, latent.mask(x.shape[1]), [latent, _LatentContext(cache[1])])
        if _probing() and cache is not None:
            return _probe_list(lambda recs: super(_SparseLatentAttention, self).__call__(x, mask, recs), cache)
        return super().__call__(x, mask, cache)


def _probe_list(call, cache):
    """inspect_model's probe of a layer with a CacheList of attention caches: each reports what it pages.

    call(recorders) runs mlx-lm's attention. Values of zero width (minimax's indexer) are paged one
    column wide: a zero-size pool is an array MLX cannot gather from.
    """
    calls, recs = _pc.probe_calls, [_ShapeRecorder(c) for c in cache]
    with _unprobed():
        out = call(recs)
    for c, (k, v, dtype) in zip(cache, (r.shapes for r in recs)):
        calls.append((c, k, (*v[:-1], max(v[-1], 1)), dtype))
    return out


class _RowContext:
    """One row of a paged forward as mlx-lm's KVCache would be for that row alone: its position, its
    n real new tokens written (not the padding after them), and exactly its context back (no other
    row's padding, slots from its own position 0)."""

    def __init__(self, cache: PagedKVCache, row: int, L: int, n: int):
        self.cache, self.row, self.L, self.n = cache, row, L, n
        self.keys = self.values = None  # read (and set: mx.depends) by the model after update_and_fetch

    @property
    def offset(self) -> int:
        return int(self.cache.ctx.context_lens[self.row]) - self.L  # the row's start

    def update_and_fetch(self, keys, values):
        c, ctx, bs = self.cache, self.cache.ctx, self.cache.block_size
        if not hasattr(c, "k_pool"):  # QuantizedPagedKVCache: codes, scales and biases instead
            raise MacinferError("minimax_m3_vl: its block-sparse layers cannot use a quantised KV cache yet; "
                                "run it without --kv-bits")
        slots = ctx.write_slots(bs)  # row-major, L per row: this row's first n are its real tokens
        first = self.row * self.L
        rows = slots + first if isinstance(slots, int) else slots[first: first + self.n]
        c.k_pool = write_pool(c.k_pool, rows, head_major(keys))
        if values.shape[-1]:  # minimax's indexer writes zero-width values: its pool holds a 1-wide dummy
            c.v_pool = write_pool(c.v_pool, rows, head_major(values))
        C = self.offset + self.n
        if values.shape[-1]:
            self.keys, self.values = row_context((c.k_pool, c.v_pool), ctx, self.row, C, bs)
        else:
            (self.keys,) = row_context((c.k_pool,), ctx, self.row, C, bs)
            self.values = mx.zeros((1, values.shape[1], C, 0), values.dtype)
        return self.keys, self.values


class _MinimaxAttention:
    """minimax_m3_vl's attention. Its sparse layers pick top-k key blocks with an indexer whose
    blocks are cut over cache slots and whose queries sit at slots S - L ... S - 1: right for one
    row alone, wrong for any padded batch (mlx-lm's own BatchGenerator differs from its single
    stream for that reason). Paged, a sparse layer runs row by row, each row on its real tokens
    only and exactly its own context (`_RowContext`, for the K/V and the indexer's keys), so every
    row sees what it would alone; a row's padding positions get zeros. Dense layers page as usual.
    While probed, both caches of a sparse layer report what they page (the indexer's values are
    empty: mlx-lm writes zero-width ones)."""

    def __call__(self, x, mask=None, cache=None):
        if not self.is_sparse_attn or cache is None:
            return super().__call__(x, mask, cache)
        if isinstance(cache[0], PagedKVCache):
            return mx.concatenate([self._row(x, b, cache) for b in range(x.shape[0])])
        if _probing():
            return _probe_list(lambda recs: super(_MinimaxAttention, self).__call__(x, mask, recs), cache)
        return super().__call__(x, mask, cache)

    def _row(self, x, b: int, cache) -> mx.array:
        """Row b of a paged forward, alone: (1, L, D), zeros after its real tokens."""
        L = x.shape[1]
        counts = cache[0].ctx.counts
        n = counts[b] if counts else L
        out = super().__call__(x[b: b + 1, :n], None if n == 1 else "causal",
                               [_RowContext(cache[0], b, L, n), _RowContext(cache[1], b, L, n)])
        return out if n == L else mx.concatenate([out, mx.zeros((1, L - n, out.shape[-1]), out.dtype)], axis=1)


class _Mistral4Attention(_LatentAttention):
    """mistral4's MLA: the same latent cache; a llama-4 query scale argument, no mask arrays asked."""

    mask_arrays = False

    def __call__(self, x, attn_scale, mask=None, cache=None):
        return self._latent(lambda m, c: super(_LatentAttention, self).__call__(x, attn_scale, m, c), x, mask, cache)


class _GPTBigCodeModel:
    """GPTBigCodeModel with one position per row when the offsets are a (B,) array (a batched forward).

    mlx-lm builds the learned position ids as np.arange(cache[0].offset, cache[0].offset + L),
    which needs an int; with per-row offsets this body does the same with row positions
    offsets[:, None] + arange(L) (the layers themselves never read the offset: no rope).
    """

    def __call__(self, inputs, cache=None):
        offsets = cache[0].offset if cache is not None else 0
        if not (isinstance(offsets, mx.array) and offsets.ndim == 1):
            return super().__call__(inputs, cache)
        from mlx_lm.models.base import create_attention_mask

        B, L = inputs.shape
        hidden_states = self.wte(inputs)
        mask = create_attention_mask(hidden_states, cache[0])
        hidden_states += self.wpe(offsets[:, None] + mx.arange(L))  # (B, L) positions
        for layer, c in zip(self.h, cache):
            hidden_states = layer(hidden_states, mask, cache=c)
        return self.ln_f(hidden_states)


class _Llama4Model:
    """llama4's LlamaModel on paged caches: every layer's mask comes from its own cache.

    mlx-lm trims each ChunkedKVCache to its last chunk_size keys (maybe_trim_front) and builds
    one chunk mask array from cache[0].start_position and an int offset. On paged caches a
    chunked layer's cache knows its chunk (LayerSpec.chunk) and masks it in paged attention:
    a query at p sees keys p // chunk * chunk .. p, exactly what mlx-lm's mask leaves visible
    (its trimmed cache always still holds that chunk). Global layers get the causal mask.
    """

    def __call__(self, inputs, cache=None):
        if cache is None or not isinstance(cache[0], (PagedKVCache, _OffsetsProbeCache)):
            return super().__call__(inputs, cache)  # mlx-lm's own caches
        h = self.embed_tokens(inputs)
        for layer, c in zip(self.layers, cache):
            h = layer(h, c.make_mask(h.shape[1]), cache=c)
        return self.norm(h)


class _Llama4Attention:
    """llama4's Attention with one offset per row in its NoPE layers' query scaling.

    mlx-lm's attention temperature tuning scales the queries of the layers without rope by
    log(floor(position / floor_scale) + 1) * attn_scale + 1, positions from
    mx.arange(offset + 1, offset + L + 1): that needs an int offset. A batched forward has a (B,)
    array, so those layers compute the same scales per row here; everything else is mlx-lm's.
    """

    def __call__(self, x, mask=None, cache=None):
        offset = cache.offset if cache is not None else 0
        if self.use_rope or not self.attn_temperature_tuning or not (isinstance(offset, mx.array) and offset.ndim == 1):
            return super().__call__(x, mask, cache)
        B, L, _ = x.shape
        queries, keys, values = _project(self, x)
        positions = offset[:, None] + mx.arange(1, L + 1)  # (B, L) int32, as mlx-lm's arange per row
        scales = mx.log(mx.floor(positions / self.floor_scale) + 1.0) * self.attn_scale + 1.0
        queries = (queries * scales[:, None, :, None]).astype(queries.dtype)  # (B, 1, L, 1) over the heads
        keys, values = cache.update_and_fetch(keys, values)
        out = _pc.paged_sdpa(queries, keys, values, cache, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


# mlx-lm module -> {attention class name: mixin}
_VARIANTS = {
    "mlx_lm.models.gemma2": {"Attention": _Gemma2Attention},
    "mlx_lm.models.gemma3n": {"Gemma3nAttention": _Gemma3nAttention},
    "mlx_lm.models.plamo2": {"Attention": _Plamo2Attention},
    "mlx_lm.models.afm7": {"AFMModel": _AFMModel, "KVReuseAttention": _AFMKVReuseAttention},
    "mlx_lm.models.iquestloopcoder": {"IQuestLoopCoderModel": _LoopCoderModel},
    "mlx_lm.models.minimax_m3_vl": {"Attention": _MinimaxAttention},
    "mlx_lm.models.gemma4_text": {"Attention": _Gemma4Attention},
    "mlx_lm.models.deepseek_v3": {"DeepseekV3Attention": _LatentAttention},
    "mlx_lm.models.glm4_moe_lite": {"Glm4MoeLiteAttention": _LatentAttention},
    "mlx_lm.models.bailing_hybrid": {"MultiLatentAttention": _LatentAttention},
    "mlx_lm.models.bailing_moe_v3": {"BailingMLA": _LatentAttention},
    "mlx_lm.models.kimi_linear": {"KimiMLAAttention": _LatentAttention},
    "mlx_lm.models.deepseek_v32": {"DeepseekV32Attention": _SparseLatentAttention},
    "mlx_lm.models.longcat_flash": {"LongcatFlashMLA": _LatentAttention},  # two per layer: a CacheList
    "mlx_lm.models.mistral4": {"Mistral4Attention": _Mistral4Attention},
    "mlx_lm.models.gpt_bigcode": {"GPTBigCodeModel": _GPTBigCodeModel},  # not attention: positions
    "mlx_lm.models.llama4": {"LlamaModel": _Llama4Model, "Attention": _Llama4Attention},  # chunk masks
}
# Modules whose models ask create_attention_mask for an array that only our subclass consumes.
_MASK_MODULES = ("mlx_lm.models.gemma2", "mlx_lm.models.deepseek_v3", "mlx_lm.models.glm4_moe_lite",
                 "mlx_lm.models.bailing_hybrid", "mlx_lm.models.bailing_moe_v3", "mlx_lm.models.kimi_linear",
                 "mlx_lm.models.deepseek_v32", "mlx_lm.models.longcat_flash",
                 "mlx_lm.models.longcat_flash_ngram")
_subclasses: dict[type, type] = {}


def _retype(module: nn.Module, mixin: type) -> None:
    cls = type(module)
    if issubclass(cls, mixin):
        return
    if cls not in _subclasses:
        _subclasses[cls] = type(f"Paged{cls.__name__}", (mixin, cls), {"__module__": __name__})
    module.__class__ = _subclasses[cls]


def _paged_mask_dispatch(original):
    def create_attention_mask(h, cache=None, window_size=None, return_array=False):
        if isinstance(cache, PagedKVCache):  # our attention builds the mask from the block tables
            return cache.make_mask(h.shape[1], window_size=window_size)
        return original(h, cache, window_size=window_size, return_array=return_array)

    create_attention_mask.paged_original = original
    return create_attention_mask


def install_attention_variants(model: nn.Module) -> int:
    """Retype the attention modules of the families above (idempotent).

    Returns:
        How many modules now take a family-specific paged path.
    """
    families = []
    for _, m in model.named_modules():
        for cls in type(m).__mro__:  # a retyped module finds mlx-lm's class one step up
            mixin = _VARIANTS.get(cls.__module__, {}).get(cls.__name__)
            if mixin is not None:
                _retype(m, mixin)
                families.append(cls.__module__)
                break
    # Also a model body in a module of its own (longcat_flash_ngram's, over longcat_flash's layers).
    bodies = {type(m).__module__ for _, m in model.named_modules()} if families else set()
    for name in (set(families) | bodies) & set(_MASK_MODULES):
        mod = sys.modules[name]
        if not hasattr(mod.create_attention_mask, "paged_original"):
            mod.create_attention_mask = _paged_mask_dispatch(mod.create_attention_mask)
    return len(families)


# -- can the model take one rope offset per row? -----------------------------------------------------


class _OffsetsProbeCache:
    """A stand-in cache whose offset is a (B,) array, as in a batched engine forward."""

    def __init__(self, offsets: mx.array, window=None):
        self.offset, self.window = offsets, window
        self.keys = self.values = None

    def update_and_fetch(self, keys, values):
        self.keys, self.values = keys, values
        return keys, values

    def keys_and_values(self):
        return self.keys, self.values

    def make_mask(self, N, return_array=False, window_size=None):
        return None if N == 1 else "causal"


def batched_offsets_work(model: nn.Module) -> bool:
    """Whether a forward over two rows at different positions builds (lazily: nothing is computed).

    A model that turns cache.offset into a Python int (gpt_bigcode's position ids) raises
    here; the engine then gives each row its own forward.
    """
    from mlx_lm.models.cache import ArraysCache, CacheList, make_prompt_cache

    def probe(c):  # recurrent-state layers keep their own (empty) cache: only attention reads offsets
        if isinstance(c, ArraysCache):
            return c
        if isinstance(c, CacheList):
            return CacheList(*(probe(x) for x in c.caches))
        return _OffsetsProbeCache(mx.array([3, 5], dtype=mx.int32))

    try:
        caches = [probe(c) for c in make_prompt_cache(model)]
        with _unprobed():
            model(mx.array([[1], [2]]), cache=caches)
    except Exception:  # noqa: BLE001 - whatever breaks, one row per forward is safe
        return False
    return True
