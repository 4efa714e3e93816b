#!/usr/bin/env python3
"""Quantised KV cache on the embedded model: memory saved and what it costs in output.

For each KV precision (float32 on CPU hosts, 8-bit, 4-bit; group 32) the same chat
prompts run greedily, all batched together in one engine, and are compared with
the float-KV outputs of the same run: tokens identical before the first
difference, overall token agreement, bytes per token and pool size for a fixed
number of tokens.

Usage: python scripts/bench/kv_quant.py [--model smollm2-135m] [--tokens 24] [--dequantize]
"""

from __future__ import annotations

import argparse
import time

import macinfer  # noqa: F401  (OpenBLAS before mlx)

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for writing clean Python code.",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "What is 12 times 7?",
    "Name three planets of the solar system.",
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--dequantize", action="store_true")
    a = ap.parse_args()

    from macinfer.engine.llm_engine import LLMEngine
    from macinfer.modelio.loader import load_model
    from macinfer.core.sampling import SamplingParams

    model, tok, info = load_model(a.model, dequantize=a.dequantize)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS]
    results = {}
    for bits in (None, 8, 4):
        engine = LLMEngine(model, tok, info, num_blocks=16 * len(prompts) + 1, kv_bits=bits, enable_prefix_cache=False)
        t = time.perf_counter()
        rids = [engine.add_request(p, SamplingParams(max_tokens=a.tokens)) for p in prompts]
        outs = {}
        while engine.has_unfinished():
            for d in engine.step():
                if d.output is not None:
                    outs[d.request_id] = d.output
        results[bits] = ([outs[r] for r in rids], engine.bytes_per_token, engine.runner.kv_bytes,
                         time.perf_counter() - t)
    base, base_bpt, base_pool, _ = results[None]
    print(f"{info.name} [{info.quantization}], {len(prompts)} chat prompts batched, {a.tokens} greedy tokens each")
    print(f"{'KV':8s} {'bytes/token':>12s} {'pool':>10s} {'saved':>7s} {'same-prefix':>12s} {'agreement':>10s} {'time':>7s}")
    for bits, (outs, bpt, pool, secs) in results.items():
        same, agree, total = [], 0, 0
        for o, b in zip(outs, base):
            x, y = o.token_ids, b.token_ids
            same.append(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y))))
            agree += sum(p == q for p, q in zip(x, y))
            total += max(len(x), len(y))
        label = "float" if bits is None else f"{bits}-bit"
        print(f"{label:8s} {bpt:12,d} {pool / 2**20:8.1f}MB {1 - pool / base_pool:7.1%} "
              f"{sum(same) / len(same):12.1f} {agree / total:10.1%} {secs:6.1f}s")
    for bits in (8, 4):
        for o, b in zip(results[bits][0], base):
            if o.text != b.text:
                print(f"  {bits}-bit differs: {b.text[:50]!r} -> {o.text[:50]!r}")


if __name__ == "__main__":
    main()
