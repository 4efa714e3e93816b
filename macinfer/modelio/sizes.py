"""A model's size on disk and in bits per weight, and its quantisation in a few characters.

Bits per weight (bpw) is mlx-lm's definition: all tensor bytes (packed weights,
scales, biases, norms) x 8 / the parameter count of the unquantised model.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path


def weight_bytes(path: Path) -> int:
    """Bytes of tensor data in a model directory's safetensors (headers excluded).

    Args:
        path: a model directory holding model*.safetensors.

    Returns:
        The sum of every tensor's data size; 0 if there are no safetensors files.
    """
    total = 0
    for f in sorted(Path(path).glob("model*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


def bits_per_weight(nbytes: int, num_params: int) -> float:
    """Bits per weight of `nbytes` of tensors for a model of `num_params` parameters.

    Args:
        nbytes: tensor bytes (packed weights, scales, biases, float layers).
        num_params: the parameter count of the unquantised model.

    Returns:
        8 * nbytes / num_params.
    """
    return 8 * nbytes / num_params


def describe(quantization: dict | None) -> str:
    """A config's quantisation in a few characters.

    Args:
        quantization: the config's `quantization` section, or None.

    Returns:
        '4-bit g64', '4/6/8-bit g64' (mixed) or 'float'.
    """
    if not quantization or "bits" not in quantization:
        return "float"
    per_layer = {v["bits"] for v in quantization.values() if isinstance(v, dict) and "bits" in v}
    bits = sorted(per_layer | {quantization["bits"]})
    return f"{'/'.join(map(str, bits))}-bit g{quantization.get('group_size', 64)}"
