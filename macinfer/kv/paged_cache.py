"""The adapter that lets mlx-lm's model classes run on the paged KV cache.

mlx-lm attention does, per layer (docs/platform.md):

    q, k = rope(q, offset=cache.offset), rope(k, offset=cache.offset)
    k, v = cache.update_and_fetch(k, v)
    out  = scaled_dot_product_attention(q, k, v, cache=cache, scale=..., mask=mask)

with `mask = create_attention_mask(h, cache[i], window_size=...)`, which asks the
cache's `make_mask`. So one `PagedKVCache` per layer is enough:

- `offset` is the position of each row's first new token: an int for one row,
  an int32 (B,) array for a decode batch (mx.fast.rope takes per-row offsets).
- `update_and_fetch` writes the new K/V into the layer's pools at this step's
  slots (one slice update for a single row, else a scatter) and returns them
  unchanged (nothing downstream reads them but us).
- `make_mask` returns a `PagedMask` marker: the real mask depends on the block
  tables and is built inside `paged_attention`.
- `scaled_dot_product_attention` is replaced *in the model's own module* by a
  dispatcher that sends paged caches to `paged_attention` and everything else
  to mlx-lm's original (so mlx-lm keeps working in the same process).

What cannot be paged is refused up front (`inspect_model`), never run wrong:
layers whose mlx-lm cache is not a plain KVCache, a RotatingKVCache or a
ChunkedKVCache (recurrent ArraysCache layers get state slots instead, see
macinfer.kv.state_cache), and models that compute attention without going through
`scaled_dot_product_attention`, except the families `macinfer.kv.attention_variants`
routes itself (gemma2's soft-capping, gemma3n/gemma4 KV sharing, MLA's latent). Sliding
window layers are learnt from mlx-lm's own `make_cache` (RotatingKVCache max_size),
chunked ones (llama4's local attention) from its ChunkedKVCache chunk_size, and both
are masked in attention; their pools hold every token (simple, correct; freeing
blocks that slid out of the window is future work).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from macinfer.errors import MacinferError
from macinfer.kv.metal_attention import padded_tables
from macinfer.kv.paged_attention import contiguous_run, paged_attention, reads_one_slice


@dataclass
class PagedMask:
    """What make_mask hands the model: which window the model asked for."""

    window: int | None = None
    prompt: bool = False  # window is a prompt window, one past the cache's (plamo3)


KERNEL_MAX_Q_LEN = 8  # decode and verify rows (1 + drafts) only; MLX's own sdpa_vector limit
_POSITIONAL = ("queries", "k_pool", "v_pool", "block_tables", "context_lens")


@dataclass
class ForwardContext:
    """Per-forward metadata shared by every layer's cache (set by the model runner).

    For a forward over B rows of q_len new tokens each (T = B * q_len):
        offsets        int, or int32 (B,): position of each row's first new token
        block_tables   B lists of block ids
        context_lens   B ints: tokens in context after this step
        slot_ids       int32 (T,): pool slot of each new token, row-major (block * block_size + offset)
        prompt_lens    B ints: each row's prompt length (a prompt window needs it), or None
        counts         B ints: each row's real new tokens (the rest of q_len is padding), or None
    """

    offsets: int | mx.array = 0
    block_tables: list[list[int]] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    slot_ids: mx.array | None = None
    prompt_lens: list[int] | None = None
    counts: list[int] | None = None
    memo: dict = field(default_factory=dict)  # paged_attention's per-forward arrays
    # The fused Metal kernel when the engine selected it (macinfer.kv.kernel_dispatch); None: reference.
    attention_fn: object = None

    def attend(self, queries, k_pool, v_pool, block_tables, *, block_size, scale, window, sinks, memo,
               softcap=None, chunk=None, prompt_window=None) -> mx.array:
        """Attention over pages with the selected backend (one place for every cache type).

        k_pool, v_pool: float pools or `QuantPool`s (8-bit KV), which both paths read as they are.
        """
        args = dict(queries=queries, k_pool=k_pool, v_pool=v_pool, block_tables=block_tables,
                    context_lens=self.context_lens, block_size=block_size, scale=scale, window=window, sinks=sinks)
        # Logit soft-capping (attention_variants) and chunked attention (llama4), passed only when set.
        args.update({k: x for k, x in (("softcap", softcap), ("chunk", chunk)) if x is not None})
        if prompt_window is not None:  # two windows by position (plamo3): the reference path's alone
            return paged_attention(**args, memo=memo, prompt_window=prompt_window, prompt_lens=self.prompt_lens)
        fn = self.attention_fn
        if fn is not None and self._kernel_may_run(fn, queries.shape[2], block_tables, block_size, window, chunk,
                                                   memo):
            # The padded int32 tables once per forward, not per layer (1.5 ms a layer at 64 rows x 256 blocks).
            key = ("kernel_tables", block_size)
            if key not in memo:
                memo[key] = padded_tables(block_tables, self.context_lens, block_size)
            use = getattr(fn, "use_kernel", None)  # KernelDispatch: checked and chosen per shape class
            if use is None or use(args, memo[key]):
                return fn(queries, k_pool, v_pool, memo[key], self.context_lens,
                          **{k: v for k, v in args.items() if k not in _POSITIONAL})
        return paged_attention(**args, memo=memo)

    def _kernel_may_run(self, fn, q_len: int, block_tables, block_size: int, window, chunk, memo: dict) -> bool:
        # The fused kernel is a decode kernel (a threadgroup per query row re-reads all K/V): prefill
        # chunks go to MLX's SDPA on the gathered K/V, as MLX sends q_len > 8 to its tiled kernel.
        if q_len > KERNEL_MAX_Q_LEN:
            return False
        # One row whose blocks are a contiguous run: one slice into MLX's SDPA, no copy (mlx-lm's path,
        # with two-pass splitting on large chips); the kernel has no KV split. Worked out once per forward.
        if not getattr(fn, "prefers_slice", False):
            return True
        key = ("one_slice", block_size, window, chunk)
        if key not in memo:
            memo[key] = reads_one_slice(block_tables, self.context_lens, q_len, block_size, window, chunk)
        return not memo[key]

    def write_slots(self, block_size: int) -> int | mx.array:
        """Where this forward's T new tokens go in a pool: a first slot, or int32 (T,) slot ids.

        A single row whose new tokens fall in a contiguous run of blocks (every decode
        step but one in block_size, and most prefills) gets its first slot: the write is
        then one slice update. Otherwise the slot ids, slot = block * block_size + offset.
        Worked out once per forward (memo) and shared by every layer.
        """
        key = ("write_slots", block_size)
        if key not in self.memo:
            self.memo[key] = self._write_slots(block_size)
        return self.memo[key]

    def _write_slots(self, bs: int) -> int | mx.array:
        if isinstance(self.offsets, int) and len(self.block_tables) == 1:
            start, table = self.offsets, self.block_tables[0]
            end = self.context_lens[0]  # one past the last new token
            blocks = table[start // bs: -(-end // bs)]
            if contiguous_run(blocks):
                return blocks[0] * bs + start % bs
        return self.slot_ids


def head_major(x: mx.array) -> mx.array:
    """(B, H, L, D) K or V -> (H, B * L, D): each head's new tokens in row order, as a pool's slots hold them.

    One row (B = 1) needs no copy at all; a decode batch (L = 1) only swaps two axes.
    """
    B, H, L, D = x.shape
    if B == 1:
        return x[0]
    return x.reshape(B, H, D).transpose(1, 0, 2) if L == 1 else x.transpose(1, 0, 2, 3).reshape(H, B * L, D)


def write_pool(pool: mx.array, slots: int | mx.array, x: mx.array) -> mx.array:
    """The pool (H, num_slots, W) with x (H, T, W) written at `slots` (ForwardContext.write_slots).

    NOTE: in place (a slice update or a scatter into the pool's buffer) as long as nothing else
    holds the previous pool array when it runs: the caller replaces its reference with the result.
    Slot ids scatter along the slot axis (put_along_axis): 3 graph ops, where `pool[:, ids] = x`
    builds 9 (an arange and casts for the head axis), and each op costs dispatch time on the CPU.
    """
    if isinstance(slots, int):
        pool[:, slots: slots + x.shape[1]] = x
        return pool
    return mx.put_along_axis(pool, mx.broadcast_to(slots[None, :, None], x.shape), x, axis=1)


@dataclass
class LayerSpec:
    """What the probe learnt about one attention layer."""

    n_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    window: int | None
    dtype: mx.Dtype
    chunk: int | None = None  # chunked local attention (llama4): a query sees its own chunk only

    def bytes_per_token(self) -> int:
        return self.n_kv_heads * (self.k_head_dim + self.v_head_dim) * self.dtype.size


_current_ctx: ForwardContext | None = None


def current_forward() -> ForwardContext | None:
    """The ForwardContext of the paged cache whose offset was read last (macinfer.kv.rope)."""
    return _current_ctx


class PagedKVCache:
    """One layer's view of the paged KV cache, speaking mlx-lm's cache protocol."""

    def __init__(self, ctx: ForwardContext, spec: LayerSpec, num_blocks: int, block_size: int):
        self.ctx = ctx
        self.window, self.chunk = spec.window, spec.chunk
        self.block_size = block_size
        # (n_kv_heads, num_blocks * block_size, head_dim), head-major slots: see paged_attention for why.
        self.k_pool = mx.zeros((spec.n_kv_heads, num_blocks * block_size, spec.k_head_dim), dtype=spec.dtype)
        self.v_pool = mx.zeros((spec.n_kv_heads, num_blocks * block_size, spec.v_head_dim), dtype=spec.dtype)

    @property
    def offset(self):
        # mlx-lm reads this right before each rope call: tell SharedRoPE whose forward it is.
        global _current_ctx
        _current_ctx = self.ctx
        return self.ctx.offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        slots = self.ctx.write_slots(self.block_size)
        self.k_pool = write_pool(self.k_pool, slots, head_major(keys))
        self.v_pool = write_pool(self.v_pool, slots, head_major(values))
        return keys, values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if return_array:
            raise MacinferError("this model needs an explicit attention mask array, which paged attention cannot provide")
        if self.window is not None and window_size == self.window + 1:
            return PagedMask(window_size, prompt=True)  # plamo3 (paged_attention, `prompt_window`)
        if window_size is not None and window_size != self.window:
            raise MacinferError(
                f"the model asks for a {window_size}-token attention window where its cache says "
                f"{self.window}: cannot page it safely"
            )
        return PagedMask(window_size)

    def attention(self, queries: mx.array, mask, scale: float, sinks=None, softcap=None) -> mx.array:
        if not (mask is None or isinstance(mask, (PagedMask, str))):
            raise MacinferError("this model builds its own attention mask; paged attention cannot honour it")
        return self.ctx.attend(queries, self.k_pool, self.v_pool, self.ctx.block_tables,
                               block_size=self.block_size, scale=scale, window=self.window, sinks=sinks,
                               memo=self.ctx.memo, softcap=softcap, chunk=self.chunk, prompt_window=prompt_window(mask))

    # -- the rest of mlx-lm's protocol --------------------------------------------------
    @property
    def keys(self):
        return self.k_pool

    @keys.setter
    def keys(self, value):
        # mlx-lm's pipelined models chain a stage's send onto its last cache (`cache.keys =
        # mx.depends(cache.keys, h)`) so that evaluating the cache sends; across ranks every rank
        # evaluates its logits instead (macinfer.engine.distributed), so the link is dropped.
        pass

    @property
    def state(self):
        return [self.k_pool, self.v_pool]

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return self.k_pool.nbytes + self.v_pool.nbytes


def prompt_window(mask) -> int | None:
    """The wider window a model asked for its prompt's queries (PagedMask.window past the cache's), or None."""
    return mask.window if isinstance(mask, PagedMask) and mask.window is not None and mask.prompt else None


# -- the attention dispatch (installed by macinfer.kv.model_probe) ---------------------------
# While inspect_model probes a model, every non-paged attention call is recorded here.
probe_calls: list | None = None


def paged_sdpa(queries, keys, values, cache, scale, mask, sinks=None):
    if isinstance(cache, PagedKVCache):
        return cache.attention(queries, mask, scale, sinks)
    if probe_calls is not None:
        probe_calls.append((cache, keys.shape, values.shape, keys.dtype))
    from mlx_lm.models.base import scaled_dot_product_attention

    return scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
