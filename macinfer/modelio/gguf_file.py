"""A GGUF file opened with llama.cpp's own reader (the `gguf` package), or one line saying why not.

`gguf.GGUFReader` memory-maps the file: metadata become Python values here, and each
tensor's data stays a view into the mapping (its GGML blocks, never copied). What this
module adds is the user's error: a missing, empty, non-GGUF, truncated or corrupt file, a
split file, or a tensor of a GGML type the reader does not know is one MacinferError line
naming the file (and the tensor) and the problem.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from macinfer.errors import MacinferError

_KNOWN_TYPES = {int(t) for t in GGMLQuantizationType}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: its GGML type and its data as the reader maps it (no copy)."""

    name: str
    type_name: str  # "Q4_K", "F32", ...
    shape: tuple[int, ...]  # numpy order: rows first (GGUF stores ne0, the columns, first)
    data: np.ndarray  # uint8 blocks (..., bytes per row) for block types; values for float/int types

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    @property
    def n_bytes(self) -> int:
        return int(self.data.nbytes)


@dataclass
class GGUFFile:
    """What a GGUF file holds: its metadata and tensors (views into the mapped file)."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

    def arch_key(self, key: str, default: Any = None) -> Any:
        """`<architecture>.<key>` from the metadata (e.g. arch_key("block_count"))."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def type_summary(self) -> list[tuple[str, int, int]]:
        """(GGML type, tensors, bytes) per type, the most bytes first (what `show` prints)."""
        count: Counter[str] = Counter()
        size: Counter[str] = Counter()
        for t in self.tensors.values():
            count[t.type_name] += 1
            size[t.type_name] += t.n_bytes
        return sorted(((k, count[k], size[k]) for k in count), key=lambda r: -r[2])

    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors.values())


def open_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file with `gguf.GGUFReader` (memory-mapped; no tensor data is read).

    Raises:
        MacinferError: missing, empty, not GGUF (bad magic), truncated or corrupt, split
            into parts, or a tensor of an unknown GGML type (named).
    """
    path = Path(path)
    _check_file(path)
    try:
        reader = _Reader(path)
    except MacinferError:
        raise
    except (ValueError, IndexError, KeyError, OverflowError, MemoryError, TypeError, UnicodeDecodeError) as e:
        msg = " ".join(str(e).split())[:120] or type(e).__name__
        raise MacinferError(f"{path} is a truncated or corrupt GGUF file ({msg}): "
                            "download or export it again") from None
    metadata = {name: _value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    if int(metadata.get("split.count", 1) or 1) > 1:
        raise MacinferError(f"{path} is part {int(metadata.get('split.no', 0)) + 1} of a split GGUF "
                            f"({metadata['split.count']} files): merge them first (llama-gguf-split --merge)")
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = GGUFTensor(t.name, t.tensor_type.name, shape, t.data)
    return GGUFFile(path, metadata, tensors)


def _check_file(path: Path) -> None:
    if path.is_dir():
        raise MacinferError(f"{path} is a directory, not a GGUF file")
    if not path.is_file():
        raise MacinferError(f"{path}: no such GGUF file")
    size = path.stat().st_size
    if size == 0:
        raise MacinferError(f"{path} is empty, not a GGUF file: download or export it again")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise MacinferError(f"{path} is not a GGUF file (bad magic bytes): pass a .gguf model file")
    if size < 24:
        raise MacinferError(f"{path} is a truncated GGUF file ({size} bytes): download or export it again")


def _value(field) -> Any:
    """A metadata field as a Python value (str, int, float, bool, or a list of them)."""
    return field.contents()


class _Reader(GGUFReader):
    """gguf's reader, naming the tensor whose GGML type it does not know (gguf raises a bare ValueError)."""

    def __init__(self, path: Path):
        self._path = path
        super().__init__(os.fspath(path), "r")

    def _build_tensors(self, start_offs, fields):
        for field in fields:
            raw = int(field.parts[4][0])
            if raw not in _KNOWN_TYPES:
                name = bytes(field.parts[1]).decode("utf-8", errors="replace")
                raise MacinferError(f"{self._path}: tensor '{name}' has GGML type {raw}, which the gguf package "
                                    "does not know: upgrade it (pip install -U gguf), or use another quantisation")
        super()._build_tensors(start_offs, fields)
