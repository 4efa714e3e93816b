"""Where macinfer finds its shipped files and keeps its own.

- `models_dir()`: the top-level `models/` folder (catalog, shipped drafts, calibration
  and eval text). It is data, never imported as code: an installed wheel carries it as
  the package directory `macinfer/_models` (pyproject.toml maps it), a source checkout
  has it beside `macinfer/`.
- `cache_dir()`: converted models, the persistent prefix cache and measurements;
  `$MACINFER_HOME` or `~/.cache/macinfer`.
"""

from __future__ import annotations

import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def models_dir() -> Path:
    """The shipped `models/` folder: inside the installed package, else the source checkout's."""
    installed = _HERE / "_models"
    return installed if (installed / "catalog.json").is_file() else _HERE.parent / "models"


def cache_dir() -> Path:
    """Where macinfer keeps converted models and measurements: $MACINFER_HOME or ~/.cache/macinfer."""
    return Path(os.environ.get("MACINFER_HOME") or "~/.cache/macinfer").expanduser()
