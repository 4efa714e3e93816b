"""What a quantisation costs: perplexity, top-1 agreement and decode speed.

`macinfer eval MODEL... [--against REF] [--text FILE]` prints one row per model:
bits per weight, size on disk, perplexity on the text, the fraction of positions
where the model's most likely next token is the reference's (top-1 agreement),
and decode tokens per second.

Design choices:
  - Perplexity is over non-overlapping windows of `window` tokens (each window
    starts with an empty context), so every model sees exactly the same inputs.
  - Quality is computed with the quantised weights dequantised to float: the same
    values, up to float rounding. On hosts without Metal, quantised matmul costs
    time per row and a 1,000-token pass takes minutes; dequantised float32 with
    OpenBLAS takes seconds (docs/platform.md). Speed is measured on the model as loaded.
  - Decode speed is mlx-lm's generate_step, greedy, after a short prompt: the time
    from the first generated token to the last.
  - The default text, models/eval.txt, is plain English written for this project
    and is not the AWQ calibration text (models/calibration.txt).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from macinfer.errors import MacinferError
from macinfer.modelio.loader import load_model
from macinfer.modelio.sizes import bits_per_weight, describe, weight_bytes
from macinfer.modelio.texts import encode_text, read_text
from macinfer.units import fmt_bytes



@dataclass
class EvalResult:
    """One row of the table."""

    name: str
    quantization: str  # "4-bit g64", "float32", ...
    bits_per_weight: float
    size_bytes: int  # tensor bytes on disk
    perplexity: float
    agreement: float | None  # top-1 agreement with the reference; None without one
    decode_tps: float | None
    tokens: int  # scored positions


def score(model, ids: list[int], window: int = 512):
    """Negative log-likelihood and greedy picks of `model` on `ids`.

    Args:
        ids: token ids; scored in non-overlapping windows of `window` tokens.

    Returns:
        (nll, top1): nll (N,) float32 of each predicted token, top1 (N,) int32
        argmax at each position; N = len(ids) - 1 (every token but the first is
        predicted, from the tokens before it in its window).
    """
    import mlx.core as mx
    import mlx.nn as nn

    nlls, picks = [], []
    for start in range(0, len(ids) - 1, window):
        chunk = mx.array(ids[start : start + window + 1])[None]  # (1, L + 1)
        if chunk.shape[1] < 2:
            break
        logits = model(chunk[:, :-1]).astype(mx.float32)  # (1, L, V)
        nll = nn.losses.cross_entropy(logits, chunk[:, 1:], reduction="none")[0]
        top1 = mx.argmax(logits, axis=-1)[0]
        mx.eval(nll, top1)
        nlls.append(nll)
        picks.append(top1)
    return mx.concatenate(nlls), mx.concatenate(picks)


def decode_speed(model, prompt: list[int], n: int = 32) -> float | None:
    """Greedy decode tokens per second, first token excluded (that one is prefill)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    if n < 2:
        return None
    times = []
    for _, _ in zip(range(n), generate_step(mx.array(prompt), model, max_tokens=n)):
        times.append(time.perf_counter())
    if len(times) < 2:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def evaluate(
    spec: str,
    text: str,
    *,
    reference: tuple[list[int], object] | None = None,
    max_tokens: int = 1024,
    window: int = 512,
    decode_tokens: int = 32,
) -> tuple[EvalResult, tuple[list[int], object]]:
    """Evaluate one model.

    Args:
        spec: anything macinfer.modelio.loader accepts.
        text: the text to score (its first `max_tokens` tokens).
        reference: (ids, top1) of a reference model from an earlier call, for agreement.

    Returns:
        (EvalResult, (ids, top1)): the second item can be passed as `reference`.
    """
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model, get_total_parameters


    model, tokenizer, info = load_model(spec)
    ids = encode_text(tokenizer, text)[: max_tokens + 1]
    if len(ids) < 2:
        raise MacinferError("the text is too short: it must be at least two tokens")
    if reference is not None and reference[0] != ids:
        raise MacinferError(f"{info.name} tokenizes the text differently from the reference: "
                            "agreement needs the same tokenizer")
    num_params = get_total_parameters(model)
    size = weight_bytes(info.path)
    q = info.config.get("quantization")
    quant = describe(q) if q else (info.config.get("torch_dtype") or info.dtype)
    tps = decode_speed(model, ids[:16], decode_tokens)
    if q:
        model = dequantize_model(model)
    nll, top1 = score(model, ids, window)
    ppl = math.exp(nll.mean().item())
    agree = None
    if reference is not None:
        n = min(top1.size, reference[1].size)
        agree = (top1[:n] == reference[1][:n]).astype(mx.float32).mean().item()
    result = EvalResult(
        name=info.name,
        quantization=quant,
        bits_per_weight=bits_per_weight(size, num_params),
        size_bytes=size,
        perplexity=ppl,
        agreement=agree,
        decode_tps=tps,
        tokens=int(nll.size),
    )
    return result, (ids, top1)


def compare(
    specs: list[str],
    against: str | None = None,
    text_path: str | Path | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    **kw,
) -> list[EvalResult]:
    """Evaluate `against` first (if given), then each of `specs`; one model in memory at a time."""
    text = read_text(text_path)
    results, ref = [], None
    if against:
        if progress:
            progress(f"evaluating {against} (reference)")
        r, ref = evaluate(against, text, **kw)
        r.agreement = 1.0
        results.append(r)
    for spec in specs:
        if progress:
            progress(f"evaluating {spec}")
        r, _ = evaluate(spec, text, reference=ref, **kw)
        results.append(r)
    return results


def table(results: list[EvalResult], title: str | None = None):
    """A rich Table of results (print it with rich.console.Console)."""
    from rich.table import Table


    t = Table(title=title)
    for col in ("model", "weights", "bits/w", "size", "ppl", "top-1 agree", "decode tok/s"):
        t.add_column(col, justify="left" if col in ("model", "weights") else "right")
    for r in results:
        t.add_row(
            r.name,
            r.quantization,
            f"{r.bits_per_weight:.2f}",
            fmt_bytes(r.size_bytes),
            f"{r.perplexity:.3f}",
            "-" if r.agreement is None else f"{100 * r.agreement:.1f}%",
            "-" if r.decode_tps is None else f"{r.decode_tps:.1f}",
        )
    return t


def markdown(results: list[EvalResult]) -> str:
    """The same table as Markdown (for reports and the benchmark script)."""

    rows = ["| model | weights | bits/w | size | ppl | top-1 agree | decode tok/s |", "|---|---|---|---|---|---|---|"]
    for r in results:
        agree = "-" if r.agreement is None else f"{100 * r.agreement:.1f}%"
        tps = "-" if r.decode_tps is None else f"{r.decode_tps:.1f}"
        rows.append(f"| {r.name} | {r.quantization} | {r.bits_per_weight:.2f} | {fmt_bytes(r.size_bytes)} | "
                    f"{r.perplexity:.3f} | {agree} | {tps} |")
    return "\n".join(rows)
