"""Prefix-cache keys: block hashes chained from a model identity, and hit statistics.

A full KV block is named by a hash of everything its K/V depends on: the tokens
before it (through its parent's hash), its own token ids, and the model. So

    h0 = H(root, tokens[0:bs])      h1 = H(h0, tokens[bs:2bs])      ...
    root = H(model identity)

Two requests share block i exactly when they agree on every token up to the end
of block i *and* run the same model, which is when the K/V are bit-for-bit the
same. A block whose tokens stand for an image (macinfer.modelio.multimodal) also hashes
that image's content (its "extra keys", as vLLM names them): the same image tokens
from another image are another block. The hashes are SHA-256 (stable across processes, so the persistent tier in
`macinfer.prefix_cache.disk` can key files by them; Python's `hash()` is salted per run).

The model identity covers what changes K/V: config, weights (their files, and a
sample of every parameter so adapters and in-memory edits count), parameter
dtypes (dequantised != quantised), the KV layout (heads, head dims, window,
dtype) and the block size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence as Seq

# Bump when the hashing or the meaning of a block changes: old keys stop matching.
HASH_VERSION = 1


def hash_block_tokens(parent: bytes, token_ids: Seq[int], extra: bytes = b"") -> bytes:
    """The hash of one full block: H(parent hash, its token ids[, its extra keys]) (32 bytes).

    NOTE: a block without extra keys hashes as it always has, so text blocks keep their keys
    (and their files in the disk tier).
    """
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra:
        h.update(b"extra" + extra)
    return h.digest()


def hash_blocks(root: bytes, token_ids: Seq[int], block_size: int, start: int = 0,
                hashes: list[bytes] | None = None, extra_keys=None) -> list[bytes]:
    """Extend `hashes` (the chain of the first `start` blocks) over every full block of token_ids.

    Args:
        extra_keys: (start, end) -> bytes, the extra key of the block holding those positions
            (MultiModalInputs.block_extra_keys), or None.
    """
    hashes = [] if hashes is None else hashes
    parent = hashes[start - 1] if start else root
    for i in range(start, len(token_ids) // block_size):
        a, b = i * block_size, (i + 1) * block_size
        parent = hash_block_tokens(parent, token_ids[a:b], extra_keys(a, b) if extra_keys is not None else b"")
        hashes.append(parent)
    return hashes


def _param_fingerprint(model) -> list:
    """Name, shape, dtype and 64 evenly spaced values of every parameter (cheap: no full pass)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    out = []
    for name, a in tree_flatten(model.parameters()):
        flat = a.reshape(-1)
        stride = max(1, flat.size // 64)
        sample = flat[::stride][:64]
        if sample.dtype in (mx.bfloat16, mx.float16):
            sample = sample.astype(mx.float32)
        out.append([name, list(a.shape), str(a.dtype), sample.tolist()])
    return out


def _jsonable(o):
    # NOTE: stable across processes: sets sorted (their order follows salted str hashes).
    # Objects by their fields, never by a repr holding a memory address.
    if isinstance(o, (set, frozenset)):
        return sorted(map(str, o))
    if dataclasses.is_dataclass(o):
        return vars(o)
    return re.sub(r" at 0x[0-9a-fA-F]+", "", str(o))


def model_identity(model, info=None, specs=(), block_size: int = 16) -> str:
    """A hex id of everything that changes a block's K/V (see module docstring).

    Args:
        model: the mlx-lm model (its parameters are sampled).
        info: macinfer.modelio.loader.ModelInfo or None (then only the parameters count).
        specs: the engine's LayerSpecs (KV layout and dtype).
        block_size: tokens per block.
    """
    key: dict = {"v": HASH_VERSION, "block_size": block_size,
                 "layers": [[s.n_kv_heads, s.k_head_dim, s.v_head_dim, s.window, str(s.dtype)]
                            + ([s.chunk] if s.chunk else []) for s in specs],
                 "params": _param_fingerprint(model)}
    args = getattr(model, "args", None)  # mlx-lm's ModelArgs: rope settings etc. live here
    if args is not None:
        key["args"] = args
    if info is not None:
        path = Path(info.path)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        key["model"] = {"name": info.name, "path": str(path.resolve()), "config": info.config,
                        "quantization": info.quantization, "dtype": info.dtype,
                        "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files if f.exists()]}
    blob = json.dumps(key, sort_keys=True, default=_jsonable).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


@dataclass
class PrefixCacheStats:
    """Engine-wide counters (monotonic, since the engine started).

    queries / hits count prompt tokens at admission: hits are the tokens whose
    K/V came from the cache (memory or disk).
    """

    queries: int = 0
    hits: int = 0
    blocks_cached: int = 0  # blocks that got a hash (became reusable)
    blocks_evicted: int = 0  # cached blocks whose hash was dropped to reuse the block
    disk_loaded: int = 0  # blocks read back from the persistent tier
    disk_saved: int = 0  # blocks written to the persistent tier

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def prefix_cache_stats(pool) -> dict:
    """The prefix cache's part of LLMEngine.kv_stats()."""
    st, store = pool.stats, pool.store
    return {
        "prefix_cache": pool.enable_caching,
        "cached_blocks": pool.num_cached_blocks,  # reusable blocks in memory now
        "blocks_cached": st.blocks_cached,  # totals since start
        "blocks_evicted": st.blocks_evicted,
        "prefix_query_tokens": st.queries,
        "prefix_hit_tokens": st.hits,
        "prefix_hit_rate": st.hit_rate,
        "disk_blocks": store.num_blocks if store is not None else 0,
        "disk_bytes": store.nbytes if store is not None else 0,
        "disk_loaded_blocks": st.disk_loaded,
        "disk_saved_blocks": st.disk_saved,
    }
