"""macinfer._blas: OpenBLAS goes in before MLX, or the user hears why it could not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from macinfer import _blas


def _stderr(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MACINFER_NO_OPENBLAS"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stderr


@pytest.mark.skipif(not any(os.path.exists(p) for p in _blas.CANDIDATES) or not sys.platform.startswith("linux"),
                    reason="no system OpenBLAS to load")
def test_mlx_imported_first_is_said_in_one_line():
    late = _stderr("import mlx.core, macinfer, macinfer._blas as b; assert b.loaded is None")
    assert [line for line in late.splitlines() if "warning" in line] == [
        "warning: mlx was imported before macinfer, so MLX keeps its bundled reference BLAS "
        "(float32 matmuls 20-50x slower): import macinfer first"]
    first = _stderr("import macinfer, mlx.core, macinfer._blas as b; assert b.loaded")
    assert "warning" not in first
