"""The prefix cache's disk directories, one per model identity, and the labels that name their model.

The prefix cache's disk tier (macinfer.prefix_cache.disk) keeps one directory per model identity,
a hash; the engine writes a label `<root>/<model id>.json` ({"name", "path"}) beside it
(`label_prefix_dir`) so `macinfer cache` can say which model a directory is for. The files hold
token ids that decode back to the prompts.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from macinfer.paths import cache_dir


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
        stats = [st for st in map(_stat, d.iterdir()) if st is not None]
        times = [f.stat().st_mtime for f in files if f.exists()]
        out.append(PrefixDir(d.name, d, len(files), sum(st.st_size for st in stats), max(times) if times else None,
                             label.get("name") if isinstance(label, dict) else None,
                             label.get("path") if isinstance(label, dict) else None))
    return sorted(out, key=lambda p: -p.size_bytes)


def _stat(path: Path) -> os.stat_result | None:
    """A block file's stat (the directory is flat), None if it went meanwhile or is not a file."""
    try:
        st = path.lstat()
    except OSError:
        return None
    return st if path.is_file() and not path.is_symlink() else None


def remove_prefix_dir(p: PrefixDir) -> None:
    shutil.rmtree(p.path, ignore_errors=True)
    (p.path.parent / f"{p.model_id}.json").unlink(missing_ok=True)


def prefix_root() -> Path:
    """The prefix cache's disk tier: $MACINFER_PREFIX_CACHE_DIR or cache_dir()/prefix (unless an engine sets prefix_cache_dir)."""
    return Path(os.environ.get("MACINFER_PREFIX_CACHE_DIR") or cache_dir() / "prefix").expanduser()
