"""One GGUF tensor as MLX arrays: kept exactly where an MLX format holds its values, else re-quantised.

MLX's affine format stores a row in groups of 32 as `w = scale * q + bias` (q: 2-8 bits);
its `mxfp4` mode is the OCP microscaling format. GGML's types map onto them as follows
(block layouts from the `gguf` package's own dequantisers, `gguf.quants`):

| GGML | values | MLX (group 32) |
|---|---|---|
| Q4_0, Q4_1 | d*(q-8), d*q+m | affine 4-bit: exact |
| Q5_0, Q5_1 | d*(q-16), d*q+m | affine 5-bit: exact |
| Q8_0 | d*q, q int8 | affine 8-bit (q+128, bias -128d): exact |
| Q4_K, Q5_K | (d*sc)*q - dmin*m per 32 | affine 4/5-bit, scale d*sc, bias -dmin*m: exact in float32 |
| Q3_K | d * sc*(q-4): integers in [-128, 128] per 256 | affine 8-bit, scale d: exact |
| IQ4_NL, IQ4_XS | d' * kvalue, kvalue in [-127, 113] | affine 8-bit, scale d': exact (see NOTE) |
| MXFP4 | e8m0 * e2m1 | mxfp4: exact (nibbles re-packed) |
| Q6_K, Q2_K | two scales per group of 32 (sub-blocks of 16) | re-quantised: affine 8-bit / 4-bit |
| IQ1/IQ2/IQ3, TQ, NVFP4 | grids, ternary, fp4 with e4m3 scales | re-quantised (REQUANT_BITS) |
| F32, F16, BF16 | floats | kept as they are |

NOTE: "exact" is checked, not assumed: every tensor's MLX dequantisation (`mx.dequantize`)
is compared with gguf's own (`gguf.quants.dequantize`) and the largest and mean absolute
difference are reported (`MLXTensor.max_err`, `mean_err`); kept means both are 0. Scales and
biases are float16 where float16 holds every one of them exactly (Q4_0 ... Q8_0), else float32:
d*sc of a K-quant has up to 17 significant bits, which float16 (11) and bfloat16 (8) round.
Q6_K's and Q2_K's two scales per group of 32 cannot be one affine group (MLX has no group 16),
so they are re-quantised from gguf's dequantisation, and the error is what the report says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, quants

from macinfer.errors import MacinferError

GROUP_SIZE = 32
FLOAT_TYPES = ("F32", "F16", "BF16")
EXACT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5,
              "Q3_K": 8, "IQ4_NL": 8, "IQ4_XS": 8}
# Not representable as one MLX group: re-quantised to MLX affine with this many bits (at
# least two more than the type's own, so the added error is small beside the type's).
REQUANT_BITS = {"Q6_K": 8, "Q2_K": 4, "IQ2_XXS": 4, "IQ2_XS": 4, "IQ2_S": 4, "IQ3_XXS": 5, "IQ3_S": 5,
                "IQ1_S": 3, "IQ1_M": 3, "TQ1_0": 4, "TQ2_0": 4, "NVFP4": 6}
SUPPORTED = (*FLOAT_TYPES, *EXACT_BITS, "MXFP4", *REQUANT_BITS)
_CHUNK_ELEMENTS = 1 << 24  # rows converted at a time: ~64 MB of float32 for the check


@dataclass
class MLXTensor:
    """A tensor in MLX form: `arrays` by suffix ("weight", "scales", "biases"), and how it got there."""

    arrays: dict  # suffix -> mx.array
    source_type: str
    quant: dict | None = None  # mlx-lm's per-module entry: {"group_size", "bits", "mode"}
    kept_exactly: bool = True
    max_err: float = 0.0
    mean_err: float = 0.0
    notes: list[str] = field(default_factory=list)


def check_type(src: Path, name: str, type_name: str) -> None:
    """Refuse, naming the tensor, a GGML type this module cannot turn into MLX arrays."""
    if type_name not in SUPPORTED:
        raise MacinferError(f"{src}: tensor '{name}' has type {type_name}, which is not supported "
                            f"(supported: {', '.join(SUPPORTED)}): use another quantisation of the model")


def to_mlx(tensor, src: Path) -> MLXTensor:
    """Convert one `GGUFTensor` (macinfer.modelio.gguf_file) to MLX arrays.

    Args:
        tensor: its type, numpy-order shape and block data (a view into the mapped file).
        src: the file, for errors.

    Returns:
        The MLXTensor; quantised ones carry `quant` for config.json's `quantization`.
    """
    import mlx.core as mx

    check_type(src, tensor.name, tensor.type_name)
    if tensor.type_name == "F32":
        return MLXTensor({"weight": mx.array(np.asarray(tensor.data, dtype=np.float32))}, "F32")
    if tensor.type_name == "F16":
        return MLXTensor({"weight": mx.array(np.asarray(tensor.data, dtype=np.float16))}, "F16")
    if tensor.type_name == "BF16":
        bits = np.ascontiguousarray(tensor.data).view(np.uint16).reshape(tensor.shape)
        return MLXTensor({"weight": mx.array(bits).view(mx.bfloat16)}, "BF16")
    if tensor.shape[-1] % GROUP_SIZE:
        raise MacinferError(f"{src}: tensor '{tensor.name}' rows of {tensor.shape[-1]} are not a multiple of "
                            f"{GROUP_SIZE}: not supported")
    return _blocks_to_mlx(tensor)


def _blocks_to_mlx(tensor) -> MLXTensor:
    """Row chunks packed (or re-quantised), each checked against gguf's dequantisation."""
    import mlx.core as mx

    qtype = GGMLQuantizationType[tensor.type_name]
    rows = tensor.data.reshape(-1, tensor.data.shape[-1])
    cols = tensor.shape[-1]
    step = max(1, _CHUNK_ELEMENTS // cols)
    parts: dict[str, list] = {}
    max_err, abs_sum = 0.0, 0.0
    mode, bits = "affine", EXACT_BITS.get(tensor.type_name) or REQUANT_BITS.get(tensor.type_name, 4)
    for start in range(0, rows.shape[0], step):
        chunk = np.ascontiguousarray(rows[start:start + step])
        reference = quants.dequantize(chunk, qtype).reshape(chunk.shape[0], cols)
        if tensor.type_name == "MXFP4":
            mode, arrays = "mxfp4", _mxfp4(chunk, cols)
        else:
            packed = _pack_exact(tensor.type_name, chunk, cols, reference)
            if packed is None:  # not exact as one group of 32: re-quantise what gguf dequantises
                packed = mx.quantize(mx.array(reference), group_size=GROUP_SIZE, bits=bits)
            arrays = dict(zip(("weight", "scales", "biases"), packed))
        got = mx.dequantize(*arrays.values(), group_size=GROUP_SIZE, bits=bits, mode=mode)
        err = mx.abs(got.astype(mx.float32) - mx.array(reference))
        max_err = max(max_err, err.max().item())
        abs_sum += err.sum().item()
        for k, v in arrays.items():
            parts.setdefault(k, []).append(v)
    lead = tensor.shape[:-1]
    out = {k: mx.concatenate(v, axis=0).reshape(*lead, -1) for k, v in parts.items()}
    if mode == "affine" and _fits_half(out["scales"]) and _fits_half(out["biases"]):
        out["scales"], out["biases"] = out["scales"].astype(mx.float16), out["biases"].astype(mx.float16)
    exact = max_err == 0.0
    return MLXTensor(out, tensor.type_name, {"group_size": GROUP_SIZE, "bits": 4 if mode == "mxfp4" else bits,
                                             "mode": mode}, exact, max_err, abs_sum / max(1, tensor.n_elements))


def _fits_half(a) -> bool:
    """float16 holds every value exactly (K-quant scales d*sc need up to 17 significant bits: no)."""
    import mlx.core as mx

    return mx.array_equal(a.astype(mx.float16).astype(mx.float32), a).item()


# -- exact packings -------------------------------------------------------------------------
def _pack_exact(type_name: str, chunk: np.ndarray, cols: int, reference: np.ndarray):
    """(weight, scales, biases) as MLX affine arrays holding exactly gguf's values, or None."""
    import mlx.core as mx

    blocks = chunk.reshape(-1, quants.GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1])
    if type_name in _DECODERS:
        q, scale, bias = _DECODERS[type_name](blocks)
    elif type_name in _GROUP_SCALE:
        decoded = _integers(reference.reshape(-1, GROUP_SIZE), _GROUP_SCALE[type_name](blocks))
        if decoded is None:
            return None
        q, scale, bias = decoded
    else:
        return None
    rows = chunk.shape[0]
    bits = EXACT_BITS[type_name]
    weight = _pack_bits(q.reshape(rows, cols), bits)
    return (mx.array(weight), mx.array(scale.reshape(rows, -1).astype(np.float32)),
            mx.array(bias.reshape(rows, -1).astype(np.float32)))


def _pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """MLX's affine packing: each row's values as one little-endian bit stream, read as uint32."""
    planes = (q[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    return np.packbits(planes.reshape(q.shape[0], -1), axis=-1, bitorder="little").view(np.uint32)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: low nibbles are elements 0-15, high nibbles 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(b):
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:18]), d, -8 * d


def _q4_1(b):
    return _nibbles(b[:, 4:20]), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes -> bit j is element j's fifth bit."""
    return (np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)).astype(np.uint8) & 1


def _q5_0(b):
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 6:22]) | (_high_bits(b[:, 2:6]) << 4), d, -16 * d


def _q5_1(b):
    return _nibbles(b[:, 8:24]) | (_high_bits(b[:, 4:8]) << 4), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q8_0(b):
    d = _f16(b[:, 0:2])
    return (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, -128 * d


def _k_scales(b):
    """Q4_K / Q5_K: per sub-block of 32, scale d*sc and bias -dmin*m (float32, as gguf computes them)."""
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = quants.Q4_K.get_scale_min(b[:, 4:16])
    return (d * sc.astype(np.float32)).reshape(n, 8), -(dmin * m.astype(np.float32)).reshape(n, 8)


def _q4_k(b):
    # 4 chunks of 32 bytes; a chunk's low nibbles are sub-block 2c, its high nibbles 2c+1.
    qs = b[:, 16:144].reshape(-1, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)
    return (q, *_k_scales(b))


def _q5_k(b):
    qs = b[:, 48:176].reshape(-1, 4, 1, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    high = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return ((low | (high << 4)).reshape(-1, 256), *_k_scales(b))


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k,
             "Q5_K": _q5_k}


# Types whose values are (scale of a group of 32) x (small integer): the scale per group.
def _q3_k_scale(b):
    return np.repeat(_f16(b[:, 108:110]), 8, axis=1)  # one d per 256: the last 2 of 110 bytes


def _iq4_nl_scale(b):
    return _f16(b[:, 0:2])


def _iq4_xs_scale(b):
    # As gguf.quants.IQ4_XS: 6-bit scales, low 4 bits in bytes 4-7, high 2 bits in the uint16 at 2.
    d = _f16(b[:, 0:2])
    high = (np.ascontiguousarray(b[:, 2:4]).view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3
    low = (b[:, 4:8].reshape(-1, 4, 1) >> np.array([0, 4], dtype=np.uint8)).reshape(-1, 8) & 0x0F
    return d * ((low | (high.astype(np.uint8) << 4)).astype(np.int16) - 32).astype(np.float32)


_GROUP_SCALE = {"Q3_K": _q3_k_scale, "IQ4_NL": _iq4_nl_scale, "IQ4_XS": _iq4_xs_scale}


def _integers(values: np.ndarray, scale: np.ndarray):
    """values (groups, 32) = scale (groups,) x integers -> (q, scale, bias) for 8-bit affine, or None.

    NOTE: value / scale is exact when value is scale times a small integer (IEEE division
    rounds the exact quotient, which is representable); a group whose quotients are not
    integers, or span more than 255, means the file is not what its type says: None.
    """
    scale = scale.reshape(-1, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.where(scale != 0, values / np.where(scale != 0, scale, 1), 0)
    if not np.array_equal(k, np.round(k)):
        return None
    low = k.min(axis=1, keepdims=True)
    if (k.max(axis=1, keepdims=True) - low).max(initial=0) > 255:
        return None
    return (k - low).astype(np.uint8), scale, scale * low


# -- MXFP4 ----------------------------------------------------------------------------------
def _mxfp4(chunk: np.ndarray, cols: int) -> dict:
    """GGUF MXFP4 blocks (e8m0 byte, 16 bytes: element j low nibble, j+16 high) as MLX mxfp4 arrays.

    Both store the e2m1 code (sign bit 3) and the e8m0 exponent; MLX packs elements in
    order, 8 per uint32, low nibble first.
    """
    import mlx.core as mx

    rows = chunk.shape[0]
    b = chunk.reshape(-1, 17)
    codes = _nibbles(b[:, 1:17]).reshape(rows, cols)
    scales = np.ascontiguousarray(b[:, 0]).reshape(rows, -1)
    return {"weight": mx.array(_pack_bits(codes, 4)), "scales": mx.array(scales)}
