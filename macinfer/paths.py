"""Where macinfer finds its shipped files and keeps its own.

- `models_dir()`: the top-level `models/` folder (catalog, shipped drafts, calibration
  and eval text). It is data, never imported as code.
- `cache_dir()`: converted models, the persistent prefix cache and measurements;
  `$MACINFER_HOME` or `~/.cache/macinfer`.
"""

from __future__ import annotations

import os
from pathlib import Path


def models_dir() -> Path:
    """The shipped `models/` folder."""
    return Path(__file__).resolve().parent.parent / "models"


def cache_dir() -> Path:
    """Where macinfer keeps converted models and measurements: $MACINFER_HOME or ~/.cache/macinfer."""
    return Path(os.environ.get("MACINFER_HOME") or "~/.cache/macinfer").expanduser()
