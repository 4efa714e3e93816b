"""8-bit (or 4-bit) K/V in the paged pool: a drop-in PagedKVCache variant.

Each token's K (and V) row of one head is quantised on write with MLX's affine
quantisation along head_dim (`mx.quantize`, group 32 by default: with 64, SmolLM2's
near-tied top logits already flip on a 37-token prompt, with 32 they do not): a
block then holds packed uint32 codes plus one scale and bias per group.

    float pool   [H, num_blocks * bs, D]            D x 4 bytes per head (float32)
    8-bit pool   [H, num_blocks * bs, D/4] uint32   D bytes (8-bit)
               + scales, biases [H, num_blocks * bs, D/g]

(head-major slots, slot = block * bs + offset, like the float pool: macinfer.kv.paged_attention)

Attention reads the pools as `QuantPool`s: the reference path gathers the codes,
scales and biases of the slots it reads and dequantises them (gather + dequantise
+ SDPA, the same `paged_attention` as the float path, so batching, prefix sharing
and windows work unchanged); the fused Metal kernel dequantises each key and value
as it reads it (macinfer.kv.metal_attention), with no float copy of the pool. Quantisation is per token row, so a token's
stored K/V never depends on what else is in the batch: batched output equals
solo output exactly, at this KV precision. (mlx-lm cannot batch with its
quantised KV cache at all.)
"""

from __future__ import annotations

import mlx.core as mx

from macinfer.errors import MacinferError
from macinfer.kv.paged_attention import QuantPool
from macinfer.kv.paged_cache import ForwardContext, LayerSpec, PagedKVCache, PagedMask, head_major, prompt_window, write_pool

SUPPORTED_BITS = (4, 8)


def kv_group_size(head_dim: int, requested: int | None = None) -> int:
    """The quantisation group along head_dim: requested, else 32 (see module docstring)."""
    g = requested or 32
    if g not in (32, 64, 128) or head_dim % g:
        raise MacinferError(
            f"cannot quantise the KV cache with group size {g} for head_dim {head_dim}: "
            "MLX needs a group of 32, 64 or 128 that divides head_dim"
        )
    return g


def quantized_bytes_per_token(spec: LayerSpec, bits: int, group_size: int | None = None) -> int:
    """Bytes one token's K and V take in a quantised pool (codes + scales + biases)."""
    total = 0
    for d in (spec.k_head_dim, spec.v_head_dim):
        g = kv_group_size(d, group_size)
        total += spec.n_kv_heads * (d * bits // 8 + 2 * (d // g) * spec.dtype.size)
    return total


class QuantizedPagedKVCache(PagedKVCache):
    """PagedKVCache whose pools hold quantised K/V (see module docstring)."""

    def __init__(self, ctx: ForwardContext, spec: LayerSpec, num_blocks: int, block_size: int,
                 bits: int = 8, group_size: int | None = None):
        if bits not in SUPPORTED_BITS:
            raise MacinferError(f"KV cache bits must be one of {SUPPORTED_BITS}, got {bits}")
        self.ctx = ctx
        self.window, self.chunk = spec.window, spec.chunk
        self.block_size = block_size
        self.kv_bits = bits
        self.dtype = spec.dtype
        self.kg = kv_group_size(spec.k_head_dim, group_size)
        self.vg = kv_group_size(spec.v_head_dim, group_size)

        def pool(d, g):  # [H, num_blocks * bs, ...] codes, scales, biases
            shape = (spec.n_kv_heads, num_blocks * block_size)
            return [mx.zeros((*shape, d * bits // 32), dtype=mx.uint32),
                    mx.zeros((*shape, d // g), dtype=spec.dtype), mx.zeros((*shape, d // g), dtype=spec.dtype)]

        self.k_q = pool(spec.k_head_dim, self.kg)
        self.v_q = pool(spec.v_head_dim, self.vg)

    # NOTE: not named `bits`-style attributes mlx-lm looks for on the cache object
    # (`bits` routes mlx-lm to its own quantised attention); ours is `self.kv_bits` but
    # attention is always dispatched to `self.attention` by the patched sdpa first.

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        slots = self.ctx.write_slots(self.block_size)
        for pools, x, g in ((self.k_q, keys, self.kg), (self.v_q, values, self.vg)):
            rows = head_major(x)  # (H, T, D)
            pools[:] = [write_pool(pool, slots, part)
                        for pool, part in zip(pools, mx.quantize(rows, group_size=g, bits=self.kv_bits))]
        return keys, values

    def pools(self) -> tuple[QuantPool, QuantPool]:
        """The K and V pools as attention reads them (dequantised per key, after the gather)."""
        return QuantPool(*self.k_q, self.kv_bits, self.kg), QuantPool(*self.v_q, self.kv_bits, self.vg)

    def attention(self, queries: mx.array, mask, scale: float, sinks=None, softcap=None) -> mx.array:
        if not (mask is None or isinstance(mask, (PagedMask, str))):
            raise MacinferError("this model builds its own attention mask; paged attention cannot honour it")
        k, v = self.pools()
        return self.ctx.attend(queries, k, v, self.ctx.block_tables, block_size=self.block_size, scale=scale,
                               window=self.window, sinks=sinks, memo=self.ctx.memo, softcap=softcap, chunk=self.chunk,
                               prompt_window=prompt_window(mask))

    @property
    def state(self):
        return [*self.k_q, *self.v_q]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.state)
