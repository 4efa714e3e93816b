"""Load the system OpenBLAS before MLX on Linux.

The `mlx-cpu` wheel links the reference netlib BLAS (2-3 GFLOP/s sgemm). If the
system OpenBLAS is loaded into the process first with RTLD_GLOBAL, MLX's float32
matmuls resolve to it and prefill gets 20-50x faster (docs/platform.md, "MLX's CPU backend"). This must
run before the first `import mlx`; `macinfer/__init__.py` does it. Imported after mlx, it is too late
(MLX has bound its BLAS for good) and it says so in one line on stderr.

Set MACINFER_NO_OPENBLAS=1 to keep the bundled BLAS (used by the benchmark that
measures the difference).
"""

from __future__ import annotations

import ctypes
import os
import sys

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

loaded: str | None = None


def load_openblas() -> str | None:
    """Preload OpenBLAS if we are on Linux, it exists, and MLX is not imported yet.

    Returns:
        The path loaded, or None.
    """
    global loaded
    if loaded or not sys.platform.startswith("linux"):
        return loaded
    if os.environ.get("MACINFER_NO_OPENBLAS", "") not in ("", "0"):
        return None
    present = [p for p in CANDIDATES if os.path.exists(p)]
    if "mlx.core" in sys.modules:
        # Too late: MLX already bound its BLAS symbols (loading it now changes nothing, measured).
        if present:
            print("warning: mlx was imported before macinfer, so MLX keeps its bundled reference BLAS "
                  "(float32 matmuls 20-50x slower): import macinfer first", file=sys.stderr)
        return None
    for path in present:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        loaded = path
        return path
    return None
