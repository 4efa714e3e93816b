"""Load the system OpenBLAS before MLX on Linux.

The `mlx-cpu` wheel links the reference netlib BLAS (2-3 GFLOP/s sgemm). If the
system OpenBLAS is loaded into the process first with RTLD_GLOBAL, MLX's float32
matmuls resolve to it and prefill gets 20-50x faster (docs/platform.md, "MLX's CPU backend"). This must
run before the first `import mlx`; `macinfer/__init__.py` does it.

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
_lib: ctypes.CDLL | None = None


def load_openblas() -> str | None:
    """Preload OpenBLAS if we are on Linux, it exists, and MLX is not imported yet.

    Returns:
        The path loaded, or None.
    """
    global loaded, _lib
    if loaded or not sys.platform.startswith("linux"):
        return loaded
    if os.environ.get("MACINFER_NO_OPENBLAS", "") not in ("", "0"):
        return None
    if "mlx.core" in sys.modules:
        # Too late: MLX already bound its BLAS symbols.
        return None
    for path in CANDIDATES:
        if os.path.exists(path):
            try:
                _lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            loaded = path
            return path
    return None


def set_threads(n: int) -> int | None:
    """Set the preloaded OpenBLAS's thread count; returns the previous one (None: no OpenBLAS here).

    Why: after a threaded call, OpenBLAS's idle workers spin for a while on the other cores. That is
    free while the host waits for MLX, but not while the host builds the next step on the core they
    take (macinfer.core.evaluator holds BLAS to one thread while launched steps run).
    """
    if _lib is None:
        return None
    try:
        old = int(_lib.openblas_get_num_threads())
        _lib.openblas_set_num_threads(ctypes.c_int(n))
    except AttributeError:  # a BLAS without the OpenBLAS extensions
        return None
    return old
