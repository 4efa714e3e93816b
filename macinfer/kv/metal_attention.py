"""Fused paged decode attention as a Metal kernel, its executable reference, and run-time selection.

The reference path (`macinfer.kv.paged_attention`) gathers each sequence's slots into
a contiguous K/V buffer and calls MLX's fused SDPA: at long contexts that copy
costs an extra read and write of the KV cache per step. The kernel here reads
K/V straight from the block pool instead and keeps an online softmax, so there
is no gathered copy and no n x n score matrix.

Algorithm (one query row = one (sequence b, query head h, query token qi); on
Metal one threadgroup of NSG simdgroups x 32 lanes, lane i holding dims i, i+32, ...):

    query qi of a row with context length C sits at position p = C - q_len + qi
    and sees keys lo..p, lo = max(0, p - window + 1) (0 without a window),
    raised to p // chunk * chunk, its chunk's first key, for chunked attention (llama4).

    block-table index arithmetic (BS = block_size, KVH = n_kv_heads, D = head_dim,
    NS = num_blocks * BS slots; pools are head-major, see macinfer.kv.paged_attention):

      logical position pos = j * BS + t          block_tables[b] = [ 7, 2, 9, 0, 0 ]
                                                                     |  |  |  padding (null
      seq b:  | 0 .. BS-1 | BS .. 2BS-1 | 2BS .. C-1 |               |  |  |  block 0): never
                 j = 0        j = 1         j = 2                    |  |  |  read, j <= p // BS
                   |            |             |                      v  v  v
                   +-------> phys = block_tables[b, j] ----->  block 7, 2, 9 = slots
                                                                   [7BS, 8BS), [2BS, 3BS), [9BS, 10BS)
      slot = phys * BS + t
      K of (pos, kv head kvh, dim d) = k_pool[kvh, slot, d]
                                     = k_pool_flat[(kvh * NS + phys * BS + t) * D + d]

    so a block of one head is BS * D contiguous values: the kernel streams it.
      kvh = h // (n_heads // n_kv_heads)            (grouped-query attention)

    partitioning: the blocks j_lo = lo // BS .. j_hi = p // BS are dealt round-robin
    to NSG partitions (one Metal simdgroup each):

      j:      j_lo  j_lo+1  ...  j_lo+NSG-1  j_lo+NSG  j_lo+NSG+1 ...
      part:    0      1     ...    NSG-1        0          1     ...

    each partition keeps an online softmax (m, l, acc) updated once per block:

      s      = scale * K_blk @ q            (masked slots: -1e30, skipped below)
      s      = tanh(s / cap) * cap          (logit soft-capping, Gemma 2; only if cap > 0)
      m_new  = max(m, max(s))
      corr   = exp(m - m_new)
      l      = l * corr + sum(exp(s - m_new))
      acc    = acc * corr + exp(s - m_new) @ V_blk
      m      = m_new

    and the NSG partials are merged at the end:

      M = max(max_g m_g, sink);   w_g = exp(m_g - M)
      out = sum_g w_g acc_g / (sum_g w_g l_g + exp(sink - M))     (sink: a per-head logit
                                                                   with no value; none: -1e30)

`paged_attention_online` runs that algorithm in NumPy, loop for loop, so it is
tested on machines without Metal; `METAL_SOURCE` is its transliteration (the
[1]..[6] step tags match). Only Metal can compile and run the kernel for real, so
macinfer.kv.kernel_dispatch self-checks it against the reference path before use,
for every shape class the engine dispatches. Quantised pools (`QuantPool`, 8 or 4
bits) are read by the same algorithm, each key and value dequantised as it is read. (The
tests also compile the source MLX generates from it as C++ against a shim of the
Metal built-ins and run it in a small SIMT emulator: a check of the source's
logic, not of the Metal compiler or the GPU.)

NOTE: masked slots use a finite sentinel (-1e30), not -inf, so the kernel is
correct under Metal's fast-math mode too; and masked slots never touch V, so
stale values (even NaN) in unused pool slots cannot leak into the output.
"""

from __future__ import annotations

import functools
from typing import Callable

import mlx.core as mx
import numpy as np

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


MAX_THREADS = 256  # threads per threadgroup we launch (see default_simdgroups)


def default_simdgroups(head_dim: int, max_threads: int = MAX_THREADS) -> int:
    """Partitions (simdgroups) per query row: max_threads / 32 while the merge buffer
    NSG * head_dim floats stays within 16 KB of threadgroup memory.

    NOTE: 256 threads, as vllm-metal launches, not the 1024 a device allows: MLX refuses a
    dispatch above the *pipeline's* maxTotalThreadsPerThreadgroup, which register pressure
    can lower below 1024 (896 at head_dim 256 on an M2 Ultra in mlx-vlm). A pipeline whose
    limit is lower still gets the limit's simdgroups (macinfer.kv.kernel_dispatch).
    """
    return max(1, min(max_threads // SIMD_WIDTH, 4096 // head_dim))


def _np32(x) -> np.ndarray:
    if isinstance(x, mx.array):
        x = x.astype(mx.float32)
    return np.asarray(x, dtype=np.float32)


def padded_tables(block_tables, context_lens, block_size: int) -> mx.array:
    """Block tables as int32 (B, W), padded with the null block 0 to cover every row's context.

    NOTE: W covers ceil(context_len / block_size) for every row, not just the longest table:
    a row right-padded in a batch (a short prefill chunk beside a longer one) counts its
    padding in context_lens, so its table can be shorter than its context. The kernel reads
    entry pos // BS for every position up to context_len - 1; without this it read past
    the buffer (the reference raised IndexError on the same input).
    """
    lens = [int(c) for c in np.asarray(context_lens).reshape(-1)]
    need = max((-(-c // block_size) for c in lens), default=0)
    if isinstance(block_tables, mx.array):
        t = block_tables.astype(mx.int32)
        return t if t.shape[1] >= need else mx.pad(t, [(0, 0), (0, need - t.shape[1])])
    width = max(max(len(t) for t in block_tables), need)
    return mx.array([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=mx.int32)


def np_dequantize(pool: QuantPool, kvh: int, slots: np.ndarray) -> np.ndarray:
    """Rows `slots` of head kvh of a quantised pool, dequantised in float32, as the kernel does per key:
    element d = scale[d // G] * ((codes[d // PER] >> (d % PER) * BITS) & MASK) + bias[d // G], PER = 32 / BITS."""
    bits, G = pool.bits, pool.group_size
    D, per = pool.shape[2], 32 // bits
    d = np.arange(D)
    words = np.asarray(pool.codes[kvh])[slots][:, d // per]  # (n, D) the word holding each element
    codes = (words >> ((d % per) * bits).astype(np.uint32)) & np.uint32((1 << bits) - 1)
    return _np32(pool.scales[kvh])[slots][:, d // G] * codes.astype(np.float32) + _np32(pool.biases[kvh])[slots][:, d // G]


def _np_rows(pool, kvh: int, slots: np.ndarray) -> np.ndarray:
    """(len(slots), D) float32 K or V rows of head kvh: a float pool's rows, or a quantised pool's dequantised."""
    return np_dequantize(pool, kvh, slots) if isinstance(pool, QuantPool) else pool[kvh, slots]


def paged_attention_online(
    queries, k_pool, v_pool, block_tables, context_lens, *, block_size: int, scale: float,
    window: int | None = None, n_partitions: int | None = None, softcap: float | None = None, sinks=None,
    chunk: int | None = None,
) -> mx.array:
    """The kernel's algorithm in NumPy: same partitions, recurrence and index arithmetic.

    Args:
        queries: (B, n_heads, q_len, head_dim), the last q_len positions of each row.
        k_pool, v_pool: (n_kv_heads, num_blocks * block_size, head_dim), head-major slots,
            or `QuantPool`s (each key and value dequantised as it is read).
        block_tables: int32 (B, max_blocks_per_seq) padded with 0, or lists of block ids.
        context_lens: (B,) tokens in each row's cache, the q_len new ones included.
        block_size: slots per block.
        scale: softmax scale.
        window: sliding window (a query at p sees keys > p - window), or None.
        n_partitions: simdgroups per row; default `default_simdgroups(head_dim)`,
            what the kernel launches with.
        softcap: logit soft-capping: a visible score s becomes tanh(s / softcap) * softcap.
        sinks: (n_heads,) attention sinks: a logit per head in the softmax's denominator
            with no value (MLX's SDPA `sinks`), or None.
        chunk: chunked attention: a query at p sees keys >= p // chunk * chunk, or None.

    Returns:
        (B, n_heads, q_len, head_dim) in the queries' dtype (computed in float32).
    """
    q = _np32(queries)
    kp, vp = (p if isinstance(p, QuantPool) else _np32(p) for p in (k_pool, v_pool))
    tables = np.asarray(padded_tables(block_tables, context_lens, block_size))
    lens = [int(c) for c in np.asarray(context_lens).reshape(-1)]
    B, H, QL, D = q.shape
    KVH, BS = kp.shape[0], block_size
    NSG = n_partitions or default_simdgroups(D)
    W = window or 0
    CH = chunk or 0
    cap = np.float32(softcap or 0)
    sink = _np32(sinks) if sinks is not None else np.full(H, MASKED, np.float32)
    f32 = np.float32
    out = np.empty_like(q)
    for b in range(B):  # grid z: one sequence
        for h in range(H):  # grid y = h * q_len + qi: one query row per threadgroup
            kvh = h // (H // KVH)  # [1] GQA: the KV head this query head reads
            for qi in range(QL):
                p = lens[b] - QL + qi  # [1] absolute position of this query
                lo = max(0, p - W + 1) if W > 0 else 0
                lo = max(lo, p // CH * CH) if CH > 0 else lo
                j_lo, j_hi = lo // BS, p // BS
                qv = q[b, h, qi]  # (D,)  [2] the query, in float32
                ms = np.full(NSG, MASKED, f32)
                ls = np.zeros(NSG, f32)
                accs = np.zeros((NSG, D), f32)
                for g in range(NSG):  # one simdgroup each
                    m, l, acc = f32(MASKED), f32(0), np.zeros(D, f32)
                    for j in range(j_lo + g, j_hi + 1, NSG):  # [3] round-robin blocks
                        phys = tables[b, j]  # [3] logical block j -> physical block
                        pos = j * BS + np.arange(BS)
                        valid = (pos >= lo) & (pos <= p)
                        s = np.full(BS, MASKED, f32)  # (BS,)  [4] scores of this block
                        slots = phys * BS + np.arange(BS)  # [3] this block's slots
                        s[valid] = (_np_rows(kp, kvh, slots[valid]) @ qv) * f32(scale)
                        if cap > 0:  # [4] soft-capping, visible slots only
                            s[valid] = np.tanh(s[valid] / cap) * cap
                        m_new = max(m, s.max())  # [5] online softmax, once per block
                        corr = np.exp(m - m_new)
                        pt = np.exp(s[valid] - m_new)  # masked slots never touch V
                        l = l * corr + pt.sum()
                        acc = acc * corr + pt @ _np_rows(vp, kvh, slots[valid])
                        m = m_new
                    ms[g], ls[g], accs[g] = m, l, acc
                M = max(ms.max(), sink[h])  # [6] merge the partitions (and the sink: a logit, no value)
                w = np.exp(ms - M)
                out[b, h, qi] = (accs * w[:, None]).sum(0) / ((ls * w).sum() + np.exp(sink[h] - M))
    dtype = queries.dtype if isinstance(queries, mx.array) else mx.float32
    return mx.array(out).astype(dtype)


# The kernel body; MLX writes the signature from the names below. Template
# parameters: T (dtype), D (head_dim), BS (block_size), NSG (simdgroups per row),
# and for quantised pools BITS and G (group size). KV_READS becomes FLOAT_READS or
# QUANT_READS: how element d of K or V at flat slot s (kvh * NS + slot) is read.
# Launch: grid (32 * NSG, n_heads * q_len, B), threadgroup (32 * NSG, 1, 1).
_SOURCE = """
    threadgroup float tg_m[NSG];                // [6] per-partition m, l, acc for the merge
    threadgroup float tg_l[NSG];
    threadgroup float tg_acc[NSG * D];
    KV_READS
    constexpr int EPL = (D + 31) / 32;          // dims per lane: lane owns d = i * 32 + lane
    const int H = queries_shape[1];
    const int QL = queries_shape[2];
    const int KVH = KV_HEADS;
    const int MAXB = block_tables_shape[1];
    const int W = window[0];
    const int CH = chunk[0];                          // > 0: chunked attention
    const float sc = scale[0];
    const float cap = softcap[0];                     // > 0: logit soft-capping
    const uint lane = thread_index_in_simdgroup;
    const uint sg = simdgroup_index_in_threadgroup;   // ref: partition g
    const int b = threadgroup_position_in_grid.z;     // ref: for b
    const int row = threadgroup_position_in_grid.y;   // ref: for h, for qi
    const int h = row / QL;
    const int qi = row % QL;

    // [1] ref: kvh = h // (H // KVH); p = C - QL + qi; lo (window, then chunk), j_lo, j_hi
    const int kvh = h / (H / KVH);
    const int p = context_lens[b] - QL + qi;
    const int lo_w = W > 0 ? metal::max(0, p - W + 1) : 0;
    const int lo = CH > 0 ? metal::max(lo_w, (p / CH) * CH) : lo_w;
    const int j_lo = lo / BS;
    const int j_hi = p / BS;

    // [2] ref: qv = q[b, h, qi] in float32, spread over the lanes
    const int64_t q_off = ((int64_t)(b * H + h) * QL + qi) * D;
    float qv[EPL];
    float acc[EPL];
    for (int i = 0; i < EPL; ++i) {
        const int d = i * 32 + lane;
        qv[i] = d < D ? static_cast<float>(queries[q_off + d]) : 0.0f;
        acc[i] = 0.0f;
    }
    float m = -1.0e30f;                               // ref: m, l = MASKED, 0
    float l = 0.0f;

    // [3] ref: for j in range(j_lo + g, j_hi + 1, NSG): phys = tables[b, j]
    for (int j = j_lo + (int)sg; j <= j_hi; j += NSG) {
        const int64_t phys = block_tables[b * MAXB + j];
        const int64_t slot0 = kvh * NS + phys * BS;   // flat slot of pool[kvh, phys * BS]

        // [4] ref: s[valid] = (K rows @ qv) * scale (soft-capped); others MASKED
        float s[BS];
        float m_blk = -1.0e30f;
        for (int t = 0; t < BS; ++t) {
            const int pos = j * BS + t;
            s[t] = -1.0e30f;
            if (pos >= lo && pos <= p) {              // uniform across the simdgroup
                float part = 0.0f;
                for (int i = 0; i < EPL; ++i) {
                    const int d = i * 32 + lane;
                    if (d < D) {
                        part += qv[i] * K_AT(slot0 + t, d);
                    }
                }
                float st = simd_sum(part) * sc;
                if (cap > 0.0f) {                     // ref: s = tanh(s / cap) * cap
                    st = metal::precise::tanh(st / cap) * cap;
                }
                s[t] = st;
            }
            m_blk = metal::max(m_blk, s[t]);
        }

        // [5] ref: m_new, corr, l, acc updated once per block; masked slots skip V
        const float m_new = metal::max(m, m_blk);
        const float corr = metal::exp(m - m_new);
        l *= corr;
        for (int i = 0; i < EPL; ++i) {
            acc[i] *= corr;
        }
        for (int t = 0; t < BS; ++t) {
            const int pos = j * BS + t;
            if (pos >= lo && pos <= p) {
                const float pt = metal::exp(s[t] - m_new);
                l += pt;
                for (int i = 0; i < EPL; ++i) {
                    const int d = i * 32 + lane;
                    if (d < D) {
                        acc[i] += pt * V_AT(slot0 + t, d);
                    }
                }
            }
        }
        m = m_new;
    }

    // [6] ref: merge partitions and the sink: M = max(m_g, sink), w_g = exp(m_g - M),
    //      out = sum w acc / (sum w l + exp(sink - M))
    if (lane == 0) {
        tg_m[sg] = m;
        tg_l[sg] = l;
    }
    for (int i = 0; i < EPL; ++i) {
        const int d = i * 32 + lane;
        if (d < D) {
            tg_acc[sg * D + d] = acc[i];
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float sink = sinks[h];                      // MASKED without sinks: adds exp(-1e30) = 0
    float M = sink;
    for (int g = 0; g < NSG; ++g) {
        M = metal::max(M, tg_m[g]);
    }
    float L = metal::exp(sink - M);
    for (int g = 0; g < NSG; ++g) {
        L += tg_l[g] * metal::exp(tg_m[g] - M);
    }
    for (int d = thread_position_in_threadgroup.x; d < D; d += NSG * 32) {
        float o = 0.0f;
        for (int g = 0; g < NSG; ++g) {
            o += tg_acc[g * D + d] * metal::exp(tg_m[g] - M);
        }
        out[q_off + d] = static_cast<T>(o / L);
    }
    #undef K_AT
    #undef V_AT
"""

FLOAT_READS = """
    #define K_AT(s, d) static_cast<float>(k_pool[(s) * D + (d)])
    #define V_AT(s, d) static_cast<float>(v_pool[(s) * D + (d)])
    const int64_t NS = k_pool_shape[1];             // slots per head: num_blocks * BS"""

# MLX's affine quantisation (macinfer.kv.paged_attention.QuantPool): dequantised per key, in float32.
QUANT_READS = """
    constexpr int PER = 32 / BITS;                  // codes per uint32 word, lowest bits first
    constexpr int WPS = D / PER;                    // words per slot
    constexpr int GPS = D / G;                      // scales (biases) per slot
    constexpr uint MASK = (1u << BITS) - 1u;
    #define KV_AT(c, sc, bi, s, d) (static_cast<float>(sc[(s) * GPS + (d) / G]) * static_cast<float>((c[(s) * WPS + (d) / PER] >> (((d) % PER) * BITS)) & MASK) + static_cast<float>(bi[(s) * GPS + (d) / G]))
    #define K_AT(s, d) KV_AT(k_codes, k_scales, k_biases, s, d)
    #define V_AT(s, d) KV_AT(v_codes, v_scales, v_biases, s, d)
    const int64_t NS = k_codes_shape[1];            // slots per head: num_blocks * BS"""

METAL_SOURCE = _SOURCE.replace("KV_READS", FLOAT_READS.strip()).replace("KV_HEADS", "k_pool_shape[0]")
QUANT_METAL_SOURCE = (_SOURCE.replace("KV_READS", QUANT_READS.strip()).replace("KV_HEADS", "k_codes_shape[0]")
                      .replace("    #undef V_AT\n", "    #undef V_AT\n    #undef KV_AT\n"))

_TAIL = ("block_tables", "context_lens", "scale", "window", "softcap", "sinks", "chunk")
INPUT_NAMES = ("queries", "k_pool", "v_pool", *_TAIL)
QUANT_INPUT_NAMES = ("queries", "k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases", *_TAIL)


@functools.lru_cache(maxsize=None)
def build_kernel(quantized: bool = False):
    """The kernel object for float or quantised pools (building works without Metal; calling it needs Metal)."""
    return mx.fast.metal_kernel(
        name="macinfer_paged_attention" + ("_q" if quantized else ""),
        input_names=list(QUANT_INPUT_NAMES if quantized else INPUT_NAMES),
        output_names=["out"],
        source=QUANT_METAL_SOURCE if quantized else METAL_SOURCE,
    )


def kernel_launch(
    queries, k_pool, v_pool, block_tables, context_lens, *, block_size: int, scale: float,
    window: int | None = None, n_simdgroups: int | None = None, softcap: float | None = None, sinks=None,
    chunk: int | None = None,
) -> dict:
    """Keyword arguments of one kernel call: inputs, template, grid, threadgroup, outputs.

    k_pool and v_pool are both float pools or both `QuantPool`s of one bits and group size
    (then the quantised kernel, `build_kernel(True)`).
    """
    B, H, QL, D = queries.shape
    BS = block_size
    NSG = n_simdgroups or default_simdgroups(D)
    lens = context_lens if isinstance(context_lens, mx.array) else mx.array([int(c) for c in context_lens])
    tables = padded_tables(block_tables, context_lens, BS)
    template = [("T", queries.dtype), ("D", D), ("BS", BS), ("NSG", NSG)]
    if isinstance(k_pool, QuantPool):
        assert (k_pool.bits, k_pool.group_size) == (v_pool.bits, v_pool.group_size), "K and V quantised alike"
        pools = [*k_pool[:3], *v_pool[:3]]
        template += [("BITS", k_pool.bits), ("G", k_pool.group_size)]
    else:
        pools = [k_pool, v_pool]
    sink = (mx.full((H,), MASKED, mx.float32) if sinks is None else sinks.astype(mx.float32))
    return dict(
        inputs=[
            queries, *pools, tables, lens.astype(mx.int32),
            mx.array([scale], dtype=mx.float32), mx.array([window or 0], dtype=mx.int32),
            mx.array([softcap or 0], dtype=mx.float32), sink, mx.array([chunk or 0], dtype=mx.int32),
        ],
        template=template,
        grid=(SIMD_WIDTH * NSG, H * QL, B),
        threadgroup=(SIMD_WIDTH * NSG, 1, 1),
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
    )


def paged_attention_metal(
    queries, k_pool, v_pool, block_tables, context_lens, *, block_size: int, scale: float,
    window: int | None = None, softcap: float | None = None, sinks=None, chunk: int | None = None,
    n_simdgroups: int | None = None,
) -> mx.array:
    """Run the Metal kernel (Metal only). Same arguments as `paged_attention_online`."""
    return build_kernel(isinstance(k_pool, QuantPool))(**kernel_launch(
        queries, k_pool, v_pool, block_tables, context_lens, block_size=block_size, scale=scale, window=window,
        softcap=softcap, sinks=sinks, chunk=chunk, n_simdgroups=n_simdgroups))[0]


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


def self_check_cases(block_size: int, head_dim: int) -> list[dict]:
    """Problems the kernel must pass: lengths ending inside and on block boundaries,
    GQA ratios 1/3/4, q_len 1-3, a window, more blocks than simdgroups, soft-capping, sinks, chunks."""
    BS = block_size
    many = (default_simdgroups(head_dim) + 8) * BS + 7  # some simdgroups walk 2 blocks
    return [
        dict(context_lens=[1, BS, 3 * BS + 5], q_len=1, n_heads=4, n_kv_heads=4),
        dict(context_lens=[2 * BS, 5 * BS - 1], q_len=3, n_heads=6, n_kv_heads=2),
        dict(context_lens=[4 * BS + 1, many], q_len=2, n_heads=8, n_kv_heads=2, window=2 * BS + 3),
        dict(context_lens=[many], q_len=1, n_heads=3, n_kv_heads=1, sinks=True),
        dict(context_lens=[3 * BS + 2, BS], q_len=2, n_heads=4, n_kv_heads=2, window=BS + 1, softcap=2.0),
        dict(context_lens=[3 * BS + 2, 2 * BS + 1], q_len=3, n_heads=4, n_kv_heads=2, chunk=BS + 3),
    ]


def check_case(kernel_fn: AttentionFn, reference_fn: AttentionFn, args: dict) -> str | None:
    """Run kernel_fn and reference_fn on one problem, evaluated: None if they agree within
    `TOLERANCE` of the queries' dtype, else what differed. Exceptions from kernel_fn propagate."""
    got = kernel_fn(**args).astype(mx.float32)
    want = reference_fn(**args).astype(mx.float32)
    mx.eval(got, want)
    tol = TOLERANCE[args["queries"].dtype]
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    if not mx.allclose(got, want, rtol=tol, atol=tol).item():
        return f"max |diff| {mx.abs(got - want).max().item():.3g} > {tol}"
    return None


def self_check(
    kernel_fn: AttentionFn, reference_fn: AttentionFn, *, head_dim: int = 64, block_size: int = 16,
    dtypes=SUPPORTED_DTYPES, kv_bits: int | None = None,
) -> str | None:
    """Compare kernel_fn with reference_fn on `self_check_cases` (pools quantised to kv_bits if given).

    Returns:
        None if every case matches within `TOLERANCE`, else a one-line description
        of the first mismatch. Exceptions from kernel_fn (compile errors) propagate.
    """
    for dtype in dtypes:
        for i, case in enumerate(self_check_cases(block_size, head_dim)):
            args = random_problem(i, head_dim=head_dim, block_size=block_size, dtype=dtype, kv_bits=kv_bits, **case)
            failure = check_case(kernel_fn, reference_fn, args)
            if failure:
                return f"the Metal paged-attention kernel disagrees with the reference ({dtype}, case {i} {case}: {failure})"
    return None


def metal_available() -> bool:
    return mx.metal.is_available()
