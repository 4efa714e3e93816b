#!/usr/bin/env python3
"""The paged-attention kernels over the whole grid, in the C++ SIMT emulator, against the NumPy reference.

Every dtype x head size (64/80/96/128/256) x block size (16/32) x float and 8-bit KV x GQA 1/2/4/8 x
q_len 1-8 (rows per KV head at most 32) x one pass and split, on ragged rows with a window or chunks
for some; plus 32k contexts. The suite runs a modest part of this (tests/test_metal_attention.py);
this is the whole of it, for a change to the kernel. Prints one line per failure and a summary;
exits 1 if any case disagrees. Needs clang++ or g++ (tests/metal_emulator.py).

Usage: python scripts/metal_emulator_grid.py [--quick] [--long]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="float32 and head sizes 64/128 only")
    p.add_argument("--long", action="store_true", help="also 32k-token contexts (minutes)")
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    import macinfer  # noqa: F401  (before mlx)
    import metal_emulator as me
    import mlx.core as mx
    import numpy as np

    from macinfer.kv import metal_attention as ma

    names = {"float": ma.INPUT_NAMES, "quant": ma.QUANT_INPUT_NAMES, "reduce": ma.REDUCE_INPUT_NAMES}
    emu = me.Emulator(Path(tempfile.gettempdir()) / "macinfer-metal-emulator")
    dtypes = (mx.float32,) if a.quick else ma.SUPPORTED_DTYPES
    dims = (64, 128) if a.quick else (64, 80, 96, 128, 256)
    cases = []
    for i, (dtype, D, BS, bits, gqa, QL, splits) in enumerate(itertools.product(
            dtypes, dims, (16, 32), (None, 8), (1, 2, 4, 8), range(1, 9), (1, 3))):
        if (bits and D % 32) or gqa * QL > ma.MAX_ROWS:
            continue
        masking = [{}, {"window": 2 * BS + 3}, {"chunk": BS + 5}, {"sinks": True}][i % 4]
        lens = [QL, 2 * BS, 5 * BS - 1, 9 * BS + 7]
        cases.append((dict(context_lens=lens, q_len=QL, n_heads=2 * gqa, n_kv_heads=2, head_dim=D, block_size=BS,
                           dtype=dtype, kv_bits=bits, **masking), splits))
    if a.long:
        cases += [(dict(context_lens=[32768], q_len=q, n_heads=16, n_kv_heads=2, head_dim=128, block_size=16,
                        dtype=d, kv_bits=b), None) for q in (1, 4) for d in dtypes for b in (None, 8)]
    t0 = time.time()
    calls = []
    for i, (case, splits) in enumerate(cases):  # register every pipeline, then build them in one go
        args = ma.random_problem(i, **case)
        call = ma.kernel_call(**args, splits=splits)
        emu.key(ma.build_kernel(call.kind), call.pass1, names[call.kind])
        if call.reduce is not None:
            partials = mx.zeros(call.pass1["output_shapes"][0], mx.float32)
            emu.key(ma.build_kernel("reduce"), {**call.reduce, "inputs": [partials, call.reduce["inputs"][1]]},
                    names["reduce"])
        calls.append((args, call, splits, case))
    emu.build()
    print(f"{len(emu.libs)} pipelines built in {time.time() - t0:.0f} s; {len(calls)} cases", flush=True)
    failed = 0
    for args, call, splits, case in calls:
        out, _ = emu.run(ma.build_kernel(call.kind), call.pass1, names[call.kind])
        if call.reduce is not None:
            out, _ = emu.run(ma.build_kernel("reduce"), {**call.reduce, "inputs": [out, call.reduce["inputs"][1]]},
                             names["reduce"])
        want = ma.paged_attention_online(**args, splits=splits)
        tol = 1e-5 if args["queries"].dtype == mx.float32 else ma.TOLERANCE[args["queries"].dtype]
        got, want = np.array(out.astype(mx.float32)), np.array(want.astype(mx.float32))
        if not np.allclose(got, want, rtol=tol, atol=tol):
            failed += 1
            print(f"FAILED {case} splits={splits}: max |diff| {np.abs(got - want).max():.3g}", flush=True)
    print(f"{len(calls) - failed} of {len(calls)} cases match the reference ({time.time() - t0:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
