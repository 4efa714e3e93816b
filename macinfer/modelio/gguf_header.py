"""A GGUF file's header: metadata and tensor table, parsed without reading tensor data.

`mx.load` silently dequantises tensor types it does not keep (K-quants, BF16 ...) to
float16, so the converter (macinfer.modelio.gguf) reads the header here first to see
each tensor's real type and to refuse what is not supported, by name, before any work.
`data_end` lets it tell a truncated file from a complete one.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from macinfer.errors import MacinferError

GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
    22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}
# Supported type -> (bytes per block, elements per block); used to check file size.
BLOCK_LAYOUT = {"F32": (4, 1), "F16": (2, 1), "Q4_0": (18, 32), "Q4_1": (20, 32), "Q8_0": (34, 32)}

# GGUF metadata value types -> struct format (8 = string, 9 = array).
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass
class GGUFHeader:
    """What a GGUF file declares before its tensor data."""

    version: int
    metadata: dict[str, Any]
    tensor_types: dict[str, str]  # tensor name -> GGML type name ("Q4_1", "F32", "type 99")
    tensor_shapes: dict[str, tuple[int, ...]]  # GGUF order: ne0 (columns) first
    data_end: int  # byte offset where the last tensor's data ends (supported types only)


class _Reader:
    """Little-endian cursor over the mapped file; running off the end means truncated."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        if self.pos + n > len(self.buf):
            raise struct.error("string past end of file")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            atype, n = self.scalar("I"), self.scalar("Q")
            if atype in _SCALAR:
                size = struct.calcsize(_SCALAR[atype])
                if self.pos + n * size > len(self.buf):
                    raise struct.error("array past end of file")
                values = list(struct.unpack_from(f"<{n}{_SCALAR[atype]}", self.buf, self.pos))
                self.pos += n * size
                return values
            if n > len(self.buf):  # each element takes at least a byte: corrupt count
                raise struct.error("array length larger than the file")
            return [self.value(atype) for _ in range(n)]
        raise ValueError(f"unknown metadata value type {vtype}")


def read_header(path: str | Path) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table (no tensor data is read).

    Args:
        path: the .gguf file.

    Returns:
        Its GGUFHeader: version, metadata, each tensor's type and shape, where the data ends.

    Raises:
        MacinferError: the file is missing, not GGUF, or its header is truncated.
    """
    path = Path(path)
    if path.is_dir():
        raise MacinferError(f"{path} is a directory, not a GGUF file")
    if not path.is_file():
        raise MacinferError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise MacinferError(f"{path} is empty, not a GGUF file: download or export it again")
        if os.fstat(f.fileno()).st_size < 24 or f.read(4) != b"GGUF":
            raise MacinferError(f"{path} is not a GGUF file (bad magic bytes): pass a .gguf model file")
        f.seek(0)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _parse(_Reader(buf), len(buf))
            except (struct.error, ValueError, OverflowError, MemoryError, RecursionError) as e:
                raise MacinferError(
                    f"{path} is a truncated or corrupt GGUF file ({e}): download or export it again"
                ) from None


def _parse(r: _Reader, file_size: int) -> GGUFHeader:
    r.pos = 4
    version = r.scalar("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}; only versions 2 and 3 are supported")
    n_tensors, n_kv = r.scalar("Q"), r.scalar("Q")
    if n_tensors > file_size or n_kv > file_size:
        raise ValueError("implausible tensor or metadata count")
    metadata = {}
    for _ in range(n_kv):
        key = r.string()
        metadata[key] = r.value(r.scalar("I"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.scalar("I")
        if n_dims > 8:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        shape = tuple(r.scalar("Q") for _ in range(n_dims))
        infos.append((name, shape, r.scalar("I"), r.scalar("Q")))
    alignment = int(metadata.get("general.alignment", 32)) or 32
    data_start = -(-r.pos // alignment) * alignment
    types, shapes, data_end = {}, {}, data_start
    for name, shape, ggml_type, offset in infos:
        tname = GGML_TYPES.get(ggml_type, f"type {ggml_type}")
        types[name], shapes[name] = tname, shape
        if tname in BLOCK_LAYOUT:
            block_bytes, block_elems = BLOCK_LAYOUT[tname]
            n = 1
            for d in shape:
                n *= d
            data_end = max(data_end, data_start + offset + n // block_elems * block_bytes)
    return GGUFHeader(version, metadata, types, shapes, data_end)
