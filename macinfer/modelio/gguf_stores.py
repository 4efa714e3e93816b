"""GGUF files other tools keep: Ollama's store, LM Studio's, GGUF repos in the Hugging Face cache.

Each is listed under a name `macinfer run / chat / serve / show` accept, read in place (the
converter memory-maps it) and never written, moved or deleted by macinfer:

- Ollama: `$OLLAMA_MODELS`, else ~/.ollama/models: `manifests/<host>/<namespace>/<model>/<tag>`
  (JSON; its `application/vnd.ollama.image.model` layer) -> `blobs/sha256-<hex>`. Named
  `ollama:qwen3:4b`; `ollama:<namespace>/<model>:<tag>` off the library, `<host>/...` off the registry.
- LM Studio: ~/.lmstudio/models, ~/.cache/lm-studio/models: `<publisher>/<repo>/<file>.gguf`.
  Named `lmstudio:<publisher>/<repo>/<file>.gguf`.
- Hugging Face: the hub cache's model repos, current snapshot. Named `hf:<owner>/<repo>/<file>.gguf`.

Vision projectors (`mmproj*.gguf`, Ollama's projector layers) are not models and are skipped.

Two small indexes under `cache_dir()/gguf/` spare re-reading big files: each file's sha256
(the conversion cache's key: Ollama's and the HF cache's blob names are their digests, so
those are never hashed) and its header summary for `ls`, both keyed by path, size and mtime.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from macinfer.errors import MacinferError
from macinfer.modelio.gguf_file import open_gguf
from macinfer.paths import cache_dir

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY, OLLAMA_LIBRARY = "registry.ollama.ai", "library"
PREFIXES = ("ollama:", "lmstudio:", "hf:")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class StoredGGUF:
    """One GGUF model another tool keeps."""

    name: str  # what to pass as MODEL ("ollama:qwen3:4b")
    store: str  # "ollama", "lmstudio", "hf-gguf"
    path: Path  # the GGUF file (an Ollama blob, a file in LM Studio's tree, an HF snapshot link)
    owner: str  # how that tool removes it, for `rm`'s refusal
    digest: str | None = None  # sha256 when the store names files by it


# -- the stores -----------------------------------------------------------------------------
def ollama_root() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()


def lmstudio_roots() -> list[Path]:
    return [Path("~/.lmstudio/models").expanduser(), Path("~/.cache/lm-studio/models").expanduser()]


def ollama_models() -> list[StoredGGUF]:
    """Every manifest in Ollama's store with a readable model layer (broken ones are left out)."""
    root = ollama_root() / "manifests"
    out = []
    for manifest in sorted(root.glob("*/*/*/*")) if root.is_dir() else []:
        if manifest.is_file():
            try:
                out.append(_ollama_model(manifest))
            except MacinferError:
                continue
    return out


def _ollama_name(manifest: Path) -> str:
    host, namespace, model, tag = manifest.parts[-4:]
    if host == OLLAMA_REGISTRY:
        return f"ollama:{model}:{tag}" if namespace == OLLAMA_LIBRARY else f"ollama:{namespace}/{model}:{tag}"
    return f"ollama:{host}/{namespace}/{model}:{tag}"


def _ollama_model(manifest: Path) -> StoredGGUF:
    """The model blob a manifest names, or one line naming the manifest and what is wrong with it."""
    try:
        layers = json.loads(manifest.read_text()).get("layers")
        model = [layer for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER]
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise MacinferError(f"{manifest}: broken Ollama manifest ({type(e).__name__}): "
                            "`ollama pull` it again") from None
    if len(model) != 1 or not isinstance(model[0].get("digest"), str):
        raise MacinferError(f"{manifest}: broken Ollama manifest (no single model layer with a digest): "
                            "`ollama pull` it again")
    digest = model[0]["digest"]
    blob = manifest.parents[3].parent / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise MacinferError(f"{manifest}: its model blob {blob.name} is missing from {blob.parent}: "
                            "`ollama pull` it again")
    name = _ollama_name(manifest)
    hexdigest = digest.split(":", 1)[-1]
    return StoredGGUF(name, "ollama", blob, f"`ollama rm {name.removeprefix('ollama:')}`",
                      hexdigest if _SHA256.match(hexdigest) else None)


def lmstudio_models() -> list[StoredGGUF]:
    out, seen = [], set()
    for root in lmstudio_roots():
        for path in sorted(root.glob("*/*/*.gguf")) if root.is_dir() else []:
            rel = path.relative_to(root).as_posix()
            if _is_projector(path) or rel in seen:
                continue
            seen.add(rel)
            out.append(StoredGGUF(f"lmstudio:{rel}", "lmstudio", path, "LM Studio (My Models -> delete)"))
    return out


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache, read from the environment now (huggingface_hub reads it at import)."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def hf_gguf_models() -> list[StoredGGUF]:
    """.gguf files in the current snapshot (refs/main, else the newest) of each Hugging Face cache model repo."""
    out = []
    root = hf_hub_cache()
    for repo in sorted(root.glob("models--*"), key=lambda p: p.name.lower()) if root.is_dir() else []:
        snap = _hf_snapshot(repo)
        if snap is None:
            continue
        repo_id = repo.name.removeprefix("models--").replace("--", "/")
        for path in sorted(snap.rglob("*.gguf")):
            if _is_projector(path) or not path.is_file():
                continue
            blob = path.resolve().name
            out.append(StoredGGUF(f"hf:{repo_id}/{path.relative_to(snap).as_posix()}", "hf-gguf", path,
                                  f"`hf cache delete` ({repo_id})", blob if _SHA256.match(blob) else None))
    return out


def _hf_snapshot(repo: Path) -> Path | None:
    try:
        main = repo / "snapshots" / (repo / "refs" / "main").read_text().strip()
        if main.is_dir():
            return main
    except OSError:
        pass
    snaps = [p for p in (repo / "snapshots").glob("*") if p.is_dir()]
    return max(snaps, key=lambda p: p.stat().st_mtime) if snaps else None


def _is_projector(path: Path) -> bool:
    return path.name.lower().startswith("mmproj")


def stored_models() -> list[StoredGGUF]:
    return ollama_models() + lmstudio_models() + hf_gguf_models()


def find_stored(spec: str) -> StoredGGUF | None:
    """The stored GGUF a prefixed name denotes; None when `spec` has no store prefix.

    Raises:
        MacinferError: the prefix is there but no such model (or a broken Ollama manifest).
    """
    if not spec.startswith(PREFIXES):
        return None
    if spec.startswith("ollama:"):
        return _find_ollama(spec)
    candidates = lmstudio_models() if spec.startswith("lmstudio:") else hf_gguf_models()
    for m in candidates:
        if m.name == spec:
            return m
    names = ", ".join(m.name for m in candidates[:5]) or "none"
    raise MacinferError(f"no GGUF model '{spec}' (found: {names}): `macinfer ls` lists them")


def _find_ollama(spec: str) -> StoredGGUF:
    name = spec.removeprefix("ollama:")
    model, _, tag = name.rpartition(":") if ":" in name.rsplit("/", 1)[-1] else (name, "", "latest")
    parts = model.split("/")
    host, namespace = OLLAMA_REGISTRY, OLLAMA_LIBRARY
    if len(parts) == 2:
        namespace, model = parts
    elif len(parts) == 3:
        host, namespace, model = parts
    elif len(parts) != 1:
        raise MacinferError(f"'{spec}' is not an Ollama model name (ollama:<model>:<tag>)")
    manifest = ollama_root() / "manifests" / host / namespace / model / tag
    if not manifest.is_file():
        raise MacinferError(f"no Ollama model '{name}' in {ollama_root()} (`ollama list` shows what it has)")
    return _ollama_model(manifest)


# -- digests and header summaries -----------------------------------------------------------
def _index(name: str) -> Path:
    return cache_dir() / "gguf" / name


def _key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def _load_index(name: str) -> dict:
    try:
        return json.loads(_index(name).read_text())
    except (OSError, ValueError):
        return {}


def _store_index(name: str, key: str, value) -> None:
    """Add one entry; the file is replaced atomically (a reader never sees half of it)."""
    index = _load_index(name)
    index[key] = value
    path = _index(name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(index))
        os.replace(tmp, path)
    except OSError:
        pass  # an index is only a cache


def file_digest(path: Path, known: str | None = None) -> str:
    """The file's sha256: `known` (a store's blob name), else computed once and remembered."""
    if known:
        return known
    resolved = path.resolve()
    if _SHA256.match(resolved.name):  # an Ollama-style or HF blob reached through a link
        return resolved.name
    key = _key(path)
    cached = _load_index("digests.json").get(key)
    if cached:
        return cached
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    digest = h.hexdigest()
    _store_index("digests.json", key, digest)
    return digest


def gguf_summary(path: Path) -> dict | None:
    """What `ls` / `show` print about a GGUF file (architecture, parameters, types, context), or None if unreadable."""
    key = _key(path)
    cached = _load_index("headers.json").get(key)
    if cached:
        return cached
    try:
        f = open_gguf(path)
    except MacinferError:
        return None
    md, arch = f.metadata, f.architecture
    types = f.type_summary()
    heads = f.arch_key("attention.head_count")
    ctx = f.arch_key("context_length")
    config = {"model_type": arch, "num_hidden_layers": f.arch_key("block_count"), "num_attention_heads": heads,
              "num_key_value_heads": f.arch_key("attention.head_count_kv") or heads,
              "hidden_size": f.arch_key("embedding_length"), "head_dim": f.arch_key("attention.key_length"),
              "max_position_embeddings": ctx}
    summary = {"architecture": arch, "num_params": f.n_params(),
               "quantization": f"GGUF {_file_type(md, types)}" if types else None,
               "context_length": ctx if isinstance(ctx, int) else None,
               "chat_template": isinstance(md.get("tokenizer.chat_template"), str),
               "types": [list(t) for t in types],
               "config": {k: v for k, v in config.items() if isinstance(v, (int, str))}}
    _store_index("headers.json", key, summary)
    return summary


def _file_type(md: dict, types: list) -> str:
    """The llama.cpp file type name (general.file_type: "Q4_K_M" ...), else the type with most bytes."""
    from gguf import LlamaFileType

    try:
        return LlamaFileType(int(md["general.file_type"])).name.removeprefix("MOSTLY_")
    except (KeyError, ValueError, TypeError):
        return types[0][0]
