"""The persistent tier of the prefix cache: cached blocks' K/V as safetensors files on disk.

One file per block, named by its block hash, in a directory per model identity:

    <cache_dir()>/prefix/<model id>/<block hash hex>.safetensors

A file holds the block's K/V of every layer as one tensor of bytes, with its token ids, the
layout of the pools and a CRC-32 (macinfer.prefix_cache.block_file has the format).

A later process that misses a block in memory finds it here (BlockPool asks
`num_leading`, then `load`) and copies it into a free block of its pools, so a
second run with the same long system prompt skips its prefill. Blocks are saved
when a request finishes (`save`), only those not on disk yet.

Design choices:
- Writes are atomic (a temporary file in the same directory, then os.replace),
  so a crash or a concurrent process never leaves a half-written file under a
  block's name. Files are fsynced before they take a block's name.
- Every load is checked against what the caller expects: model id, hash, token
  ids, the layout of the pools (names, shapes, dtypes), the file's size, and the
  tensor bytes against the CRC-32 saved with them (a flipped byte or rescaled values
  would otherwise decode as garbage). A file that fails (corrupt, from another model,
  truncated) is never used: one warning, and the file is deleted. A file of another
  format (an older macinfer's) means the directory holds more: all of them are
  removed, with one warning.
- A load is three reads per file and one copy per pool: each file's bytes are read
  whole into one buffer (no per-tensor reads) and checksummed in one pass (CRC-32: it
  catches every burst of up to 32 flipped bits), and numpy copies the blocks of a
  request from that buffer into the pools' memory, a run of consecutive blocks at a
  time, in chunks of at most CHUNK_BYTES (a 2,000-token prefix of SmolLM2-135M is 125
  files, 92 MB: loaded in 0.06-0.12 s on the 2-core dev host, against 0.55-2.5 s with
  a lazy read, an evaluation and a BLAKE2 pass per tensor (7,500 of them), then one
  stack and scatter per pool; `scripts/bench/prefix.py --disk-only` compares the TTFTs).
- A process killed mid-write leaves a `.tmp` file; files an hour old are removed when a
  store opens (a live writer's are seconds old).
- The whole tier (every model's directory under the root) is bounded by
  `max_bytes`: least recently used files go first, whichever model they belong
  to, so the directories of deleted models drain away. Use = a save or a load,
  recorded in the file's mtime so it survives restarts.
"""

from __future__ import annotations

import json
import os
import time
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from macinfer.errors import MacinferWarning
from macinfer.prefix_cache.block_file import (FORMAT, BadFile, block_layout, check_tensor, layout_json,
                                              part_into_pool, read_exactly, read_header, slot_runs,
                                              slots_into_part)
from macinfer.staging import remove_stale

CHUNK_BYTES = 128 << 20  # a load holds at most this much block data in memory at once
UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}  # by item size (numpy has no bfloat16)


class DiskPrefixStore:
    """Block K/V files for one model under a byte limit.

    Args:
        directory: this model's directory (created if missing).
        model_id: the model identity (macinfer.prefix_cache.keys.model_identity).
        caches: the engine's PagedKVCache per layer (their k_pool / v_pool).
        block_size: tokens per block.
        max_bytes: size limit of the block files of all models (the directory's parent).
        sync: called before the pools are read or written (`save`, `load`): nothing may be
            evaluating beside it (a launched step on the evaluator's thread: StepEvaluator.drain).
    """

    def __init__(self, directory: str | Path, model_id: str, caches: list, block_size: int, max_bytes: int,
                 sync: Callable[[], None] | None = None):
        self.directory = Path(directory)
        self.sync = sync
        self.directory.mkdir(parents=True, exist_ok=True)
        # Temporary files of killed processes (any model's): invisible to the size limit, so swept here.
        remove_stale(self.directory.parent, "*/.*.tmp")
        self.model_id = model_id
        self.caches = caches
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.layout = block_layout(caches, block_size)
        self.block_bytes = sum(p.nbytes for p in self.layout)
        self._layout_json = layout_json(self.layout)
        self.num_rejected = 0
        # hash hex -> (file size, last use in ns), least recently used first.
        self.index: OrderedDict[str, tuple[int, int]] = OrderedDict()
        # Other models' files, oldest first: (mtime ns, path, size); only for the size limit.
        self.others: list[tuple[int, Path, int]] = []
        for p in sorted(self.directory.parent.glob("*/*.safetensors")):
            try:
                st = p.stat()
            except OSError:
                continue
            if p.parent == self.directory:
                self.index[p.stem] = (st.st_size, st.st_mtime_ns)
            else:
                self.others.append((st.st_mtime_ns, p, st.st_size))
        self.index = OrderedDict(sorted(self.index.items(), key=lambda kv: kv[1][1]))
        self.others.sort()
        self._nbytes = sum(size for size, _ in self.index.values())  # kept up to date (read by kv_stats)

    # -- sizes ------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.index)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def _drop(self, name: str) -> None:
        entry = self.index.pop(name, None)
        if entry is not None:
            self._nbytes -= entry[0]

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}.safetensors"

    # -- reading ----------------------------------------------------------------------
    def num_leading(self, block_hashes: list[bytes]) -> int:
        n = 0
        for h in block_hashes:
            if h.hex() not in self.index:
                break
            n += 1
        return n

    def _reject(self, name: str, reason: str) -> None:
        self.num_rejected += 1
        warnings.warn(f"prefix cache: ignoring {self._path(name)}: {reason}", MacinferWarning, stacklevel=3)
        self._remove(name)

    def _remove(self, name: str) -> None:
        self._drop(name)
        try:
            self._path(name).unlink()
        except OSError:
            pass

    def _check(self, name: str, meta: dict, token_ids: list[int]) -> None:
        """Raise BadFile unless the metadata is this block's, saved by this model with these pools."""
        if meta.get("model_id") != self.model_id:
            raise BadFile(f"saved by another model ({meta.get('model_id')}, this is {self.model_id})")
        if meta.get("block_hash") != name:
            raise BadFile("its block hash does not match its name")
        try:
            saved_ids = json.loads(meta.get("token_ids", "null"))
        except (ValueError, TypeError):
            saved_ids = None
        if saved_ids != list(token_ids):
            raise BadFile("its token ids differ from the block's")
        if meta.get("layout") != self._layout_json:
            raise BadFile("its tensors have the wrong names, shapes or dtypes for this model's KV cache")

    def _read_into(self, block_hash: bytes, token_ids: list[int], out: np.ndarray) -> bool:
        """Fill out (block_bytes uint8) with the block's file if it is exactly the block asked for.

        Returns False for a miss or a rejected file (warned about and deleted).
        """
        name = block_hash.hex()
        try:
            with open(self._path(name), "rb", buffering=0) as f:
                header = read_header(f)
                meta = header["__metadata__"]
                if meta.get("format") != FORMAT:
                    self._reject_other_format(name, meta.get("format"))
                    return False
                self._check(name, meta, token_ids)
                check_tensor(header, self.block_bytes)
                if os.fstat(f.fileno()).st_size != f.tell() + self.block_bytes:
                    raise BadFile("truncated, or bytes after its data")
                read_exactly(f, memoryview(out))  # NOTE: the whole block in one read
        except FileNotFoundError:
            self._drop(name)  # removed by another process: a plain miss
            return False
        except BadFile as e:
            self._reject(name, str(e))
            return False
        except OSError as e:
            self._reject(name, f"unreadable ({e.strerror or type(e).__name__})")
            return False
        if str(zlib.crc32(out)) != meta.get("crc32"):
            self._reject(name, "its tensor data does not match its checksum (corrupt)")
            return False
        return True

    def _reject_other_format(self, name: str, found) -> None:
        """A file of another format: every such file of this model is removed, with one warning."""
        gone = 0
        for other in list(self.index):
            try:
                with open(self._path(other), "rb", buffering=0) as f:
                    stale = read_header(f)["__metadata__"].get("format") != FORMAT
            except (OSError, BadFile):
                stale = other == name
            if stale:
                self._remove(other)
                gone += 1
        self.num_rejected += gone
        warnings.warn(f"prefix cache: ignoring {self._path(name)}: not a macinfer prefix block of this version "
                      f"(format {found!r}, this is {FORMAT!r}); removed {gone} such file(s) from {self.directory}",
                      MacinferWarning, stacklevel=4)

    def load(self, blocks: list[tuple[bytes, list[int], int]]) -> int:
        """Copy (hash, token ids, block id) entries into the pools; stop at the first miss or bad file.

        Returns:
            How many leading entries were loaded.
        """
        if self.sync is not None and blocks:
            self.sync()
        per_chunk = max(1, CHUNK_BYTES // max(1, self.block_bytes))
        loaded = 0
        for start in range(0, len(blocks), per_chunk):
            chunk = blocks[start: start + per_chunk]
            n = self._load_chunk(chunk)
            loaded += n
            if n < len(chunk):
                break
        return loaded

    def _load_chunk(self, blocks: list[tuple[bytes, list[int], int]]) -> int:
        """Read the blocks' files into one buffer, then copy it into every pool's slots."""
        buf = np.empty((len(blocks), self.block_bytes), dtype=np.uint8)  # (n, block bytes)
        n = 0
        for block_hash, token_ids, _ in blocks:
            if not self._read_into(block_hash, token_ids, buf[n]):
                break
            self._touch(block_hash.hex())
            n += 1
        if n == 0:
            return 0
        runs = slot_runs([b[2] for b in blocks[:n]], self.block_size)
        pools = [pool for c in self.caches for pool in (c.k_pool, c.v_pool)]
        mx.eval(pools)
        for pool, part in zip(pools, self.layout):
            # NOTE: written through a numpy view of the pool's memory, which MLX documents as seen
            # by the array: the pools are evaluated and nothing evaluates beside this (sync), the
            # slots belong to free blocks no sequence reads, and the view dies here (a second
            # holder of a pool's buffer would make MLX's next in-place write copy the pool).
            view = pool.view(UINT[part.dtype.size])
            mx.eval(view)
            part_into_pool(buf[:n], part, np.asarray(view), runs)
        return n

    def _slots(self, block_ids: list[int]) -> mx.array:
        """The pools' slot ids of these blocks, block after block: (n * block_size,)."""
        bs = self.block_size
        return mx.array([b * bs + i for b in block_ids for i in range(bs)], dtype=mx.int32)

    def _touch(self, name: str) -> None:
        self.index[name] = (self.index[name][0], time.time_ns())
        self.index.move_to_end(name)
        try:
            os.utime(self._path(name))
        except OSError:
            pass

    # -- writing ----------------------------------------------------------------------
    def _gather(self, block_ids: list[int]) -> np.ndarray:
        """The blocks' bytes as files hold them: (n, block_bytes) uint8, parts in `layout` order."""
        slots = self._slots(block_ids)
        # One gather per pool (a copy: a view would keep the pool from updating in place).
        taken = [pool[:, slots].view(mx.uint8) for c in self.caches for pool in (c.k_pool, c.v_pool)]
        mx.eval(taken)
        out = np.empty((len(block_ids), self.block_bytes), dtype=np.uint8)
        for x, part in zip(taken, self.layout):
            slots_into_part(np.asarray(x), part, out)
        return out

    def save(self, blocks: list[tuple[bytes, list[int], int]]) -> int:
        """Write the (hash, token ids, block id) entries not on disk yet; returns how many."""
        todo = [b for b in blocks if b[0].hex() not in self.index]
        for b in blocks:
            if b[0].hex() in self.index:
                self._touch(b[0].hex())
        if not todo:
            return 0
        if self.sync is not None:
            self.sync()
        data = self._gather([b[2] for b in todo])
        for j, (block_hash, token_ids, _) in enumerate(todo):
            name = block_hash.hex()
            meta = {"format": FORMAT, "model_id": self.model_id, "block_hash": name,
                    "token_ids": json.dumps(list(token_ids)), "layout": self._layout_json,
                    "saved_at": str(int(time.time())), "crc32": str(zlib.crc32(data[j]))}
            tmp = self.directory / f".{name}.{os.getpid()}.tmp"
            try:
                with open(tmp, "wb") as f:
                    mx.save_safetensors(f, {"kv": mx.array(data[j])}, metadata=meta)
                    f.flush()
                    os.fsync(f.fileno())  # durable before it takes the block's name
                os.replace(tmp, self._path(name))
                self._drop(name)
                self.index[name] = (self._path(name).stat().st_size, time.time_ns())
                self._nbytes += self.index[name][0]
            except OSError as e:
                warnings.warn(f"prefix cache: cannot write {self._path(name)} ({e}); not persisting", MacinferWarning)
                tmp.unlink(missing_ok=True)
                return j
        self._enforce_limit()
        return len(todo)

    def _enforce_limit(self) -> None:
        total = self.nbytes + sum(size for _, _, size in self.others)
        while total > self.max_bytes and (self.index or self.others):
            ours = next(iter(self.index.items()), None)
            if self.others and (ours is None or self.others[0][0] <= ours[1][1]):
                _, path, size = self.others.pop(0)
            else:
                name, (size, _) = next(iter(self.index.items()))
                self._drop(name)
                path = self._path(name)
            total -= size
            try:
                path.unlink()
                if path.parent != self.directory and not any(path.parent.iterdir()):
                    path.parent.rmdir()
            except OSError:
                pass
