"""Quantisation quality vs size vs speed: bits / group / recipe / AWQ, as Markdown tables.

Two models:
  - tiny: a 2-layer llama (hidden 64) trained for a few seconds on a short text it
    nearly memorises (as in tests/test_quantize.py); scored on that same text,
    since that is all it knows. Reference: its float32 weights.
  - embedded: SmolLM2-135M-Instruct from the Q4_1 GGUF (dequantised, then requantised).
    Scored on models/eval.txt, which is not the AWQ calibration text
    (models/calibration.txt). Reference: the GGUF's own weights (4-bit g32, 8-bit embeddings).

Each row is a `macinfer quantize` run followed by `macinfer eval` against the
reference; the baseline is the reference row measured in the same run.

    python scripts/bench/quantize.py [--only tiny|embedded] [--method rtn|awq] [--eval-tokens 512] [--awq-grid 10]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import macinfer  # noqa: F401  (OpenBLAS before mlx)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

# (bits, group size, recipe, awq)
TINY = [(8, 64, "uniform", False), (4, 64, "uniform", False), (4, 64, "uniform", True), (4, 32, "uniform", False),
        (4, 32, "uniform", True), (4, 64, "mixed", False), (3, 64, "uniform", False), (3, 64, "uniform", True),
        (3, 32, "uniform", False), (3, 32, "uniform", True), (3, 64, "mixed", False), (2, 64, "mixed", False)]
EMBEDDED = [(8, 64, "uniform", False), (4, 64, "uniform", False), (4, 32, "uniform", False),
            (4, 64, "mixed", False), (3, 64, "uniform", False), (3, 64, "mixed", False),
            (4, 64, "uniform", True), (3, 64, "uniform", True)]


def train_tiny(out: Path) -> tuple[Path, Path]:
    """The tests' trained tiny model: 150 Adam steps on tiny.CORPUS x 8."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import mlx_lm
    from mlx.utils import tree_flatten
    from tiny import CORPUS, build_tiny_model

    path = build_tiny_model(out)
    text = path / "corpus.txt"
    text.write_text(CORPUS * 8)
    model, tok = mlx_lm.load(str(path))
    mx.random.seed(0)
    model = type(model)(model.args)
    ids = mx.array(tok.encode(text.read_text()))
    offsets = mx.arange(32)
    opt = optim.Adam(1e-2)
    step = nn.value_and_grad(model, lambda m, x, y: nn.losses.cross_entropy(m(x), y, reduction="mean"))
    for _ in range(150):
        start = mx.random.randint(0, ids.size - 33, (8, 1))
        _, grads = step(model, ids[start + offsets], ids[start + offsets + 1])
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return path, text


HEADER = ("| weights | recipe | method | bits/w | size | ppl | ppl / ref | top-1 agree | decode tok/s | quantize s |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def row(r, ref, recipe: str, method: str, seconds: float | None) -> str:
    from macinfer.units import fmt_bytes

    tps = "-" if r.decode_tps is None else f"{r.decode_tps:.1f}"
    secs = "-" if seconds is None else f"{seconds:.0f}"
    return (f"| {r.quantization} | {recipe} | {method} | {r.bits_per_weight:.2f} | {fmt_bytes(r.size_bytes)} | "
            f"{r.perplexity:.3f} | {r.perplexity / ref.perplexity:.3f} | {100 * r.agreement:.1f}% | {tps} | {secs} |")


def run(label: str, src: str, rows, work: Path, text: Path | None, calibration: Path | None,
        eval_kw: dict, awq_kw: dict) -> None:
    from macinfer.modelio.evaluate import evaluate
    from macinfer.modelio.texts import read_text
    from macinfer.modelio.quantize import QuantConfig, quantize

    body = read_text(text)
    t = time.perf_counter()
    ref, ref_top = evaluate(src, body, **eval_kw)
    ref.agreement = 1.0
    print(f"\n### {label}: {ref.name}, {ref.tokens} tokens scored\n\n{HEADER}", flush=True)
    print(row(ref, ref, "(reference)", "-", None), flush=True)
    for bits, group, recipe, awq in rows:
        out = work / f"{label}-{bits}b-g{group}-{recipe}{'-awq' if awq else ''}"
        cfg = QuantConfig(bits=bits, group_size=group, recipe=recipe, awq=awq, calibration=calibration,
                          **(awq_kw if awq else {}))
        t0 = time.perf_counter()
        quantize(src, out, cfg)
        seconds = time.perf_counter() - t0
        r, _ = evaluate(str(out), body, reference=ref_top, **eval_kw)
        print(row(r, ref, recipe, "AWQ" if awq else "RTN", seconds), flush=True)
    print(f"\n({label}: {time.perf_counter() - t:.0f} s in all)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["tiny", "embedded"])
    ap.add_argument("--eval-tokens", type=int, default=512, help="tokens of models/eval.txt scored (embedded)")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--awq-tokens", type=int, default=512, help="calibration tokens for AWQ (embedded)")
    ap.add_argument("--method", choices=["rtn", "awq"], help="only the round-to-nearest or only the AWQ rows")
    ap.add_argument("--awq-grid", type=int, default=10, help="AWQ search grid (mlx-lm's default is 20)")
    args = ap.parse_args()

    keep = {"rtn": lambda r: not r[3], "awq": lambda r: r[3], None: lambda r: True}[args.method]
    with tempfile.TemporaryDirectory(prefix="bench-quantize-") as d:
        work = Path(d)
        if args.only in (None, "tiny"):
            src, text = train_tiny(work / "tiny-trained")
            run("tiny", str(src), [r for r in TINY if keep(r)], work, text, text,
                {"window": 64, "decode_tokens": 32}, {"calibration_tokens": 512, "seq_len": 64})
        if args.only in (None, "embedded"):
            run("embedded", "smollm2-135m", [r for r in EMBEDDED if keep(r)], work, None, None,
                {"max_tokens": args.eval_tokens, "window": 512, "decode_tokens": args.decode_tokens},
                {"calibration_tokens": args.awq_tokens, "seq_len": 256, "n_grid": args.awq_grid})


if __name__ == "__main__":
    main()
