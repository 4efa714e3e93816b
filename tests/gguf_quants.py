"""A reference quantiser for the GGML types the `gguf` package can read but not write (K-quants, IQ4).

Plain round-to-nearest with min/max scales, written from the block layouts of gguf's own
dequantisers (`gguf.quants.Q4_K.dequantize_blocks` ...), independent of macinfer's converter.
`quantize(x, "Q4_K")` returns the uint8 blocks `GGUFWriter.add_tensor(..., raw_dtype=...)`
writes; the tests' oracle is `gguf.quants.dequantize` of those same blocks. Types gguf quantises
itself (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, BF16) go to `gguf.quants.quantize`.

The quality is llama.cpp's without its search for better scales: good enough to re-encode
real weights (scripts/bench/gguf_decode.py) and keep a model answering.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, quants

IQ4_VALUES = np.array(quants.IQ4_NL.kvalues, dtype=np.float32)


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """x (..., cols) float -> GGML blocks (..., bytes per row) of `type_name`."""
    x = np.asarray(x, dtype=np.float32)
    if type_name in _OURS:
        block = 256 if type_name not in ("IQ4_NL",) else 32
        blocks = _OURS[type_name](x.reshape(-1, block))
        return blocks.reshape(*x.shape[:-1], -1)
    return quants.quantize(x, GGMLQuantizationType[type_name])


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)


def _bytes(v: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(v).view(np.uint8).reshape(v.shape[0], -1)


def _div(a, b):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0)


def _scales_mins(x: np.ndarray, levels: int, sub: int, scale_levels: int):
    """Per sub-block (min/max): 6- or 4-bit scale and min indices, and the two fp16 super-scales."""
    n = x.shape[0]
    xs = x.reshape(n, -1, sub)
    lo = np.minimum(xs.min(-1), 0)
    scale = (xs.max(-1) - lo) / levels
    d = _f16(scale.max(-1, keepdims=True) / scale_levels)
    dmin = _f16((-lo).max(-1, keepdims=True) / scale_levels)
    sc = np.clip(np.round(_div(scale, d.astype(np.float32))), 0, scale_levels).astype(np.uint8)
    m = np.clip(np.round(_div(-lo, dmin.astype(np.float32))), 0, scale_levels).astype(np.uint8)
    step = d.astype(np.float32) * sc
    offset = dmin.astype(np.float32) * m
    q = np.clip(np.round(_div(xs + offset[..., None], step[..., None])), 0, levels).astype(np.uint8)
    return q.reshape(n, -1), sc, m, d, dmin


def _k_scale_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 bytes gguf.quants.Q4_K.get_scale_min unpacks into 8 six-bit scales and mins."""
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    second = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([first, second, third], axis=1).astype(np.uint8)


def _low_nibbles_k(q: np.ndarray) -> np.ndarray:
    """8 sub-blocks of 32 -> 4 chunks of 32 bytes: sub-block 2c in the low nibbles, 2c+1 high."""
    q = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k(x):
    q, sc, m, d, dmin = _scales_mins(x, 15, 32, 63)
    return np.concatenate([_bytes(d), _bytes(dmin), _k_scale_bytes(sc, m), _low_nibbles_k(q)], axis=1)


def _q5_k(x):
    q, sc, m, d, dmin = _scales_mins(x, 31, 32, 63)
    high = (q >> 4).reshape(-1, 8, 32)
    qh = np.zeros((x.shape[0], 32), dtype=np.uint8)
    for i in range(8):
        qh |= high[:, i] << i
    return np.concatenate([_bytes(d), _bytes(dmin), _k_scale_bytes(sc, m), qh, _low_nibbles_k(q)], axis=1)


def _q2_k(x):
    q, sc, m, d, dmin = _scales_mins(x, 3, 16, 15)
    q = q.reshape(-1, 2, 4, 32)  # flat index h*128 + t*32 + j: bits 2t of byte h*32 + j
    qs = (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([sc | (m << 4), qs, _bytes(d), _bytes(dmin)], axis=1)


def _symmetric(x: np.ndarray, sub: int, half: int, scale_max: int, signed_scale: bool):
    """Per sub-block: integer scales sc (|sc| <= scale_max) of one fp16 d; q in [-half, half-1]."""
    n = x.shape[0]
    xs = x.reshape(n, -1, sub)
    s = np.abs(xs).max(-1) / half
    d = _f16(s.max(-1, keepdims=True) / scale_max)
    sc = np.clip(np.round(_div(s, d.astype(np.float32))), 0, scale_max)
    step = d.astype(np.float32) * sc
    q = np.clip(np.round(_div(xs, step[..., None])), -half, half - 1).astype(np.int16)
    return q.reshape(n, -1), sc.astype(np.int16), d


def _q6_k(x):
    q, sc, d = _symmetric(x, 16, 32, 127, True)
    q = (q + 32).astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128
    low, high = q & 0x0F, q >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)
    h = high.reshape(-1, 2, 4, 32)
    qh = (h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _bytes(d)], axis=1)


def _q3_k(x):
    q, sc, d = _symmetric(x, 16, 4, 31, True)
    low = (q & 3).astype(np.uint8).reshape(-1, 2, 4, 32)  # q in [-4, 3]: low 2 bits, and bit 2 unset when q < 0
    qs = (low[:, :, 0] | (low[:, :, 1] << 2) | (low[:, :, 2] << 4) | (low[:, :, 3] << 6)).reshape(-1, 64)
    hbit = (q >= 0).astype(np.uint8).reshape(-1, 8, 32)
    hmask = np.zeros((x.shape[0], 32), dtype=np.uint8)
    for t in range(8):
        hmask |= hbit[:, t] << t
    u = (sc + 32).astype(np.uint8)  # 16 six-bit scales
    scales = np.concatenate([(u[:, :8] & 0x0F) | ((u[:, 8:] & 0x0F) << 4),
                             sum(((u[:, t * 4:(t + 1) * 4] >> 4) & 3) << (2 * t) for t in range(4)).astype(np.uint8)],
                            axis=1)
    return np.concatenate([hmask, qs, scales, _bytes(d)], axis=1)


def _nearest_iq4(v: np.ndarray) -> np.ndarray:
    return np.abs(v[..., None] - IQ4_VALUES).argmin(-1).astype(np.uint8)


def _iq4_nl(x):
    d = _f16(np.abs(x).max(-1, keepdims=True) / 127)
    idx = _nearest_iq4(_div(x, d.astype(np.float32)))
    return np.concatenate([_bytes(d), idx[:, :16] | (idx[:, 16:] << 4)], axis=1)


def _iq4_xs(x):
    n = x.shape[0]
    xs = x.reshape(n, 8, 32)
    s = np.abs(xs).max(-1) / 127
    d = _f16(s.max(-1, keepdims=True) / 31)
    sc = np.clip(np.round(_div(s, d.astype(np.float32))), 0, 31).astype(np.int16)
    idx = _nearest_iq4(_div(xs, (d.astype(np.float32) * sc)[..., None]))
    qs = (idx[:, :, :16] | (idx[:, :, 16:] << 4)).reshape(n, 128)
    u = (sc + 32).astype(np.uint16)
    high = sum(((u[:, i] >> 4) & 3) << (2 * i) for i in range(8)).astype(np.uint16).reshape(n, 1)
    low = ((u[:, 0::2] & 0x0F) | ((u[:, 1::2] & 0x0F) << 4)).astype(np.uint8)
    return np.concatenate([_bytes(d), _bytes(high), low, qs], axis=1)


_OURS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "Q3_K": _q3_k, "Q2_K": _q2_k, "IQ4_NL": _iq4_nl,
         "IQ4_XS": _iq4_xs}
