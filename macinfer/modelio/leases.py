"""Which models running macinfer processes hold: `macinfer serve` takes a lease, `macinfer rm` checks them.

A lease is one small JSON file under `$MACINFER_HOME/leases/` named after the process that holds
it: {"pid", "path" (the model directory, resolved), "what"}. It is removed when the process ends
normally; a process killed outright leaves its file behind, so a lease counts only while its pid
is alive (a dead one is deleted when next read). Written atomically (temp file, rename), so a
reader never sees half a lease.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

from macinfer.paths import cache_dir


_serial = itertools.count()  # this process's leases: each its own file, even after one is released


def leases_dir() -> Path:
    return cache_dir() / "leases"


@dataclass
class Lease:
    pid: int
    path: Path
    what: str
    file: Path

    def release(self) -> None:
        self.file.unlink(missing_ok=True)


def take(path: str | Path, what: str) -> Lease:
    """Record that this process uses the model at `path` until it exits (or `release()`)."""
    d = leases_dir()
    d.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    lease = Lease(pid, Path(path).resolve(), what, d / f"{pid}-{next(_serial)}.json")
    tmp = lease.file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": pid, "path": str(lease.path), "what": what}))
    os.replace(tmp, lease.file)
    atexit.register(lease.release)
    return lease


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def holders(target: str | Path) -> list[Lease]:
    """The live leases on `target` or on anything inside it (a snapshot inside an HF cache repo)."""
    d = leases_dir()
    target = Path(target).resolve()
    out = []
    for f in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            data = json.loads(f.read_text())
            lease = Lease(int(data["pid"]), Path(data["path"]), str(data["what"]), f)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a lease of ours (or being replaced): ignore it
        if not _alive(lease.pid):
            lease.release()
        elif lease.path == target or lease.path.is_relative_to(target):
            out.append(lease)
    return out
