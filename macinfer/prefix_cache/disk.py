"""The persistent tier of the prefix cache: cached blocks' K/V as safetensors files on disk.

One file per block, named by its block hash, in a directory per model identity:

    <cache_dir()>/prefix/<model id>/<block hash hex>.safetensors
        tensors   k.0 v.0 k.1 v.1 ...   each (block_size, n_kv_heads, head_dim), the pool dtype
        metadata  format, model_id, block_hash, token_ids (JSON), digest (of the tensor bytes)

NOTE: the file layout is token-major whatever the in-memory pool layout is (the pools are
head-major slots, macinfer.kv.paged_attention): save and load transpose. Changing what a
file holds needs a FORMAT bump.

A later process that misses a block in memory finds it here (BlockPool asks
`num_leading`, then `load`) and copies it into a free block of its pools, so a
second run with the same long system prompt skips its prefill. Blocks are saved
when a request finishes (`save`), only those not on disk yet.

Design choices:
- Writes are atomic (a temporary file in the same directory, then os.replace),
  so a crash or a concurrent process never leaves a half-written file under a
  block's name.
- Every load is checked against what the caller expects: model id, hash, token
  ids, tensor names, shapes and dtypes, and the tensor bytes against the digest
  saved with them (a flipped byte or rescaled values would otherwise decode as
  garbage). A file that fails (corrupt, from another model, truncated, an older
  format) is never used: one warning, and the file is deleted. Files are fsynced
  before they take a block's name.
- A process killed mid-write leaves a `.tmp` file; files an hour old are removed when a
  store opens (a live writer's are seconds old).
- The whole tier (every model's directory under the root) is bounded by
  `max_bytes`: least recently used files go first, whichever model they belong
  to, so the directories of deleted models drain away. Use = a save or a load,
  recorded in the file's mtime so it survives restarts.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from macinfer.staging import remove_stale

FORMAT = "macinfer-prefix-block/2"  # /2: a digest of the tensor bytes in the metadata


def digest(arrays: dict[str, mx.array]) -> str:
    """A checksum of the arrays' names, shapes and bytes (any dtype), in name order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}{a.shape}{a.dtype}".encode())
        h.update(np.asarray(a.view(mx.uint8)).tobytes())
    return h.hexdigest()


class DiskPrefixStore:
    """Block K/V files for one model under a byte limit.

    Args:
        directory: this model's directory (created if missing).
        model_id: the model identity (macinfer.prefix_cache.keys.model_identity).
        caches: the engine's PagedKVCache per layer (their k_pool / v_pool).
        block_size: tokens per block.
        max_bytes: size limit of the block files of all models (the directory's parent).
        sync: called before the pools are read (`save`): nothing may be evaluating beside it
            (a launched step on the evaluator's thread: StepEvaluator.drain).
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
        warnings.warn(f"prefix cache: ignoring {self._path(name)}: {reason}", RuntimeWarning, stacklevel=3)
        self._drop(name)
        try:
            self._path(name).unlink()
        except OSError:
            pass

    def _read(self, block_hash: bytes, token_ids: list[int]) -> dict[str, mx.array] | None:
        """The file's arrays if it is exactly the block asked for, else None (rejected)."""
        name = block_hash.hex()
        try:
            arrays, meta = mx.load(str(self._path(name)), return_metadata=True)
        except FileNotFoundError:
            self._drop(name)  # removed by another process: a plain miss
            return None
        except Exception as e:  # noqa: BLE001 - any parse error means a corrupt file
            self._reject(name, f"unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
            return None
        if meta.get("format") != FORMAT:
            return self._reject(name, f"not a macinfer prefix block (format {meta.get('format')!r})")
        if meta.get("model_id") != self.model_id:
            return self._reject(name, f"saved by another model ({meta.get('model_id')}, this is {self.model_id})")
        if meta.get("block_hash") != name:
            return self._reject(name, "its block hash does not match its name")
        try:
            saved_ids = json.loads(meta.get("token_ids", "null"))
        except json.JSONDecodeError:
            saved_ids = None
        if saved_ids != list(token_ids):
            return self._reject(name, "its token ids differ from the block's")
        for i, c in enumerate(self.caches):
            for kind, pool in (("k", c.k_pool), ("v", c.v_pool)):
                a = arrays.get(f"{kind}.{i}")
                want = (self.block_size, pool.shape[0], pool.shape[2])  # (bs, H, D): see the NOTE above
                if a is None or a.shape != want or a.dtype != pool.dtype:
                    return self._reject(name, f"tensor {kind}.{i} is missing or has the wrong shape/dtype")
        if len(arrays) != 2 * len(self.caches):
            return self._reject(name, "unexpected tensors")
        if meta.get("digest") != digest(arrays):
            return self._reject(name, "its tensor data does not match its checksum (corrupt)")
        return arrays

    def load(self, blocks: list[tuple[bytes, list[int], int]]) -> int:
        """Copy (hash, token ids, block id) entries into the pools; stop at the first miss or bad file.

        Returns:
            How many leading entries were loaded.
        """
        loaded, ids = [], []
        for block_hash, token_ids, block_id in blocks:
            arrays = self._read(block_hash, token_ids)
            if arrays is None:
                break
            loaded.append(arrays)
            ids.append(block_id)
            self._touch(block_hash.hex())
        if not loaded:
            return 0
        slots = self._slots(ids)
        for i, c in enumerate(self.caches):
            # NOTE: in-place scatters (nothing else holds the pools), evaluated right away.
            c.k_pool[:, slots] = self._to_pool(mx.stack([a[f"k.{i}"] for a in loaded]))
            c.v_pool[:, slots] = self._to_pool(mx.stack([a[f"v.{i}"] for a in loaded]))
        mx.eval([c.state for c in self.caches])
        return len(loaded)

    def _slots(self, block_ids: list[int]) -> mx.array:
        """The pools' slot ids of these blocks, block after block: (n * block_size,)."""
        bs = self.block_size
        return mx.array([b * bs + i for b in block_ids for i in range(bs)], dtype=mx.int32)

    @staticmethod
    def _to_pool(x: mx.array) -> mx.array:
        """File blocks (n, bs, H, D) -> pool slots (H, n * bs, D)."""
        n, bs, H, D = x.shape
        return x.transpose(2, 0, 1, 3).reshape(H, n * bs, D)

    def _from_pool(self, x: mx.array) -> mx.array:
        """Pool slots (H, n * bs, D) -> file blocks (n, bs, H, D), contiguous."""
        H, S, D = x.shape
        return mx.contiguous(x.reshape(H, S // self.block_size, self.block_size, D).transpose(1, 2, 0, 3))

    def _touch(self, name: str) -> None:
        self.index[name] = (self.index[name][0], time.time_ns())
        self.index.move_to_end(name)
        try:
            os.utime(self._path(name))
        except OSError:
            pass

    # -- writing ----------------------------------------------------------------------
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
        # One gather per pool (a copy: a view would keep the pool from updating in place).
        slots = self._slots([b[2] for b in todo])
        ks = [self._from_pool(c.k_pool[:, slots]) for c in self.caches]
        vs = [self._from_pool(c.v_pool[:, slots]) for c in self.caches]
        mx.eval(ks, vs)
        for j, (block_hash, token_ids, _) in enumerate(todo):
            arrays = {}
            for i in range(len(self.caches)):
                arrays[f"k.{i}"], arrays[f"v.{i}"] = ks[i][j], vs[i][j]
            name = block_hash.hex()
            meta = {"format": FORMAT, "model_id": self.model_id, "block_hash": name,
                    "token_ids": json.dumps(list(token_ids)), "saved_at": str(int(time.time())),
                    "digest": digest(arrays)}
            tmp = self.directory / f".{name}.{os.getpid()}.tmp"
            try:
                with open(tmp, "wb") as f:
                    mx.save_safetensors(f, arrays, metadata=meta)
                    f.flush()
                    os.fsync(f.fileno())  # durable before it takes the block's name
                os.replace(tmp, self._path(name))
                self._drop(name)
                self.index[name] = (self._path(name).stat().st_size, time.time_ns())
                self._nbytes += self.index[name][0]
            except OSError as e:
                warnings.warn(f"prefix cache: cannot write {self._path(name)} ({e}); not persisting", RuntimeWarning)
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
