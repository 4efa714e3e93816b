#!/usr/bin/env python3
"""Write the paged-attention kernels' complete Metal source, as MLX generates and compiles it, one file a pipeline.

MLX prepends its `utils()` header (mlx/backend/metal/kernels/utils.h, flattened at MLX's build) to a custom
kernel's source (mlx/backend/metal/custom_kernel.cpp); each file here starts with that header's #include, so

    xcrun -sdk macosx metal -std=metal3.1 -I "$(python -c 'import mlx, os; print(os.path.dirname(mlx.__file__))')/include" \\
          -c FILE.metal -o /dev/null

compiles what Metal compiles on a Mac (macOS 14 and later: Metal 3.1, native bfloat), without a GPU. The
pipelines: pass 1 for float and 8-bit pools in the three dtypes, head sizes 64/80/96/128/256, block 16, rows
per simdgroup 1 and 4, one pass and split; pass 2 for each dtype and head size.

Usage: python scripts/metal_sources.py --out DIR   (prints the include directory on its last line)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pipelines():
    """(name, kernel kind, launch) of every pipeline written."""
    import mlx.core as mx

    from macinfer.kv import metal_attention as ma

    for dtype in ma.SUPPORTED_DTYPES:
        for D in (64, 80, 96, 128, 256):
            for bits in (None, 8):
                if bits and D % 32:
                    continue
                for H, QL in ((1, 1), (8, 4)):  # 1 and 32 rows per KV head: 1 and 4 rows per simdgroup
                    args = ma.random_problem(0, context_lens=[40], q_len=QL, n_heads=2 * H, n_kv_heads=2,
                                             head_dim=D, block_size=16, dtype=dtype, kv_bits=bits)
                    for splits in (1, 2):
                        call = ma.kernel_call(**args, splits=splits)
                        name = "_".join(f"{k}{str(v).split('.')[-1]}" for k, v in call.pass1["template"])
                        yield f"{call.kind}_{name}", call.kind, call.pass1
                        if call.reduce is not None and bits is None and QL == 1:
                            partials = mx.zeros(call.pass1["output_shapes"][0], mx.float32)
                            reduce = {**call.reduce, "inputs": [partials, call.reduce["inputs"][1]]}
                            yield f"reduce_{str(dtype).split('.')[-1]}_D{D}", "reduce", reduce


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for the .metal files")
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    import macinfer  # noqa: F401  (before mlx)
    import metal_emulator
    import mlx

    from macinfer.kv import metal_attention as ma

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, kind, launch in pipelines():
            source = metal_emulator.generated_source(ma.build_kernel(kind), launch, Path(tmp))
            (out / f"{name}.metal").write_text('#include "mlx/backend/metal/kernels/utils.h"\n\n' + source)
            n += 1
    print(f"{n} kernel sources in {out}")
    print(os.path.join(os.path.dirname(mlx.__file__) if mlx.__file__ else mlx.__path__[0], "include"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
