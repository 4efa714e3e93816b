"""Benchmark hybrid / state-space models on the engine against mlx-lm's own batching, side by side.

For each family (a mid-size random-weight float32 model built on the spot, tests/tiny.py), N
requests of P prompt tokens and T new tokens each go through

  - macinfer's LLMEngine (state slots beside the paged KV cache, continuous batching), and
  - mlx-lm's batch_generate (BatchGenerator: right-padded prompts with per-row lengths),

runs of the two interleaved (shared, noisy machines). Printed: wall time of each, the ratio
(mlx-lm / macinfer: above 1 is faster here), the engine's decode ms/step, the time spent
binding state slots per forward (macinfer.kv.state_cache.StateStore.bind), and the state bytes.

Usage:
    python scripts/bench/hybrid.py                      # qwen3_next, mamba2; 1, 4, 16 requests
    python scripts/bench/hybrid.py --families lfm2 --concurrency 8 --tokens 64
    python scripts/bench/hybrid.py --save /tmp/qn --size tiny   # write the model for `macinfer bench`:
    macinfer bench /tmp/qn --compare mlx-lm -c 1,16 -p 64 -n 32 --repeats 3
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import macinfer  # noqa: E402,F401  (OpenBLAS before mlx)
import mlx_lm  # noqa: E402
from mlx_lm.generate import batch_generate  # noqa: E402

from macinfer.core.sampling import SamplingParams  # noqa: E402
from macinfer.engine.llm_engine import LLMEngine  # noqa: E402
from macinfer.kv import state_cache  # noqa: E402
from tiny import build_tiny_model  # noqa: E402

# Mid-size shapes (hidden 512, 8 layers): big enough that compute, not Python, dominates a step.
FAMILIES = {
    "qwen3_next": dict(model_type="qwen3_next", linear_num_value_heads=8, linear_num_key_heads=4,
                       linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, head_dim=64,
                       partial_rotary_factor=0.25, full_attention_interval=4, num_hidden_layers=8, num_experts=4,
                       num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=512,
                       mlp_only_layers=[], moe_intermediate_size=256),
    "mamba2": dict(model_type="mamba2", num_heads=16, head_dim=64, intermediate_size=1024, expand=2, state_size=64,
                   num_hidden_layers=8, layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=2, use_bias=False,
                   use_conv_bias=True, time_step_limit=[0.01, 10.0], time_step_rank="auto"),
    "lfm2": dict(model_type="lfm2", norm_eps=1e-5, full_attn_idxs=[2, 5, 7], num_hidden_layers=8, conv_bias=True,
                 conv_L_cache=3, block_dim=512, block_ff_dim=1024, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                 block_auto_adjust_ff_dim=False),
}


def run_engine(model, tok, prompts, tokens, max_seqs):
    bind_s, binds = [0.0], [0]
    bind = state_cache.StateStore.bind

    def timed(self, *a):
        t = time.perf_counter()
        bind(self, *a)
        bind_s[0] += time.perf_counter() - t
        binds[0] += 1

    state_cache.StateStore.bind = timed
    try:
        engine = LLMEngine(model, tok, None, num_blocks=4096, block_size=16, max_num_seqs=max_seqs)  # default budget
        t = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_tokens=tokens, ignore_eos=True), request_id=str(i))
        steps, decode_steps, decode_s = 0, 0, 0.0
        while engine.has_unfinished():
            decoding = all(s.num_uncomputed_tokens == 1 for s in engine.scheduler.running) and not engine.scheduler.waiting
            t0 = time.perf_counter()
            engine.step()
            if decoding:
                decode_steps += 1
                decode_s += time.perf_counter() - t0
            steps += 1
        return time.perf_counter() - t, decode_s / max(decode_steps, 1), bind_s[0] / max(binds[0], 1), engine.state_bytes
    finally:
        state_cache.StateStore.bind = bind


# The tiny shape (hidden 64, 4 layers): a step is mostly the host's work, as for a small model on a fast GPU.
TINY = dict(hidden_size=64, heads=4, kv_heads=2, num_hidden_layers=4, head_dim=16, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            shared_expert_intermediate_size=128, moe_intermediate_size=64)


# Between the two (hidden 256, 4 layers, 17 MB of weights): the largest that decodes through compiled graphs.
SMALL = dict(hidden_size=256, heads=4, kv_heads=2, num_hidden_layers=4, moe_intermediate_size=128,
             shared_expert_intermediate_size=256)


def build(out: Path, family: str, size: str) -> Path:
    """The benchmark's model: `mid` (hidden 512, 8 layers), or `tiny` / `small` (qwen3_next only)."""
    if size in ("tiny", "small"):
        if family != "qwen3_next":
            raise SystemExit(f"--size {size} is defined for qwen3_next only")
        return build_tiny_model(out, "llama", **{**FAMILIES[family], **(TINY if size == "tiny" else SMALL)})
    return build_tiny_model(out, "llama", hidden_size=512, heads=8, kv_heads=2, **FAMILIES[family])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save", type=Path, help="Only write the (first) family's model to this directory, and stop.")
    ap.add_argument("--size", choices=["mid", "small", "tiny"], default="mid")
    ap.add_argument("--families", default="qwen3_next,mamba2")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if args.save:
        print(build(args.save, args.families.split(",")[0], args.size))
        return
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        for fam in args.families.split(","):
            path = build(Path(tmp) / fam, fam, args.size)
            model, tok = mlx_lm.load(str(path))
            for n in map(int, args.concurrency.split(",")):
                prompts = [[rng.randrange(3, 300) for _ in range(args.prompt)] for _ in range(n)]
                ours, theirs = [], []
                for _ in range(args.repeats):
                    ours.append(run_engine(model, tok, prompts, args.tokens, max(n, 1)))
                    t = time.perf_counter()
                    batch_generate(model, tok, prompts, max_tokens=args.tokens)
                    theirs.append(time.perf_counter() - t)
                best = min(ours)
                print(f"{fam:11s} {n:3d} requests x ({args.prompt} + {args.tokens}) tokens: macinfer {best[0]:.2f} s, "
                      f"mlx-lm batch_generate {min(theirs):.2f} s -> {min(theirs) / best[0]:.2f}x; "
                      f"decode {best[1] * 1e3:.1f} ms/step, bind {best[2] * 1e3:.2f} ms/forward, "
                      f"state {best[3] / 2**20:.1f} MiB", flush=True)


if __name__ == "__main__":
    main()
