"""Fused paged decode attention as a Metal kernel, and its executable reference.

The reference path (`macinfer.kv.paged_attention`) gathers each sequence's slots into
a contiguous K/V buffer and calls MLX's fused SDPA: at long contexts that copy
costs an extra read and write of the KV cache per step. The kernel here reads
K/V straight from the block pool instead and keeps an online softmax, so there
is no gathered copy and no n x n score matrix. It is built like MLX's own
`sdpa_vector` kernels (mlx/backend/metal/kernels/sdpa_vector.h) and vllm-metal's v2:

- grouped-query aware: one threadgroup serves one (sequence, KV head) and *all* the
  R = G * q_len query rows that read it (G = n_heads / n_kv_heads), so each K/V
  block is read from device memory once per KV head, not once per query head;
- split-K: a long context is cut into S splits of PB blocks, one threadgroup each
  (pass 1), whose partial softmax states a second kernel reduces (pass 2), as
  MLX's `sdpa_vector_2pass`; a short one runs in one pass (S = 1);
- vector loads: the threadgroup stages a tile of TK tokens of K and V in threadgroup
  memory with 4-element vector loads (16 bytes in float32; a quantised pool's codes
  as uint4), dequantised to float once for all its rows;
- simdgroup reductions: a lane holds dims d = i * 32 + lane; a score is one
  `simd_sum`, pass 2 reduces with `simd_max` / `simd_sum`.

Algorithm (B rows, H query heads, KVH KV heads, q_len = QL, head_dim = D, BS = block_size):

    query qi of a row with context length C sits at p = C - QL + qi and sees keys
    lo..p, lo = first_key(p) = max(0, p - window + 1) (0 without a window), raised to
    p // chunk * chunk for chunked attention (llama4).

    threadgroup (b, kvh, s):  rows r = 0 .. R-1,  h = kvh * G + r // QL,  qi = r % QL
      its rows see keys within [lo0, C - 1], lo0 = first_key(C - QL) (the first query's)
      its blocks: j0 = lo0 // BS + s * PB  ..  j1 = min(j0 + PB, (C - 1) // BS + 1)

        table index j:   lo0//BS ......... +PB ......... +2PB ...... (C-1)//BS
        split:           |------ s = 0 -----|---- s = 1 ---|-- s = 2 --|      (empty splits: m = MASKED)

    block-table index arithmetic (NS = num_blocks * BS slots per head; pools are head-major,
    see macinfer.kv.paged_attention):

      logical position pos = j * BS + t          block_tables[b] = [ 7, 2, 9, 0, 0 ]
      phys = block_tables[b, j]                                      |  |  |  padding (null block 0),
      slot = phys * BS + t                                           v  v  v  never read
      K of (pos, kvh, d) = k_pool_flat[(kvh * NS + slot) * D + d]    slots [7BS, 8BS), [2BS, 3BS), ...

    so a tile of TK tokens of one head is TK * D contiguous values: the threadgroup loads it
    with vectors, only the tokens in [lo0, C - 1] (a stale or NaN slot is never read).

    per tile, each row r (simdgroup r % NSG) updates its online softmax (m, l, acc):

      s      = scale * K_tile @ q_r         (slots outside [lo_r, p_r]: MASKED, their V unread)
      s      = tanh(s / cap) * cap          (logit soft-capping, Gemma 2; only if cap > 0)
      m_new  = max(m, max(s));  corr = exp(m - m_new)
      l      = l * corr + sum(exp(s - m_new));  acc = acc * corr + exp(s - m_new) @ V_tile;  m = m_new

    and the S partial states of a row are merged with its sink (a per-head logit with no
    value; none: MASKED):

      M = max(max_s m_s, sink);  w_s = exp(m_s - M)
      out = sum_s w_s acc_s / (sum_s w_s l_s + exp(sink - M))

`paged_attention_online` runs that algorithm in NumPy, loop for loop, so it is tested on
machines without Metal; `PASS1_SOURCE` and `REDUCE_SOURCE` (macinfer.kv.metal_source) are its
transliteration (the [1]..[6] step tags match). Only Metal can compile and run the kernel for real, so
macinfer.kv.kernel_dispatch checks every pipeline the engine can dispatch against the
reference path at start-up. (The tests also compile the source MLX generates from these
as C++ against a shim of the Metal built-ins and run it in a small SIMT emulator that
counts the K/V bytes read: a check of the source's logic, not of the Metal compiler.)

NOTE: masked slots use a finite sentinel (-1e30), not -inf, so the kernel is correct
under Metal's fast-math mode too; and masked slots never touch V.
NOTE: MLX passes an input of fewer than 8 elements in `constant` memory and names the
kernel by it (mlx/backend/common/metal_kernel.cpp), so an input whose size follows the
batch would compile a second variant: tables, lengths and sinks are padded to 8 or more
elements, the scalar parameters always have fewer. A pipeline is then fixed by its
template arguments alone (`LaunchPlan.pipeline`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from macinfer.kv.metal_source import (HEADER, INPUT_NAMES, PASS1_SOURCE, QUANT_INPUT_NAMES, QUANT_PASS1_SOURCE,
                                      REDUCE_INPUT_NAMES, REDUCE_SOURCE)
from macinfer.kv.paged_attention import QuantPool

SIMD_WIDTH = 32  # threads per simdgroup on every Apple GPU
MASKED = -1.0e30  # score of a slot a query must not see
SUPPORTED_DTYPES = (mx.float32, mx.float16, mx.bfloat16)  # self-check order: tightest first
# Self-check tolerance (atol = rtol) per dtype. Index bugs are dtype-independent,
# so the tight float32 cases catch them; half types only need to round the same.
TOLERANCE = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 5e-2}

# Signature shared by the reference path and the kernel path:
# fn(queries, k_pool, v_pool, block_tables, context_lens, *, block_size, scale, window=None, sinks=None)
# (plus softcap=cap when a model soft-caps its attention logits: macinfer.kv.attention_variants,
# and chunk=size for chunked local attention: llama4)
AttentionFn = Callable[..., mx.array]

MAX_SIMDGROUPS = 8  # 256 threads at most, as vllm-metal (see LaunchPlan)
MAX_ROWS = 32  # query rows per KV head (G * q_len) the kernel serves, as MLX's sdpa_vector
ROWS_PER_SIMDGROUP = (1, 2, 4)  # the RPS template values: MAX_ROWS / MAX_SIMDGROUPS at most
TILE_ELEMS = 2048  # TK * D: K and V tiles as float take 16 KB of the 32 KB of threadgroup memory
MIN_SPLIT_TOKENS = 256  # a split reads at least this many keys (MLX's 2-pass: 32-1024 splits)
TARGET_THREADGROUPS = 128  # pass 1 splits until B * KVH * S reaches this (fills an M-series GPU)
CONSTANT_LIMIT = 8  # MLX: inputs with fewer elements go to `constant` memory


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _np32(x) -> np.ndarray:
    if isinstance(x, mx.array):
        x = x.astype(mx.float32)
    return np.asarray(x, dtype=np.float32)


def first_key(p: int, window: int | None, chunk: int | None) -> int:
    """The first key position a query at p sees (the kernel's `first_key`)."""
    lo = max(0, p - window + 1) if window else 0
    return max(lo, p // chunk * chunk) if chunk else lo


def tile_tokens(head_dim: int, block_size: int) -> int:
    """TK: tokens staged per tile, a power of two dividing block_size with TK * head_dim <= TILE_ELEMS."""
    tk = 1
    while tk * 2 <= block_size and block_size % (tk * 2) == 0 and tk * 2 * head_dim <= TILE_ELEMS:
        tk *= 2
    return tk


@dataclass(frozen=True)
class LaunchPlan:
    """How one call is launched: what it compiles (`pipeline`) and its grid.

    rows (R = G * q_len) go to simdgroups: NSG = min(pow2(R), max_simdgroups), each holding
    RPS = pow2(ceil(R / NSG)) rows in registers. NSG is the threadgroup size, a launch
    parameter; RPS, TK and whether the context is split are template parameters.
    """

    rows: int  # R
    simdgroups: int  # NSG
    rows_per_simdgroup: int  # RPS
    tile: int  # TK
    splits: int  # S
    blocks_per_split: int  # PB

    @property
    def split(self) -> bool:
        return self.splits > 1


def span_blocks(table_width: int, q_len: int, block_size: int, window: int | None, chunk: int | None) -> int:
    """The most blocks any row's queries read together: the table, or what a window or chunk spans."""
    span = table_width
    for w in (window, chunk):
        if w:
            span = min(span, -(-(w + q_len - 1) // block_size) + 1)
    return max(span, 1)


def launch_plan(B: int, H: int, q_len: int, KVH: int, head_dim: int, block_size: int, table_width: int, *,
                window: int | None = None, chunk: int | None = None, max_simdgroups: int = MAX_SIMDGROUPS,
                splits: int | None = None) -> LaunchPlan:
    """The plan of one call (splits: force S, as tests do; default: enough threadgroups to fill the
    GPU, each split reading at least MIN_SPLIT_TOKENS keys)."""
    R = H // KVH * q_len
    nsg = min(_pow2(R), max_simdgroups)
    rps = _pow2(-(-R // nsg))
    span = span_blocks(table_width, q_len, block_size, window, chunk)
    if splits is None:
        most = max(1, span * block_size // MIN_SPLIT_TOKENS)
        splits = min(most, max(1, -(-TARGET_THREADGROUPS // (B * KVH))))
    pb = -(-span // max(1, min(splits, span)))
    return LaunchPlan(R, nsg, rps, tile_tokens(head_dim, block_size), -(-span // pb), pb)


def context_blocks(context_lens, block_size: int) -> int:
    """Blocks the longest row's context covers: what `launch_plan` splits (not the padded table width)."""
    return max((-(-int(c) // block_size) for c in np.asarray(context_lens).reshape(-1)), default=1)


def padded_tables(block_tables, context_lens, block_size: int) -> mx.array:
    """Block tables as int32 (B, W), padded with the null block 0 to cover every row's context,
    and to at least CONSTANT_LIMIT entries in all (module NOTE).

    NOTE: W covers ceil(context_len / block_size) for every row, not just the longest table:
    a row right-padded in a batch (a short prefill chunk beside a longer one) counts its
    padding in context_lens, so its table can be shorter than its context. The kernel reads
    entry pos // BS for every position up to context_len - 1.
    """
    lens = [int(c) for c in np.asarray(context_lens).reshape(-1)]
    B = max(len(lens), 1)
    need = max(max((-(-c // block_size) for c in lens), default=0), -(-CONSTANT_LIMIT // B))
    if isinstance(block_tables, mx.array):
        t = block_tables.astype(mx.int32)
        return t if t.shape[1] >= need else mx.pad(t, [(0, 0), (0, need - t.shape[1])])
    width = max(max(len(t) for t in block_tables), need)
    return mx.array([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=mx.int32)


def padded_lens(context_lens) -> mx.array:
    """int32 context lengths, zero-padded to at least CONSTANT_LIMIT entries (module NOTE)."""
    lens = [int(c) for c in np.asarray(context_lens).reshape(-1)]
    return mx.array(lens + [0] * (CONSTANT_LIMIT - len(lens)), dtype=mx.int32)


def padded_sinks(sinks, n_heads: int) -> mx.array:
    """float32 per-head sinks (MASKED without), padded to at least CONSTANT_LIMIT entries (module NOTE)."""
    n = max(n_heads, CONSTANT_LIMIT)
    if sinks is None:
        return mx.full((n,), MASKED, mx.float32)
    s = sinks.astype(mx.float32)
    return s if n == n_heads else mx.concatenate([s, mx.full((n - n_heads,), MASKED, mx.float32)])


def np_dequantize(pool: QuantPool, kvh: int, slots: np.ndarray) -> np.ndarray:
    """Rows `slots` of head kvh of a quantised pool, dequantised in float32, as the kernel does per key:
    element d = scale[d // G] * ((codes[d // PER] >> (d % PER) * BITS) & MASK) + bias[d // G], PER = 32 / BITS."""
    return _np_rows(_np_pool(pool), kvh, slots)


def _np_pool(pool):
    """A pool as NumPy arrays, converted once: float32 rows, or a quantised pool's (codes, scales, biases, bits, group)."""
    if isinstance(pool, QuantPool):
        return (np.asarray(pool.codes), _np32(pool.scales), _np32(pool.biases), pool.bits, pool.group_size)
    return _np32(pool)


def _np_rows(pool, kvh: int, slots: np.ndarray) -> np.ndarray:
    """(len(slots), D) float32 K or V rows of head kvh of an `_np_pool`: a float pool's rows, or dequantised."""
    if not isinstance(pool, tuple):
        return pool[kvh, slots]
    codes, scales, biases, bits, G = pool
    per = 32 // bits
    d = np.arange(codes.shape[2] * per)
    words = codes[kvh][slots][:, d // per]  # (n, D) the word holding each element
    q = (words >> ((d % per) * bits).astype(np.uint32)) & np.uint32((1 << bits) - 1)
    return scales[kvh][slots][:, d // G] * q.astype(np.float32) + biases[kvh][slots][:, d // G]


def paged_attention_online(
    queries, k_pool, v_pool, block_tables, context_lens, *, block_size: int, scale: float,
    window: int | None = None, softcap: float | None = None, sinks=None, chunk: int | None = None,
    splits: int | None = None, tile: int | None = None,
) -> mx.array:
    """The kernel's algorithm in NumPy: same threadgroups, splits, tiles, recurrence and index arithmetic.

    Args:
        queries: (B, n_heads, q_len, head_dim), the last q_len positions of each row.
        k_pool, v_pool: (n_kv_heads, num_blocks * block_size, head_dim), head-major slots,
            or `QuantPool`s (each key and value dequantised as it is staged).
        block_tables: int32 (B, max_blocks_per_seq) padded with 0, or lists of block ids.
        context_lens: (B,) tokens in each row's cache, the q_len new ones included.
        block_size: slots per block.
        scale: softmax scale.
        window: sliding window (a query at p sees keys > p - window), or None.
        softcap: logit soft-capping: a visible score s becomes tanh(s / softcap) * softcap.
        sinks: (n_heads,) attention sinks: a logit per head in the softmax's denominator
            with no value (MLX's SDPA `sinks`), or None.
        chunk: chunked attention: a query at p sees keys >= p // chunk * chunk, or None.
        splits, tile: S and TK (default: what `launch_plan` launches).

    Returns:
        (B, n_heads, q_len, head_dim) in the queries' dtype (computed in float32).
    """
    q = _np32(queries)
    kp, vp = _np_pool(k_pool), _np_pool(v_pool)
    tables = np.asarray(padded_tables(block_tables, context_lens, block_size))
    lens = [int(c) for c in np.asarray(context_lens).reshape(-1)]
    B, H, QL, D = q.shape
    KVH, BS = k_pool.shape[0], block_size
    plan = launch_plan(B, H, QL, KVH, D, BS, context_blocks(lens, BS), window=window, chunk=chunk, splits=splits)
    S, PB, TK = plan.splits, plan.blocks_per_split, tile or plan.tile
    G, R = H // KVH, plan.rows
    cap = np.float32(softcap or 0)
    sink = _np32(sinks) if sinks is not None else np.full(H, MASKED, np.float32)
    f32 = np.float32
    out = np.empty_like(q)
    for b in range(B):  # grid z
        C = lens[b]
        lo0 = first_key(C - QL, window, chunk)  # [1] the rows' union range [lo0, C - 1]
        for kvh in range(KVH):  # grid y = kvh * S + s
            heads = [kvh * G + r // QL for r in range(R)]  # [2] the rows
            ps = [C - QL + r % QL for r in range(R)]
            los = [first_key(p, window, chunk) for p in ps]
            qs = [q[b, h, r % QL] for r, h in enumerate(heads)]
            part_m, part_l, part_acc = np.full((S, R), MASKED, f32), np.zeros((S, R), f32), np.zeros((S, R, D), f32)
            for s in range(S):
                m, l, acc = np.full(R, MASKED, f32), np.zeros(R, f32), np.zeros((R, D), f32)
                j0 = lo0 // BS + s * PB
                for j in range(j0, min(j0 + PB, (C - 1) // BS + 1)):
                    phys = tables[b, j]
                    for t0 in range(0, BS, TK):
                        pos = j * BS + t0 + np.arange(TK)
                        if pos[-1] < lo0 or pos[0] > C - 1:
                            continue
                        slots = phys * BS + t0 + np.arange(TK)  # [3] stage the tile's tokens in [lo0, C - 1]
                        staged = (pos >= lo0) & (pos <= C - 1)
                        kt, vt = np.zeros((TK, D), f32), np.zeros((TK, D), f32)
                        kt[staged], vt[staged] = _np_rows(kp, kvh, slots[staged]), _np_rows(vp, kvh, slots[staged])
                        for r in range(R):  # [4] each row's scores over the tile
                            vis = (pos >= los[r]) & (pos <= ps[r])
                            sc = np.full(TK, MASKED, f32)
                            sc[vis] = (kt[vis] @ qs[r]) * f32(scale)
                            if cap > 0:
                                sc[vis] = np.tanh(sc[vis] / cap) * cap
                            m_new = max(m[r], sc.max())  # [5] online softmax, once per tile
                            corr = np.exp(m[r] - m_new)
                            pt = np.exp(sc[vis] - m_new)  # masked slots never touch V
                            l[r] = l[r] * corr + pt.sum()
                            acc[r] = acc[r] * corr + pt @ vt[vis]
                            m[r] = m_new
                part_m[s], part_l[s], part_acc[s] = m, l, acc
            for r, h in enumerate(heads):  # [6] merge the splits and the sink (pass 2)
                M = max(part_m[:, r].max(), sink[h])
                w = np.exp(part_m[:, r] - M)
                out[b, h, r % QL] = (part_acc[:, r] * w[:, None]).sum(0) / ((part_l[:, r] * w).sum() + np.exp(sink[h] - M))
    dtype = queries.dtype if isinstance(queries, mx.array) else mx.float32
    return mx.array(out).astype(dtype)


@functools.lru_cache(maxsize=None)
def build_kernel(kind: str = "float"):
    """The kernel object of `kind` "float" / "quant" (pass 1) or "reduce" (pass 2). Building works
    without Metal; calling it needs Metal."""
    source, names = {"float": (PASS1_SOURCE, INPUT_NAMES), "quant": (QUANT_PASS1_SOURCE, QUANT_INPUT_NAMES),
                     "reduce": (REDUCE_SOURCE, REDUCE_INPUT_NAMES)}[kind]
    return mx.fast.metal_kernel(name=f"macinfer_paged_attention_{kind}", input_names=list(names),
                                output_names=["out"], source=source, header=HEADER)


def kernel_supports(queries, k_pool, v_pool, *, sinks=None, softcap=None) -> bool:
    """Whether the kernel computes this call: the dtypes it is checked in, one head_dim (a multiple of 8)
    for Q, K and V, at most MAX_ROWS rows per KV head, float pools or quantised pools of one bits and
    group (and not sinks with soft-capping, which the reference refuses too)."""
    B, H, QL, D = queries.shape
    quantized = isinstance(k_pool, QuantPool)
    return (queries.dtype in SUPPORTED_DTYPES and k_pool.shape[-1] == D and v_pool.shape[-1] == D and D % 8 == 0
            and H % k_pool.shape[0] == 0 and H // k_pool.shape[0] * QL <= MAX_ROWS
            and quantized == isinstance(v_pool, QuantPool)
            and (not quantized or k_pool[3:] == v_pool[3:])
            and not (sinks is not None and softcap is not None))


@dataclass(frozen=True)
class KernelCall:
    """The one or two kernel launches of a call: keyword arguments of each kernel object."""

    kind: str  # "float" | "quant": pass 1's kernel
    plan: LaunchPlan
    pass1: dict
    reduce: dict | None  # None: one pass

    @property
    def pipeline(self) -> tuple:
        """What MLX compiles for this call: pass 1's template (pass 2's follows from it)."""
        return (self.kind, *(v for _, v in self.pass1["template"]))


def kernel_call(
    queries, k_pool, v_pool, block_tables, context_lens, *, block_size: int, scale: float,
    window: int | None = None, softcap: float | None = None, sinks=None, chunk: int | None = None,
    n_simdgroups: int | None = None, splits: int | None = None, lens: mx.array | None = None,
    sink_array: mx.array | None = None,
) -> KernelCall:
    """The launches of one call. k_pool and v_pool are both float pools or both `QuantPool`s.

    block_tables: int32 (B, W) from `padded_tables` (built once per forward), or lists.
    n_simdgroups: the most simdgroups per threadgroup (a pipeline's thread limit; default
    MAX_SIMDGROUPS). lens, sink_array: `padded_lens` / `padded_sinks` built once by the caller.
    """
    B, H, QL, D = queries.shape
    BS = block_size
    tables = padded_tables(block_tables, context_lens, BS)
    KVH = k_pool.shape[0]
    plan = launch_plan(B, H, QL, KVH, D, BS, context_blocks(context_lens, BS), window=window, chunk=chunk,
                       max_simdgroups=n_simdgroups or MAX_SIMDGROUPS, splits=splits)
    if isinstance(k_pool, QuantPool):
        assert (k_pool.bits, k_pool.group_size) == (v_pool.bits, v_pool.group_size), "K and V quantised alike"
        kind, pools, extra = "quant", [*k_pool[:3], *v_pool[:3]], [("BITS", k_pool.bits), ("GS", k_pool.group_size)]
    else:
        kind, pools, extra = "float", [k_pool, v_pool], []
    sink = sink_array if sink_array is not None else padded_sinks(sinks, H)
    inputs = [queries, *pools, tables, lens if lens is not None else padded_lens(context_lens),
              mx.array([window or 0, chunk or 0, plan.blocks_per_split, plan.splits], dtype=mx.int32),
              mx.array([scale, softcap or 0], dtype=mx.float32), sink]
    threads = SIMD_WIDTH * plan.simdgroups
    template = [("T", queries.dtype), ("D", D), ("BS", BS), ("TK", plan.tile), ("RPS", plan.rows_per_simdgroup),
                ("SPLIT", plan.split), *extra]
    out_shape = (B, H, QL, plan.splits, D + 2) if plan.split else queries.shape
    pass1 = dict(inputs=inputs, template=template, grid=(threads, KVH * plan.splits, B), threadgroup=(threads, 1, 1),
                 output_shapes=[out_shape], output_dtypes=[mx.float32 if plan.split else queries.dtype])
    reduce = None
    if plan.split:
        reduce = dict(inputs=[None, sink], template=[("T", queries.dtype), ("D", D)], grid=(SIMD_WIDTH, H * QL, B),
                      threadgroup=(SIMD_WIDTH, 1, 1), output_shapes=[queries.shape], output_dtypes=[queries.dtype])
    return KernelCall(kind, plan, pass1, reduce)


def run_call(call: KernelCall, kernels=None) -> mx.array:
    """Run a KernelCall with MLX's kernel objects (Metal only), or with `kernels[kind](**launch)` (tests)."""
    get = kernels.__getitem__ if kernels is not None else build_kernel
    out = get(call.kind)(**call.pass1)[0]
    if call.reduce is None:
        return out
    return get("reduce")(**{**call.reduce, "inputs": [out, call.reduce["inputs"][1]]})[0]


def paged_attention_metal(
    queries, k_pool, v_pool, block_tables, context_lens, *, block_size: int, scale: float,
    window: int | None = None, softcap: float | None = None, sinks=None, chunk: int | None = None,
    n_simdgroups: int | None = None, splits: int | None = None, lens: mx.array | None = None,
    sink_array: mx.array | None = None,
) -> mx.array:
    """Run the Metal kernel (Metal only). Same arguments as `paged_attention_online`, and `kernel_call`'s."""
    return run_call(kernel_call(queries, k_pool, v_pool, block_tables, context_lens, block_size=block_size,
                                scale=scale, window=window, softcap=softcap, sinks=sinks, chunk=chunk,
                                n_simdgroups=n_simdgroups, splits=splits, lens=lens, sink_array=sink_array))


def random_problem(
    seed: int, *, context_lens: list[int], q_len: int = 1, n_heads: int = 4, n_kv_heads: int = 2,
    head_dim: int = 64, block_size: int = 16, dtype=mx.float32, window: int | None = None,
    softcap: float | None = None, sinks: bool = False, kv_bits: int | None = None, kv_group: int = 32,
    chunk: int | None = None,
) -> dict:
    """Random paged-attention arguments with shuffled physical blocks.

    Block 0 is the null block (padding); blocks are handed out in a random order so
    that only a correct walk of the block table finds each token; the pool holds
    two spare blocks no table points to. sinks: random per-head sinks; kv_bits: the
    pools quantised (`QuantPool`s of kv_bits, groups of kv_group along head_dim).
    """
    rng = np.random.default_rng(seed)
    BS = block_size
    need = [-(-c // BS) for c in context_lens]
    num_blocks = 1 + sum(need) + 2
    ids = iter(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((len(context_lens), max(need)), np.int32)
    for b, n in enumerate(need):
        tables[b, :n] = [next(ids) for _ in range(n)]
    pool_shape = (n_kv_heads, num_blocks * BS, head_dim)  # head-major slots

    def pool():
        x = mx.array(rng.standard_normal(pool_shape, np.float32)).astype(dtype)
        return x if kv_bits is None else QuantPool(*mx.quantize(x, group_size=kv_group, bits=kv_bits), kv_bits, kv_group)

    extra = {k: x for k, x in (("softcap", softcap), ("chunk", chunk)) if x is not None}
    if sinks:
        extra["sinks"] = mx.array(rng.standard_normal(n_heads, np.float32)).astype(dtype)
    return dict(**extra,
        queries=mx.array(rng.standard_normal((len(context_lens), n_heads, q_len, head_dim), np.float32)).astype(dtype),
        k_pool=pool(),
        v_pool=pool(),
        block_tables=mx.array(tables),
        context_lens=list(context_lens),
        block_size=BS,
        scale=head_dim**-0.5,
        window=window,
    )


def check_case(kernel_fn: AttentionFn, reference_fn: AttentionFn, args: dict, diffs: dict | None = None) -> str | None:
    """Run kernel_fn and reference_fn on one problem, evaluated: None if they agree within
    `TOLERANCE` of the queries' dtype, else what differed. Exceptions from kernel_fn propagate.
    diffs: if given, diffs[dtype name] keeps the largest |difference| seen."""
    got = kernel_fn(**args).astype(mx.float32)
    want = reference_fn(**args).astype(mx.float32)
    mx.eval(got, want)
    tol = TOLERANCE[args["queries"].dtype]
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    if diffs is not None:
        name = str(args["queries"].dtype).split(".")[-1] + (" kv8" if isinstance(args["k_pool"], QuantPool) else "")
        diffs[name] = max(diffs.get(name, 0.0), mx.abs(got - want).max().item())
    if not mx.allclose(got, want, rtol=tol, atol=tol).item():
        return f"max |diff| {mx.abs(got - want).max().item():.3g} > {tol}"
    return None


def metal_available() -> bool:
    return mx.metal.is_available()
