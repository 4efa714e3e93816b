"""A prefix-cache block file: one block's K/V in every layer as one safetensors tensor of bytes.

    header   little-endian u64 N, then N bytes of JSON:
             {"__metadata__": {format, model_id, block_hash, token_ids, layout, crc32, saved_at},
              "kv": {"dtype": "U8", "shape": [block bytes], "data_offsets": [0, block bytes]}}
    data     the pools' parts back to back, k.0 v.0 k.1 v.1 ..., as `layout` lists them:
             [["k.0", [bs, H, Dk], "float32"], ["v.0", [bs, H, Dv], "float32"], ...]

NOTE: each part is token-major, (block_size, n_kv_heads, head_dim), whatever the in-memory pool
layout is (the pools are head-major slots, macinfer.kv.paged_attention): `part_into_pool` and
`slots_into_part` transpose. Changing what a file holds needs a FORMAT bump.

Files are written with MLX's safetensors writer and read here (the header, then the data in
one read straight into the caller's buffer), so any safetensors reader can inspect them.
macinfer.prefix_cache.disk keeps the files of a model and checks the metadata.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

FORMAT = "macinfer-prefix-block/3"  # /3: one tensor of the block's bytes (read whole), a CRC-32 of them
MAX_HEADER = 1 << 20  # a safetensors header larger than this is not one of ours


class BadFile(ValueError):
    """A block file that must not be used; the message says why."""


@dataclass(frozen=True)
class PoolPart:
    """Where one pool's rows of a block sit in the block's bytes."""

    name: str  # "k.3", "v.3"
    offset: int  # bytes
    shape: tuple[int, int, int]  # (block_size, n_kv_heads, head_dim)
    dtype: mx.Dtype

    @property
    def nbytes(self) -> int:
        bs, h, d = self.shape
        return bs * h * d * self.dtype.size


def block_layout(caches: list, block_size: int) -> list[PoolPart]:
    """Every pool's part of a block file, k.0 v.0 k.1 v.1 ..., back to back."""
    parts, offset = [], 0
    for i, c in enumerate(caches):
        for kind, pool in (("k", c.k_pool), ("v", c.v_pool)):
            part = PoolPart(f"{kind}.{i}", offset, (block_size, pool.shape[0], pool.shape[2]), pool.dtype)
            parts.append(part)
            offset += part.nbytes
    return parts


def layout_json(parts: list[PoolPart]) -> str:
    return json.dumps([[p.name, list(p.shape), str(p.dtype).rsplit(".", 1)[-1]] for p in parts])


def read_header(f) -> dict:
    """A safetensors file's header: a little-endian u64 N, then N bytes of JSON (the data follows).

    Raises:
        BadFile: truncated, or not a safetensors header.
    """
    raw = f.read(8)
    n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
    if not 0 < n <= MAX_HEADER:
        raise BadFile("unreadable (not a safetensors file)")
    try:
        header = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError):
        raise BadFile("unreadable (its header is not JSON)") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise BadFile("unreadable (no metadata)")
    return header


def read_exactly(f, out: memoryview) -> None:
    """Fill `out` from f (one read for a regular file); BadFile if the file ends first."""
    got = 0
    while got < len(out):
        n = f.readinto(out[got:])
        if not n:
            raise BadFile("truncated")
        got += n


def check_tensor(header: dict, block_bytes: int) -> None:
    """Raise BadFile unless the header's one tensor is `block_bytes` bytes, from the start of the data."""
    tensor = header.get("kv")
    if (len(header) != 2 or not isinstance(tensor, dict) or tensor.get("dtype") != "U8"
            or tensor.get("shape") != [block_bytes] or tensor.get("data_offsets") != [0, block_bytes]):
        raise BadFile("unexpected tensors")


def slot_runs(block_ids: list[int], block_size: int) -> list[tuple[int, int, int]]:
    """Runs of consecutive block ids as (first pool slot, first of the blocks' rows, slots).

    Example:
        >>> slot_runs([4, 5, 6, 9], 16)
        [(64, 0, 48), (144, 48, 16)]
    """
    runs: list[list[int]] = []
    for j, b in enumerate(block_ids):
        if runs and b * block_size == runs[-1][0] + runs[-1][2]:
            runs[-1][2] += block_size
        else:
            runs.append([b * block_size, j * block_size, block_size])
    return [tuple(r) for r in runs]


def part_into_pool(buf: np.ndarray, part: PoolPart, pool: np.ndarray, runs: list[tuple[int, int, int]]) -> None:
    """Write one pool's part of n blocks' bytes (n, block_bytes) into the pool's slots, run by run.

    Args:
        pool: a numpy view (H, slots, D) of the pool's memory, as unsigned ints of its dtype's size.
        runs: slot_runs of the blocks' ids.

    NOTE: one strided copy per run, numpy from the file's buffer straight into the pool's memory:
    no MLX array in between (docs/platform.md#cpu-strided: MLX's own slice, view, transpose and
    write of the same bytes took 0.25-3.3 s for a 2,000-token SmolLM2 prefix, and each new MLX
    buffer of the size of a pool's part page-faults its way in).
    """
    n, (bs, h, d) = buf.shape[0], part.shape
    blocks = buf[:, part.offset: part.offset + part.nbytes].view(f"u{part.dtype.size}").reshape(n, bs, h, d)
    for first_slot, row, length in runs:
        dst = pool[:, first_slot: first_slot + length].reshape(h, length // bs, bs, d)  # a view: splits one axis
        dst[...] = blocks[row // bs: (row + length) // bs].transpose(2, 0, 1, 3)


def slots_into_part(x: np.ndarray, part: PoolPart, out: np.ndarray) -> None:
    """Write pool slots (H, n * bs, D * itemsize) uint8 into one pool's part of n blocks' bytes `out`."""
    n, (bs, h, d) = out.shape[0], part.shape
    blocks = x.view(f"u{part.dtype.size}").reshape(h, n, bs, d).transpose(1, 2, 0, 3)  # (n, bs, H, D)
    out[:, part.offset: part.offset + part.nbytes].view(f"u{part.dtype.size}").reshape(n, bs, h, d)[...] = blocks
