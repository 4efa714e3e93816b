"""The Metal source of the paged-attention kernels (macinfer.kv.metal_attention builds and launches them).

Pass 1 (`PASS1_SOURCE`, `QUANT_PASS1_SOURCE` for quantised pools) computes each (sequence, KV head,
split)'s rows; pass 2 (`REDUCE_SOURCE`) merges the splits. Each is a kernel *body*: MLX's
`mx.fast.metal_kernel` writes the signature from the input names (and `HEADER` before it). The
[1]..[6] step tags and "ref:" comments point at the lines of metal_attention.paged_attention_online
each one transliterates.
"""

# Helpers before the kernels' signatures (MLX's `header`). Every read of a K/V pool goes
# through kv_vec4 / kv_one, so the tests' emulator can count the bytes read.
HEADER = """
template <typename P>
inline vec<P, 4> kv_vec4(const device P* pool, int64_t i) {   // 4 elements: 16 bytes in float32
    return *(const device vec<P, 4>*)(pool + i);
}
template <typename P>
inline P kv_one(const device P* pool, int64_t i) {
    return pool[i];
}
inline int first_key(int p, int W, int CH) {                 // ref: first_key
    const int lo = W > 0 ? metal::max(0, p - W + 1) : 0;
    return CH > 0 ? metal::max(lo, (p / CH) * CH) : lo;
}
"""

# Pass 1. MLX writes the signature from the input names. Template parameters: T (queries and a
# one-pass output), D, BS, TK (tokens per tile), RPS (rows per simdgroup), SPLIT (write partial
# states for pass 2), and for quantised pools BITS and GS (group size). STAGE becomes
# FLOAT_STAGE or QUANT_STAGE: how a tile of K and V reaches threadgroup memory.
# Launch: grid (32 * NSG, KVH * S, B), threadgroup (32 * NSG, 1, 1).
_PASS1 = """
    constexpr int EPL = (D + 31) / 32;                // dims per lane: lane owns d = i * 32 + lane
    threadgroup float tk[TK * D];                     // [3] the staged tile, as float
    threadgroup float tv[TK * D];
    const int H = queries_shape[1];
    const int QL = queries_shape[2];
    const int KVH = KV_HEADS;
    const int G = H / KVH;
    const int R = G * QL;                             // rows of this KV head
    const int MAXB = block_tables_shape[1];
    const int W = iparams[0];                         // > 0: sliding window
    const int CH = iparams[1];                        // > 0: chunked attention
    const int PB = iparams[2];                        // blocks per split
    const int S = iparams[3];                         // splits
    const float sc = fparams[0];
    const float cap = fparams[1];                     // > 0: logit soft-capping
    const int NT = threads_per_threadgroup.x;
    const int NSG = NT / 32;
    const int tid = thread_index_in_threadgroup;
    const uint lane = thread_index_in_simdgroup;
    const int sg = simdgroup_index_in_threadgroup;
    const int b = threadgroup_position_in_grid.z;     // ref: for b
    const int kvh = threadgroup_position_in_grid.y / S;   // ref: for kvh
    const int s = threadgroup_position_in_grid.y % S;     // ref: for s
    const int C = context_lens[b];

    // [1] ref: lo0, j0, j1: the rows see keys within [lo0, C - 1]; this split's blocks
    const int lo0 = first_key(C - QL, W, CH);
    const int j0 = lo0 / BS + s * PB;
    const int j1 = metal::min(j0 + PB, (C - 1) / BS + 1);

    // [2] ref: the rows r = sg + k * NSG of this simdgroup: their query (float), p, lo, state
    const int64_t q0 = (int64_t)(b * H + kvh * G) * QL;    // row r's query: (q0 + r) * D
    float qv[RPS][EPL];
    float acc[RPS][EPL];
    float m[RPS];
    float l[RPS];
    int p[RPS];
    int lo[RPS];
    for (int k = 0; k < RPS; ++k) {
        const int r = sg + k * NSG;
        p[k] = C - QL + r % QL;
        lo[k] = first_key(p[k], W, CH);
        m[k] = -1.0e30f;
        l[k] = 0.0f;
        for (int i = 0; i < EPL; ++i) {
            const int d = i * 32 + lane;
            qv[k][i] = (r < R && d < D) ? static_cast<float>(queries[(q0 + r) * D + d]) : 0.0f;
            acc[k][i] = 0.0f;
        }
    }

    for (int j = j0; j < j1; ++j) {                   // ref: for j
        const int64_t phys = block_tables[b * MAXB + j];
        for (int t0 = 0; t0 < BS; t0 += TK) {         // ref: for t0
            const int pos0 = j * BS + t0;
            if (pos0 + TK <= lo0 || pos0 > C - 1) {   // uniform over the threadgroup
                continue;
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);   // the last tile's readers are done
            // [3] ref: stage K and V of the tile's tokens in [lo0, C - 1], vector loads
            STAGE
            threadgroup_barrier(mem_flags::mem_threadgroup);

            // [4] ref: each row's scores over the tile (masked: MASKED, V unread)
            for (int k = 0; k < RPS; ++k) {
                if (sg + k * NSG >= R) {              // uniform over the simdgroup
                    break;
                }
                float st[TK];
                float m_tile = -1.0e30f;
                for (int t = 0; t < TK; ++t) {
                    const int pos = pos0 + t;
                    st[t] = -1.0e30f;
                    if (pos >= lo[k] && pos <= p[k]) {
                        float part = 0.0f;
                        for (int i = 0; i < EPL; ++i) {
                            const int d = i * 32 + lane;
                            if (d < D) {
                                part += qv[k][i] * tk[t * D + d];
                            }
                        }
                        float x = simd_sum(part) * sc;
                        if (cap > 0.0f) {             // ref: s = tanh(s / cap) * cap
                            x = metal::precise::tanh(x / cap) * cap;
                        }
                        st[t] = x;
                    }
                    m_tile = metal::max(m_tile, st[t]);
                }
                // [5] ref: online softmax, once per tile
                const float m_new = metal::max(m[k], m_tile);
                const float corr = metal::exp(m[k] - m_new);
                l[k] *= corr;
                for (int i = 0; i < EPL; ++i) {
                    acc[k][i] *= corr;
                }
                for (int t = 0; t < TK; ++t) {
                    const int pos = pos0 + t;
                    if (pos >= lo[k] && pos <= p[k]) {
                        const float pt = metal::exp(st[t] - m_new);
                        l[k] += pt;
                        for (int i = 0; i < EPL; ++i) {
                            const int d = i * 32 + lane;
                            if (d < D) {
                                acc[k][i] += pt * tv[t * D + d];
                            }
                        }
                    }
                }
                m[k] = m_new;
            }
        }
    }

    // [6] ref: one pass: merge with the sink and write; split: the partial state (acc, m, l) for pass 2
    for (int k = 0; k < RPS; ++k) {
        const int r = sg + k * NSG;
        if (r >= R) {
            break;
        }
        if (SPLIT) {
            const int64_t o = ((q0 + r) * S + s) * (D + 2);   // partials (B, H, QL, S, D + 2)
            for (int i = 0; i < EPL; ++i) {
                const int d = i * 32 + lane;
                if (d < D) {
                    out[o + d] = acc[k][i];
                }
            }
            if (lane == 0) {
                out[o + D] = m[k];
                out[o + D + 1] = l[k];
            }
        } else {
            const float sink = sinks[kvh * G + r / QL];   // MASKED without sinks: adds exp(-1e30) = 0
            const float M = metal::max(m[k], sink);
            const float w = metal::exp(m[k] - M);
            const float L = l[k] * w + metal::exp(sink - M);
            for (int i = 0; i < EPL; ++i) {
                const int d = i * 32 + lane;
                if (d < D) {
                    out[(q0 + r) * D + d] = static_cast<T>(acc[k][i] * w / L);
                }
            }
        }
    }
"""

FLOAT_STAGE = """const int64_t NS = k_pool_shape[1];          // slots per head: num_blocks * BS
            const int64_t base = (kvh * NS + phys * BS + t0) * D;
            for (int v = tid; v < TK * (D / 4); v += NT) {
                const int t = v / (D / 4);
                const int c = (v % (D / 4)) * 4;
                const int pos = pos0 + t;
                if (pos >= lo0 && pos <= C - 1) {
                    const auto kx = kv_vec4(k_pool, base + t * D + c);
                    const auto vx = kv_vec4(v_pool, base + t * D + c);
                    for (int e = 0; e < 4; ++e) {
                        tk[t * D + c + e] = static_cast<float>(kx[e]);
                        tv[t * D + c + e] = static_cast<float>(vx[e]);
                    }
                }
            }"""

# MLX's affine quantisation (macinfer.kv.paged_attention.QuantPool): a uint4 of codes (4 words,
# 4 * PER elements, within one group since 4 * PER <= 32 <= GS) and its group's scale and bias.
QUANT_STAGE = """constexpr int PER = 32 / BITS;                // codes per uint32 word, lowest bits first
            constexpr int WPS = D / PER;                // words per slot
            constexpr int GPS = D / GS;                 // scales (biases) per slot
            constexpr uint MASK = (1u << BITS) - 1u;
            const int64_t NS = k_codes_shape[1];        // slots per head: num_blocks * BS
            const int64_t slot0 = kvh * NS + phys * BS + t0;
            for (int v = tid; v < TK * (WPS / 4); v += NT) {
                const int t = v / (WPS / 4);
                const int w = (v % (WPS / 4)) * 4;
                const int pos = pos0 + t;
                if (pos >= lo0 && pos <= C - 1) {
                    const int64_t slot = slot0 + t;
                    const int d0 = w * PER;
                    const auto kc = kv_vec4(k_codes, slot * WPS + w);
                    const auto vc = kv_vec4(v_codes, slot * WPS + w);
                    const float ks = static_cast<float>(kv_one(k_scales, slot * GPS + d0 / GS));
                    const float kb = static_cast<float>(kv_one(k_biases, slot * GPS + d0 / GS));
                    const float vs = static_cast<float>(kv_one(v_scales, slot * GPS + d0 / GS));
                    const float vb = static_cast<float>(kv_one(v_biases, slot * GPS + d0 / GS));
                    for (int e = 0; e < 4; ++e) {
                        for (int c = 0; c < PER; ++c) {
                            const int d = d0 + e * PER + c;
                            tk[t * D + d] = ks * static_cast<float>((kc[e] >> (c * BITS)) & MASK) + kb;
                            tv[t * D + d] = vs * static_cast<float>((vc[e] >> (c * BITS)) & MASK) + vb;
                        }
                    }
                }
            }"""

# Pass 2: one simdgroup per query row reduces its S partial states (ref: [6]).
# Launch: grid (32, H * QL, B), threadgroup (32, 1, 1). Template parameters: T, D.
REDUCE_SOURCE = """
    constexpr int EPL = (D + 31) / 32;
    const int H = partials_shape[1];
    const int QL = partials_shape[2];
    const int S = partials_shape[3];
    const uint lane = thread_index_in_simdgroup;
    const int b = threadgroup_position_in_grid.z;
    const int row = threadgroup_position_in_grid.y;  // h * QL + qi
    const int64_t base = (int64_t)(b * H * QL + row) * S * (D + 2);
    const float sink = sinks[row / QL];
    // [6] ref: M = max(m_s, sink), L = sum w_s l_s + exp(sink - M), out = sum w_s acc_s / L
    float M = sink;
    for (int s = lane; s < S; s += 32) {
        M = metal::max(M, partials[base + s * (D + 2) + D]);
    }
    M = simd_max(M);
    float L = 0.0f;
    for (int s = lane; s < S; s += 32) {
        L += partials[base + s * (D + 2) + D + 1] * metal::exp(partials[base + s * (D + 2) + D] - M);
    }
    L = simd_sum(L) + metal::exp(sink - M);
    float acc[EPL];
    for (int i = 0; i < EPL; ++i) {
        acc[i] = 0.0f;
    }
    for (int s = 0; s < S; ++s) {
        const float w = metal::exp(partials[base + s * (D + 2) + D] - M);
        for (int i = 0; i < EPL; ++i) {
            const int d = i * 32 + lane;
            if (d < D) {
                acc[i] += partials[base + s * (D + 2) + d] * w;
            }
        }
    }
    for (int i = 0; i < EPL; ++i) {
        const int d = i * 32 + lane;
        if (d < D) {
            out[(int64_t)(b * H * QL + row) * D + d] = static_cast<T>(acc[i] / L);
        }
    }
"""

PASS1_SOURCE = _PASS1.replace("STAGE", FLOAT_STAGE).replace("KV_HEADS", "k_pool_shape[0]")
QUANT_PASS1_SOURCE = _PASS1.replace("STAGE", QUANT_STAGE).replace("KV_HEADS", "k_codes_shape[0]")

_TAIL = ("block_tables", "context_lens", "iparams", "fparams", "sinks")
INPUT_NAMES = ("queries", "k_pool", "v_pool", *_TAIL)
QUANT_INPUT_NAMES = ("queries", "k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases", *_TAIL)
REDUCE_INPUT_NAMES = ("partials", "sinks")
