"""Benchmark speculative decoding: speed-up over plain decode, beside mlx-lm's, one run.

The embedded SmolLM2-135M with float32 weights (on the CPU backend a quantised
verify of k tokens costs ~k single-token steps; float32 + OpenBLAS is nearly
flat in tokens, like Metal: docs/platform.md). Every figure is a ratio to plain
decoding measured in the same run, the configurations interleaved per prompt:

  1. single stream, greedy: chat prompts, a code-editing prompt that repeats
     its input, and a random-text prompt (sampled at temperature 1, where no
     drafter can guess: adaptive k must keep it at ~1x). macinfer with no
     draft / n-gram / the shipped feature draft ("feature", EAGLE-style: it
     reads the target's hidden states, which mlx-lm cannot give it) / the
     default "auto" (that feature draft plus n-gram lookup where the text
     repeats itself) / the shipped token draft ("tokens", a small mlx-lm
     model), and mlx-lm's stream_generate without and with that same token
     draft (`draft_model=`, fixed k);
  2. 8 concurrent requests (continuous batching), with vs without speculation
     (medians of --reps too).

With --heldout N, instead: chat speed over N of scripts/train/train_draft.py's held-out chat
prompts (topics the drafts never trained on), single stream, greedy, stopping at EOS: plain,
n-gram lookup, the feature draft, the token draft and auto, interleaved per prompt (order
rotated), each prompt --reps times per engine (a prompt's ratio: the median of its runs),
reported as total decoded tokens over total decode time per engine and per-prompt speed-ups (min
/ median / max); then a text that never repeats (random words sampled at T=1, four seeds, judged
by total tokens over total time: one run's ratio moves by +-5% on this host), and
the checks auto is held to (>= the best single drafter, >= 1.2x, no prompt below 0.95x, >= 0.97x
on the never-repeating text). Three fixed chat prompts say little about chat in general; this says
more. --candidate DIR adds a feature draft being considered, alone and with lookup.

Usage:
    python scripts/bench/spec.py                     # ~10 min on 2 shared cores
    python scripts/bench/spec.py --tokens 32 --quick # fewer prompts
    python scripts/bench/spec.py --heldout 12 --reps 3          # the checks in issue 40
    python scripts/bench/spec.py --heldout 48 --tokens 96
    python scripts/bench/spec.py --heldout 24 --tokens 96 --candidate ~/.cache/macinfer/my-draft
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# NOTE: not this script's own folder first: its gguf.py would shadow the gguf package macinfer imports.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import macinfer  # noqa: E402,F401  (OpenBLAS before mlx)

from macinfer.engine.llm_engine import LLMEngine  # noqa: E402
from macinfer.core.sampling import SamplingParams  # noqa: E402

CHAT = [
    "What is the capital of France? Answer in one sentence.",
    "Give me three tips for staying focused while studying.",
    "Explain what a hash table is to a beginner.",
]
# A code edit whose answer repeats the input (SmolLM2-135M does copy this one; asked to fix a
# typo in a longer function it rewrites the body instead, and there is nothing to look up).
CODE = '''Rename the variable `x` to `count` in this code and show the full result.

x = 0
for item in items:
    if item.is_valid():
        x = x + 1
    else:
        print("skipping", item.name)
print("valid items:", x)
print("invalid items:", len(items) - x)
'''
RANDOM = "Continue this list of random words: zebra quantum velvet 7 orbit mango 42 tundra flux cobalt"
# The never-repeating text is sampled with this many seeds (--reps runs each) and judged by total tokens
# over total time: one run's ratio moves by +-5% here with nothing drafted (n-gram lookup that found no
# match, 15 runs: 0.946-1.078x), so one text's median of three cannot tell 0.97x from 1.0x.
RANDOM_SEEDS = 4


def load():
    from macinfer.spec_decode.draft_model import load_draft
    from macinfer.modelio.loader import load_model

    model, tok, info = load_model(None, dequantize=True)
    tokens_draft = load_draft("smollm2-135m-tokens", model, tok)
    return model, tok, info, tokens_draft


def chat_ids(tok, text):
    return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))


def run_engine(engine, prompts, params):
    """Serve prompts together; returns (outputs, decode-phase tok/s aggregated)."""
    rids = [engine.add_request(p, params) for p in prompts]
    outs, t_all_started = {}, None
    while engine.has_unfinished():
        for d in engine.step():
            if d.output is not None:
                outs[d.request_id] = d.output
        if t_all_started is None and all(
                engine.requests.get(r) is None or engine.requests[r].num_output_tokens > 0 for r in rids):
            t_all_started, tokens_then = time.perf_counter(), sum(
                engine.requests[r].num_output_tokens if r in engine.requests else len(outs[r].token_ids) for r in rids)
    total = sum(len(outs[r].token_ids) for r in rids)
    rate = (total - tokens_then) / (time.perf_counter() - t_all_started)
    return [outs[r] for r in rids], rate


def mlx_lm_tps(model, tok, prompt, max_tokens, draft=None, k=3):
    from mlx_lm.generate import stream_generate

    last, toks = None, []
    for r in stream_generate(model, tok, prompt, max_tokens=max_tokens, draft_model=draft, num_draft_tokens=k):
        last = r
        toks.append(r.token)
    return last.generation_tps, toks


class VirtualClock:
    """--simulate A,b,D,H: time.perf_counter as a cost model, so ratios do not depend on what else runs.

    Each target forward of n tokens (rows x width, padding included) costs A + b x n seconds, each
    draft round D (the token draft's: 3 x D), each synchronous step H more (the host's work per
    step, which a queued step overlaps with the one before); nothing else costs time. Everything
    the engines time (their step costs, which adaptive k weighs; each request's decode rate) reads
    this clock, so a run shows what each drafting policy would give on a quiet machine with those
    costs; the real figure needs a real run. Defaults: float32 SmolLM2 on a 2-core x86 with
    OpenBLAS, quiet: a 64 ms step, +9.5 ms per verified token, 4 ms per feature-draft round, 5 ms
    of host work per step.
    """

    def __init__(self, spec: str):
        self.a, self.b, self.d, self.h = (float(x) / 1000 for x in spec.split(","))
        self.now = 0.0
        time.perf_counter = lambda: self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds

    def instrument(self, engine) -> None:
        runner = engine.runner
        forward, launch, execute = runner.run_forward, runner.launch_decode, runner.execute_model

        def execute_model(scheduled):  # a synchronous step: the host's work is not hidden
            self.tick(self.h)
            return execute(scheduled)

        def run_forward(tables, starts, tokens, *a, **kw):
            self.tick(self.a + self.b * len(tokens) * max(len(t) for t in tokens))
            return forward(tables, starts, tokens, *a, **kw)

        def launch_decode(seqs, tokens):
            self.tick(self.a + self.b * len(seqs))
            return launch(seqs, tokens)

        runner.run_forward, runner.launch_decode, runner.execute_model = run_forward, launch_decode, execute_model
        if engine.spec_decoder is None:
            return
        drafter = getattr(engine.spec_decoder.drafter, "model", engine.spec_decoder.drafter)
        for name, cost in (("_run", self.d), ("_forward", 3 * self.d)):  # a feature round; a token-draft round
            fn = getattr(drafter, name, None)
            if fn is not None:
                setattr(drafter, name, lambda *a, fn=fn, cost=cost: (self.tick(cost), fn(*a))[1])


def heldout_chat(args):
    """Chat speed over held-out prompts, one stream: plain against each drafter and auto (module docstring).

    Each prompt runs --reps times per engine, the engines' order rotated per run (this CPU's speed
    drifts, and other work shares it); a prompt's ratio is the median of its runs' ratios. Then a
    text that never repeats (random words, sampled at temperature 1) with RANDOM_SEEDS seeds, --reps
    runs each, its ratio the engines' total tokens over total time.
    """
    sys.path.insert(0, str(ROOT / "scripts" / "train"))
    from train_draft import heldout_prompts

    from macinfer.modelio.loader import load_model

    model, tok, info = load_model(None, dequantize=True)
    opts = dict(kv_memory="192MB", max_num_seqs=1, enable_prefix_cache=False, num_speculative_tokens=args.k)
    drafts = {"plain": None, "ngram": "ngram", "feature": "smollm2-135m", "tokens": "smollm2-135m-tokens",
              "auto": "auto"}
    options = [("plain", None)] + [(k, drafts[k]) for k in args.engines.split(",") if k != "plain"]
    if args.candidate:  # a draft being considered, beside the shipped one in the same run
        options += [("cand", args.candidate), ("cand+ng", args.candidate + "+ngram")]
    clock = VirtualClock(args.simulate) if args.simulate else None
    engines = {k: LLMEngine(model, tok, info, draft=d, **opts) for k, d in options}
    if clock is not None:
        for e in engines.values():
            clock.instrument(e)
    prompts = [chat_ids(tok, t) for t in heldout_prompts()[: args.heldout]]
    for e in engines.values():
        run_engine(e, [prompts[0]], SamplingParams(max_tokens=4))
    print(f"SmolLM2-135M float32, {len(prompts)} held-out chat prompts, up to {args.tokens} tokens each, one stream, "
          f"greedy, {args.reps} runs per prompt and engine, macinfer k <= {args.k} (adaptive)"
          + (f"; SIMULATED times (cost model {args.simulate} ms: A, b, D, H)" if clock else ""), flush=True)
    greedy = SamplingParams(max_tokens=args.tokens)
    totals, per_prompt, same = _interleaved(engines, prompts, greedy, args.reps, "prompt")
    print(f"a text that never repeats (random words, sampled at T=1, {RANDOM_SEEDS} seeds):", flush=True)
    random_totals = {k: [0, 0.0, 0, 0] for k in engines}
    for seed in range(RANDOM_SEEDS):
        never = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=1.0, seed=seed)
        got, _, _ = _interleaved(engines, [chat_ids(tok, RANDOM)], never, args.reps, f"seed {seed}", seed * args.reps)
        for k, t in got.items():
            random_totals[k] = [a + b for a, b in zip(random_totals[k], t)]
    plain = random_totals["plain"][0] / random_totals["plain"][1]
    random_ratio = {k: t[0] / t[1] / plain for k, t in random_totals.items()}
    _report(engines, totals, per_prompt, random_ratio, same)


def _interleaved(engines, prompts, params, reps, label, turn=0):
    """Every prompt `reps` times per engine, order rotated (from `turn`); (totals, per-prompt median ratios,
    same output)."""
    keys = list(engines)
    totals = {k: [0, 0.0, 0, 0] for k in keys}  # tokens, seconds, drafted, accepted
    ratios = {k: [] for k in keys}
    same = True
    for i, ids in enumerate(prompts):
        runs = {k: [] for k in keys}
        for _ in range(reps):
            order = keys[turn % len(keys):] + keys[: turn % len(keys)]
            turn += 1
            outs = {}
            for key in order:
                (out,), _ = run_engine(engines[key], [ids], params)
                outs[key] = out
                m = out.metrics
                if m.decode_time:
                    t = totals[key]
                    t[0] += m.generation_tokens - 1
                    t[1] += m.decode_time
                    t[2] += m.draft_tokens
                    t[3] += m.accepted_tokens
            same = same and (not params.greedy or all(o.token_ids == outs["plain"].token_ids for o in outs.values()))
            if all(o.metrics.decode_tps for o in outs.values()):
                for k in keys:
                    runs[k].append(outs[k].metrics.decode_tps / outs["plain"].metrics.decode_tps)
        for k in keys:
            ratios[k].append(statistics.median(runs[k]) if runs[k] else float("nan"))
        print(f"  {label} {i + 1:2}: {len(outs['plain'].token_ids):3} tokens, plain "
              f"{outs['plain'].metrics.decode_tps or 0:5.1f} tok/s, "
              + ", ".join(f"{k} {ratios[k][-1]:.2f}x" for k in keys if k != "plain"), flush=True)
    return totals, ratios, same


def _report(engines, totals, per_prompt, random_ratio, same):
    base = totals["plain"][0] / totals["plain"][1]
    print(f"total: plain {base:.1f} tok/s")
    overall = {}
    for k in [k for k in engines if k != "plain"]:
        tokens, seconds, drafted, accepted = totals[k]
        overall[k] = tokens / seconds / base
        r = sorted(per_prompt[k])
        print(f"  {k:8} {tokens / seconds:5.1f} tok/s ({overall[k]:.2f}x overall; per prompt {r[0]:.2f} / "
              f"{statistics.median(r):.2f} / {r[-1]:.2f}x min / median / max; never-repeating text "
              f"{random_ratio[k]:.2f}x), {accepted} of {drafted} drafts accepted ({accepted / max(drafted, 1):.2f})",
              flush=True)
        spec = engines[k].spec_decoder
        if spec is not None and spec.step_cost.ready:  # what adaptive k weighed, as the engine measured it
            a, b = spec.step_cost.coeffs()
            print(f"           step = {1e3 * a:.1f} + {1e3 * b:.1f} ms x tokens, synchronous step +"
                  f"{1e3 * spec.step_cost.sync_penalty:.1f} ms, draft round {1e3 * spec.draft_round_seconds():.1f} ms")
    print(f"greedy outputs identical to plain: {'yes' if same else 'NO'}")
    if "auto" in overall:
        singles = {k: v for k, v in overall.items() if k not in ("auto", "cand", "cand+ng")}
        best = max(singles, key=singles.get) if singles else None
        checks = ([(f"auto >= the best single drafter ({best} {singles[best]:.2f}x)", overall["auto"] >= singles[best])]
                  if best else [])
        checks += [("auto >= 1.2x plain", overall["auto"] >= 1.2),
                   ("no held-out prompt below 0.95x", min(per_prompt["auto"]) >= 0.95),
                   ("never-repeating text >= 0.97x", random_ratio["auto"] >= 0.97)]
        for what, ok in checks:
            print(f"  {'ok  ' if ok else 'FAIL'} {what}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--quick", action="store_true", help="one chat prompt, no mlx-lm, no batch")
    ap.add_argument("--k", type=int, default=12, help="macinfer's most drafts per step (adaptive below it)")
    ap.add_argument("--reps", type=int, default=3, help="runs per configuration (medians)")
    ap.add_argument("--heldout", type=int, default=0, metavar="N",
                    help="instead: chat speed over N held-out chat prompts (1-48; see above)")
    ap.add_argument("--simulate", metavar="A,b,D,H", nargs="?", const="54.5,9.5,4,5", default="",
                    help="with --heldout: time by a cost model (ms per forward, per token, per draft round, per "
                         "synchronous step) "
                         "instead of the clock, so policies compare on a busy machine (see VirtualClock)")
    ap.add_argument("--engines", default="ngram,feature,tokens,auto",
                    help="with --heldout: the drafters run beside plain (ngram, feature, tokens, auto)")
    ap.add_argument("--candidate", metavar="DIR", default="",
                    help="with --heldout: also time this feature draft directory, alone and with n-gram lookup")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    if not 0 <= args.heldout <= 48:
        ap.error("--heldout takes 1 to 48 prompts")
    if args.candidate:
        from macinfer.spec_decode.feature_draft import is_feature_draft

        if not args.heldout:
            ap.error("--candidate goes with --heldout N")
        if not is_feature_draft(Path(args.candidate).expanduser()):
            ap.error(f"--candidate {args.candidate} is not a feature draft directory (see scripts/train/train_eagle.py)")
        args.candidate = str(Path(args.candidate).expanduser())
    if args.heldout:
        return heldout_chat(args)
    model, tok, info, draft = load()
    opts = dict(kv_memory="192MB", max_num_seqs=8, enable_prefix_cache=False, num_speculative_tokens=args.k)
    engines = {
        "plain": LLMEngine(model, tok, info, **opts),
        "ngram": LLMEngine(model, tok, info, draft="ngram", **opts),
        "feature": LLMEngine(model, tok, info, draft="smollm2-135m", **opts),
        "auto": LLMEngine(model, tok, info, draft="auto", **opts),
        "tokens": LLMEngine(model, tok, info, draft=draft, **opts),
    }
    drafters = [k for k in engines if k != "plain"]
    greedy = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    sampled = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=1.0, seed=0)
    cases = [(f"chat {i + 1}", chat_ids(tok, t), greedy) for i, t in enumerate(CHAT[:1] if args.quick else CHAT)]
    # The edit stops at EOS: past its answer the model would ramble on, which is not an edit.
    cases += [("code edit", chat_ids(tok, CODE), SamplingParams(max_tokens=2 * args.tokens)),
              ("random (T=1)", chat_ids(tok, RANDOM), sampled)]
    for e in engines.values():  # warm-up (compilation of shapes, BLAS threads)
        run_engine(e, [cases[0][1]], SamplingParams(max_tokens=4))

    print(f"SmolLM2-135M float32, {args.tokens} tokens/request, medians of {args.reps}, macinfer k <= {args.k} (adaptive), "
          f"mlx-lm k = 3 (fixed); decode tok/s and speed-up over plain decode of the same engine")
    print(f"{'prompt':14} {'plain':>7}" + "".join(f" {k:>14}" for k in drafters)
          + f" {'acceptance':>15} | {'mlx-lm':>7} {'mlx-lm+tokens':>14}  same")
    for name, ids, params in cases:
        res, runs = {}, {k: [] for k in engines}
        for r in range(args.reps):  # rotate which engine goes first: this CPU's speed drifts
            keys = list(engines)[r % len(engines):] + list(engines)[: r % len(engines)]
            for key in keys:
                (out,), _ = run_engine(engines[key], [ids], params)
                res[key] = out
                runs[key].append(out.metrics.decode_tps)
        tps = {k: statistics.median(v) for k, v in runs.items()}
        acc = "/".join("-" if res[k].metrics.acceptance_rate is None else f"{res[k].metrics.acceptance_rate:.2f}"
                       for k in drafters)
        same = params.greedy and all(res[k].token_ids == res["plain"].token_ids for k in drafters)
        line = f"{name:14} {tps['plain']:7.1f}" + "".join(
            f" {tps[k]:7.1f} ({tps[k] / tps['plain']:.2f}x)" for k in drafters) + f" {acc:>15} |"
        if not args.quick:
            base = statistics.median([mlx_lm_tps(model, tok, ids, params.max_tokens)[0] for _ in range(args.reps)])
            spec = statistics.median([mlx_lm_tps(model, tok, ids, params.max_tokens, draft=draft)[0]
                                      for _ in range(args.reps)])
            line += f" {base:7.1f} {spec:7.1f} ({spec / base:.2f}x)"
        print(line + f"  {'yes' if same else ('n/a' if not params.greedy else 'NO')}", flush=True)

    if not args.quick:
        prompts = [chat_ids(tok, t) for t in (CHAT * 3)[:8]]
        print("\n8 concurrent requests (chat prompts, greedy), aggregate decode tok/s:")
        runs, accs = {k: [] for k in engines}, {k: [] for k in engines}
        for r in range(args.reps):
            keys = list(engines)[r % len(engines):] + list(engines)[: r % len(engines)]
            for key in keys:
                outs, rate = run_engine(engines[key], prompts, greedy)
                runs[key].append(rate)
                accs[key] += [o.metrics.acceptance_rate for o in outs if o.metrics.acceptance_rate is not None]
        rates = {k: statistics.median(v) for k, v in runs.items()}
        for key in engines:
            acc = accs[key]
            print(f"  {key:8} {rates[key]:7.1f} tok/s ({rates[key] / rates['plain']:.2f}x)"
                  + (f", mean acceptance {sum(acc) / len(acc):.2f}" if acc else ""), flush=True)


if __name__ == "__main__":
    main()
