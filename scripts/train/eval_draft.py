#!/usr/bin/env python
"""Measure a draft's speculative acceptance against the embedded SmolLM2-135M on held-out prompts.

Greedy decoding, k drafted tokens per step: the draft proposes k tokens greedily, the target
accepts the longest prefix equal to its own greedy tokens and adds one token of its own.
Reported: mean acceptance per drafted token (accepted / drafted) and tokens per target step.

Two measurements:
- default (fast, all held-out prompts): the target's greedy continuations (cached by
  ``train_draft.py data``, or generated here) are scored with ONE teacher-forced draft pass;
  this is exact for greedy drafting (while the draft agrees with the target it sees exactly the
  target's prefix; at its first miss the step ends), see ``train_draft.simulate_acceptance``.
- ``--real N``: real speculative decoding on N prompts with KV caches (k draft steps, one
  target verify pass over k+1 tokens, cache rollback), which also checks that the output equals
  plain greedy decoding.

Usage:
    python scripts/train/eval_draft.py                       # shipped draft, 48 held-out prompts, k=4
    python scripts/train/eval_draft.py --draft path/to/draft --real 3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import macinfer  # noqa: F401  (OpenBLAS before mlx)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_draft as td  # noqa: E402


def heldout_sequences(model, tokenizer, n: int, max_new: int):
    """Held-out (tokens, n_prompt, ...) with the target's greedy continuation: cached or generated."""
    prompts = td.heldout_prompts()[:n]
    cached = {}
    for seq in td.load_shards("heldout", max_new):
        cached[tuple(seq[0][: seq[1]].tolist())] = seq
    out, missing = [], []
    for p in prompts:
        ids = tuple(td.chat_ids(tokenizer, p))
        if ids in cached:
            out.append(cached[ids])
        else:
            missing.append(list(ids))
    eos = set(tokenizer.eos_token_ids)
    for s in range(0, len(missing), 16):
        out += td.generate_batch(model, missing[s: s + 16], max_new, 0.0, eos, seed=0)
    return out


def speculative_greedy(target, draft, prompt_ids, max_new: int, k: int, eos: set[int]):
    """Real greedy speculative decoding; returns (tokens, accepted, drafted, target_steps)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    tc, dc = make_prompt_cache(target), make_prompt_cache(draft)
    x = mx.array([prompt_ids])
    y = int(mx.argmax(target(x, cache=tc)[0, -1]))
    mx.eval(draft(x[:, :-1], cache=dc))  # the draft sees the prompt minus its last token
    out, accepted, drafted, steps = [y], 0, 0, 1
    pending = [prompt_ids[-1], y]  # tokens the draft has not processed yet
    while len(out) < max_new and out[-1] not in eos:
        props = []
        logits = draft(mx.array([pending]), cache=dc)
        for i in range(k):
            t = int(mx.argmax(logits[0, -1]))
            props.append(t)
            if i < k - 1:
                logits = draft(mx.array([[t]]), cache=dc)
        preds = mx.argmax(target(mx.array([[out[-1]] + props]), cache=tc)[0], axis=-1).tolist()
        n = 0
        while n < k and props[n] == preds[n]:
            n += 1
        new = props[:n] + [preds[n]]
        accepted += n
        drafted += k
        steps += 1
        # target processed out[-1] + k proposals; keep out[-1] + n accepted
        trim_prompt_cache(tc, k - n)
        # draft processed pending + props[:k-1]; keep pending + props[:n] (n <= k-1), else all
        if n < k:
            trim_prompt_cache(dc, k - 1 - n)
            pending = [preds[n]]
        else:
            pending = [props[k - 1], preds[n]]
        out += new
    return out[:max_new], accepted, drafted, steps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="smollm2-135m", help="shipped draft name or a draft directory")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=48, help="held-out prompts (at most 48)")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--real", type=int, default=0, help="also run real speculative decoding on N prompts")
    args = ap.parse_args()

    from macinfer.spec_decode.draft_model import load_draft

    t0 = time.time()
    target, tokenizer, _ = td.load_target()
    draft = load_draft(args.draft, target, tokenizer)
    print(f"loaded target + draft in {time.time() - t0:.1f}s", flush=True)
    held = heldout_sequences(target, tokenizer, args.prompts, args.max_new)
    t0 = time.time()
    rows = td.draft_agreement(draft, held)
    n_pos = sum(len(r) for r in rows)
    print(f"{len(held)} held-out prompts, {n_pos} target tokens (greedy, up to {args.max_new} each); "
          f"scored in {time.time() - t0:.1f}s")
    print(f"draft top-1 agreement with the target: {sum(r.sum() for r in rows) / n_pos:.3f}")
    for k in sorted({1, 2, 3, 4, 5, 6, args.k}):
        acc, tps, steps = td.simulate_acceptance(rows, k)
        mark = "  <-" if k == args.k else ""
        print(f"k={k}: acceptance {acc:.3f} per drafted token, {tps:.2f} tokens per target step{mark}")
    if args.real:
        eos = set(tokenizer.eos_token_ids)
        A = D = S = T = 0
        for tok, n_p, *_ in held[: args.real]:
            plain = tok[n_p:].tolist()
            out, a, d, s = speculative_greedy(target, draft, tok[:n_p].tolist(), len(plain), args.k, eos)
            A, D, S, T = A + a, D + d, S + s, T + len(out)
            same = out == plain
            print(f"real: {len(out)} tokens, acceptance {a / max(d, 1):.3f}, {len(out) / s:.2f} tokens/step, "
                  f"equal to plain greedy: {same}")
        print(f"real k={args.k} over {args.real} prompts: acceptance {A / max(D, 1):.3f}, {T / max(S, 1):.2f} tokens per target step")


if __name__ == "__main__":
    main()
