"""The paged-attention kernel as it was before the GQA-aware one: a baseline to measure against.

One threadgroup per query row (sequence, query head, query token) of NSG simdgroups that deal
the row's blocks round-robin, each lane reading K and V element by element. Kept verbatim
(float pools only) so tests/test_metal_attention.py can count, in the emulator, the K/V bytes
it reads per step against the present kernel's. Not used by macinfer.
"""

import mlx.core as mx

from macinfer.kv import metal_attention as ma

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

SOURCE = _SOURCE.replace("KV_READS", FLOAT_READS.strip()).replace("KV_HEADS", "k_pool_shape[0]")
INPUT_NAMES = ("queries", "k_pool", "v_pool", "block_tables", "context_lens", "scale", "window", "softcap", "sinks",
               "chunk")
NSG = 8


def build_kernel():
    return mx.fast.metal_kernel(name="macinfer_paged_attention_v1", input_names=list(INPUT_NAMES),
                                output_names=["out"], source=SOURCE)


def launch(queries, k_pool, v_pool, block_tables, context_lens, *, block_size, scale, window=None, **_):
    """Its launch: grid (32 * NSG, n_heads * q_len, B), threadgroup (32 * NSG, 1, 1)."""
    B, H, QL, D = queries.shape
    tables = ma.padded_tables(block_tables, context_lens, block_size)
    return dict(
        inputs=[queries, k_pool, v_pool, tables, ma.padded_lens(context_lens), mx.array([scale], dtype=mx.float32),
                mx.array([window or 0], dtype=mx.int32), mx.array([0.0], dtype=mx.float32), ma.padded_sinks(None, H),
                mx.array([0], dtype=mx.int32)],
        template=[("T", queries.dtype), ("D", D), ("BS", block_size), ("NSG", NSG)],
        grid=(32 * NSG, H * QL, B), threadgroup=(32 * NSG, 1, 1),
        output_shapes=[queries.shape], output_dtypes=[queries.dtype])
