"""Staging directories: an output built beside its final name, renamed into place, and the
leftovers of writers that were killed swept away.

    out/                              the finished output (what readers see)
    .out.<pid>-<hex>.partial/         being written; renamed to out/ when complete
    .out.<pid>-<hex>.old/             the previous out/, while it is being replaced

Design choices:
- The staging directory is a sibling of `out` (same filesystem, so the rename is atomic)
  and is made with mkdir, so it gets the umask's mode like any other directory the user
  creates (tempfile.mkdtemp's is 0700, which other users and processes cannot read).
- Replacing an existing `out` takes two renames (out -> .old, staging -> out); if anything
  interrupts them (an error, Ctrl+C, a signal's exception) after the first, it is undone, so
  `out` is never left missing: the .old name is chosen before the first rename, and the restore
  checks the disk, not how far the code got.
- A killed writer leaves its `.partial` behind; `remove_stale` removes those not touched
  for an hour on the next start (a live writer touches its directory as it adds files).
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import time
from pathlib import Path

STALE_SECONDS = 3600


def _sibling(out: Path, suffix: str) -> Path:
    return out.parent / f".{out.name}.{os.getpid()}-{secrets.token_hex(4)}.{suffix}"


def staging_dir(out: Path) -> Path:
    """Create a hidden, unique, empty sibling of `out` to write into.

    Args:
        out: the final output directory (its parent must exist).

    Returns:
        The new directory, with the umask's mode.
    """
    tmp = _sibling(out, "partial")
    tmp.mkdir()
    return tmp


def replace_dir(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out`; an existing `out` is replaced, and restored if that fails.

    Args:
        tmp: the staging directory, complete.
        out: the final name.

    Raises:
        OSError: the rename failed (then `out` is as it was).
    """
    old = _sibling(out, "old")
    try:
        if out.exists():
            out.rename(old)
        tmp.rename(out)
    except BaseException:
        if old.exists() and not out.exists():  # interrupted between the renames: the old output back
            old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def remove_stale(directory: Path, pattern: str, max_age: float = STALE_SECONDS) -> int:
    """Remove the files and directories matching `pattern` in `directory` untouched for `max_age` seconds.

    Args:
        directory: where to look (missing: nothing to do).
        pattern: a glob of temporary names, e.g. ".*.tmp".
        max_age: seconds since the last modification.

    Returns:
        How many were removed.
    """
    removed, now = 0, time.time()
    for p in Path(directory).glob(pattern):
        try:
            if now - p.lstat().st_mtime < max_age:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed += 1
        except OSError:  # another process removed it first, or it is not ours to remove
            continue
    return removed


def remove_stale_partials(out: Path) -> int:
    """Remove the stale staging directories of `out` (see remove_stale)."""
    # `.partial` (staging_dir), and `.partial-*` (mkdtemp's names before staging_dir).
    return remove_stale(out.parent, f".{glob.escape(out.name)}.*partial*")
