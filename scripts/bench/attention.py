#!/usr/bin/env python3
"""Decode attention time vs context length: gather + SDPA (the reference) vs the Metal kernel.

One query token per sequence, one layer's K/V pool, blocks handed out in a
shuffled order (a pool after some churn; --contiguous for blocks in order, where
the reference can slice instead of gather). Times are medians over --repeats of
one layer's attention, evaluated; "per step" multiplies by --layers. The kernel
column is the ratio to the reference measured in the same run.

On a Mac the kernel is self-checked first (the same check the engine runs) and
timed only if it passes. Without Metal the script says so and times the
reference path alone. End-to-end decode tok/s is not measured here.

Usage: python scripts/bench/attention.py [--contexts 1024,2048,...,32768] [--batch 1]
       [--heads 9 --kv-heads 3 --head-dim 64] [--block-size 16] [--layers 30]
"""

from __future__ import annotations

import argparse
import sys


def make_problem(ctx, a, dtype):
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    BS = a.block_size
    per_seq = -(-ctx // BS)
    num_blocks = 1 + a.batch * per_seq  # block 0 is the null block
    ids = np.arange(1, num_blocks) if a.contiguous else rng.permutation(np.arange(1, num_blocks))
    pool_shape = (a.kv_heads, num_blocks * BS, a.head_dim)  # head-major slots (macinfer.kv.paged_attention)
    return dict(
        queries=mx.random.normal((a.batch, a.heads, 1, a.head_dim)).astype(dtype),
        k_pool=mx.random.normal(pool_shape).astype(dtype),
        v_pool=mx.random.normal(pool_shape).astype(dtype),
        block_tables=mx.array(ids.reshape(a.batch, per_seq).astype(np.int32)),
        context_lens=[ctx] * a.batch,
        block_size=BS,
        scale=a.head_dim**-0.5,
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=30, help="layers per decode step (SmolLM2-135M: 30)")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default=None,
                   help="default: float16 with Metal, float32 without (half is emulated on x86)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--contiguous", action="store_true", help="blocks in order instead of shuffled")
    p.add_argument("--e2e", metavar="MODEL", help="also time end-to-end decode tok/s of MODEL (needs a context "
                   "of at least the longest --e2e-contexts; default on Metal: smollm2-135m at 8k only)")
    p.add_argument("--e2e-contexts", default="8192,32768")
    p.add_argument("--e2e-tokens", type=int, default=16, help="decode tokens timed per context")
    a = p.parse_args(argv)

    import macinfer  # noqa: F401  (OpenBLAS before mlx)
    import mlx.core as mx

    from macinfer.kv import metal_attention as ma
    from macinfer.kv.kernel_dispatch import select_attention
    from macinfer.kv.paged_attention import paged_attention
    from macinfer.timing import median_ms

    metal = ma.metal_available()
    dtype = getattr(mx, a.dtype or ("float16" if metal else "float32"))
    print(f"mlx {mx.__version__}; Metal: {'yes, ' + mx.device_info().get('device_name', '') if metal else 'no'}")
    print(f"shape: batch {a.batch}, {a.heads} heads / {a.kv_heads} KV heads x {a.head_dim}, block {a.block_size}, "
          f"{dtype}, {'contiguous' if a.contiguous else 'shuffled'} blocks; baseline: gather + SDPA "
          f"(macinfer.kv.paged_attention)")
    kernel = None
    if not metal:
        print("no Metal on this host: the kernel cannot run here; timing the reference path only")
    else:
        try:
            select_attention("metal", paged_attention, head_dim=a.head_dim, block_size=a.block_size)
            kernel = ma.paged_attention_metal
            print("kernel self-check passed")
        except Exception as e:
            print(f"kernel not timed: {e}")

    itemsize = {mx.float16: 2, mx.bfloat16: 2, mx.float32: 4}[dtype]
    head = f"{'context':>8} {'ref ms':>9} {'ref GB/s':>9} {'ref/step ms':>12}"
    if kernel:
        head += f" {'kernel ms':>10} {'kern GB/s':>10} {'kern/step ms':>13} {'kernel/ref':>11}"
    print(head)
    for ctx in (int(c) for c in a.contexts.split(",")):
        args = make_problem(ctx, a, dtype)
        gb = 2 * a.batch * ctx * a.kv_heads * a.head_dim * itemsize / 1e9  # K and V read once
        ref = median_ms(lambda: paged_attention(**args), a.repeats)
        row = f"{ctx:>8} {ref:>9.3f} {gb / ref * 1e3:>9.1f} {ref * a.layers:>12.2f}"
        if kernel:
            ker = median_ms(lambda: kernel(**args), a.repeats)
            row += f" {ker:>10.3f} {gb / ker * 1e3:>10.1f} {ker * a.layers:>13.2f} {ker / ref:>10.2f}x"
        print(row, flush=True)
        del args

    model = a.e2e or ("smollm2-135m" if metal else None)
    if model is None:
        print("end-to-end decode: skipped (no Metal; pass --e2e MODEL to time the reference path anyway)")
    else:
        end_to_end(model, [int(c) for c in a.e2e_contexts.split(",")], a.e2e_tokens,
                   ["reference", "metal"] if kernel else ["reference"])


def end_to_end(spec, contexts, n_tokens, backends):
    """Decode tok/s of a whole model at long contexts, one engine per attention backend.

    The context is a random prompt prefilled once per backend (slow on a CPU host:
    prefill is the expensive part); only the decode steps after it are timed.
    """
    import random
    import time

    from macinfer.engine.llm_engine import LLMEngine
    from macinfer.modelio.loader import load_model
    from macinfer.core.sampling import SamplingParams

    model, tok, info = load_model(spec)
    print(f"end-to-end decode, {info.name} ({info.quantization}), {n_tokens} tokens after the context")
    for ctx in contexts:
        if ctx + n_tokens >= info.context_length:
            print(f"  {ctx:>6} tokens: beyond {info.name}'s context of {info.context_length}; skipped")
            continue
        prompt = [random.Random(ctx).randrange(info.config.get("vocab_size", 1000)) for _ in range(ctx)]
        rates = {}
        for backend in backends:
            engine = LLMEngine(model, tok, info, attention=backend, max_num_seqs=1, enable_prefix_cache=False,
                               max_num_batched_tokens=2048, max_model_len=ctx + n_tokens + 1)
            engine.add_request(prompt, SamplingParams(max_tokens=n_tokens, ignore_eos=True))
            start = None
            while engine.has_unfinished():
                for d in engine.step():
                    if start is None and d.token_ids:
                        start = time.perf_counter()  # first token out: prefill done
            rates[backend] = (n_tokens - 1) / (time.perf_counter() - start)
        line = "   ".join(f"{b} {r:.1f} tok/s" for b, r in rates.items())
        if "metal" in rates:
            line += f"   metal/reference {rates['metal'] / rates['reference']:.2f}x"
        print(f"  {ctx:>6} tokens: {line}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
