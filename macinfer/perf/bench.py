"""`macinfer bench`: TTFT, per-request decode speed and throughput, swept over load.

A scenario is (concurrency C, prompt length, prefix mode): C clients each send
`rounds` requests back to back (a closed loop), all starting together. Per request
we time, on the client's clock:

    submit ──────> first token ──────────────> last token
    |<--- TTFT --->|<-- decode: (n-1) tokens -->|

and per scenario report p50/p95/p99 of TTFT and of decode tok/s (for rates, pXX is
the speed XX% of requests reached: the slow tail), plus total output throughput.

Backends, one interface (`async run(prompt, max_tokens) -> RequestResult`):
- in-process: macinfer's engine through AsyncEngine (the server's path, minus HTTP);
- --url: any OpenAI-compatible server (macinfer serve, mlx_lm.server) via the openai client;
- mlx-lm's BatchGenerator on the same loaded weights (the comparison baseline).
Prompts are random common words, so they read as text to any server; in-process
they are cut to the exact token count, over HTTP the server's usage reports it.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, dataclass, field

from urllib.parse import urlparse

import numpy as np

from macinfer.errors import MacinferError

WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community "
    "name president team minute idea kid body information back parent face others level office door health "
    "person art war history party result change morning reason research girl guy moment air teacher force "
    "education the of and to in is you that it he was for on are as with his they at be this have from"
).split()


@dataclass
class Scenario:
    concurrency: int
    prompt_tokens: int
    prefix: str  # "unique" or "shared"
    max_tokens: int
    rounds: int = 1
    label: str = "macinfer"

    @property
    def num_requests(self) -> int:
        return self.concurrency * self.rounds


@dataclass
class RequestResult:
    prompt_tokens: int
    output_tokens: int
    ttft: float
    latency: float
    cached_tokens: int = 0
    # Speculation (in process only): drafted and accepted tokens, and the steps that verified drafts.
    draft_tokens: int = 0
    accepted_tokens: int = 0
    spec_steps: int = 0

    @property
    def decode_tps(self) -> float | None:
        decode = self.latency - self.ttft
        return (self.output_tokens - 1) / decode if self.output_tokens > 1 and decode > 0 else None


@dataclass
class ScenarioResult:
    scenario: Scenario
    wall: float
    requests: list[RequestResult] = field(default_factory=list)

    def summary(self) -> dict:
        """Percentiles and totals: what the table, --json and the plot show."""
        r = self.requests
        ttft = np.array([x.ttft for x in r])
        tps = np.array([x.decode_tps for x in r if x.decode_tps is not None])
        tpot = 1.0 / tps if len(tps) else np.array([])
        out = sum(x.output_tokens for x in r)
        pct = lambda a, q: float(np.percentile(a, q)) if len(a) else None  # noqa: E731
        return {
            **asdict(self.scenario),
            "requests": len(r),
            "mean_prompt_tokens": float(np.mean([x.prompt_tokens for x in r])) if r else 0.0,
            "cached_tokens": sum(x.cached_tokens for x in r),
            "output_tokens": out,
            "decode_tokens": sum(max(0, x.output_tokens - 1) for x in r),
            "draft_tokens": sum(x.draft_tokens for x in r),
            "accepted_tokens": sum(x.accepted_tokens for x in r),
            "spec_steps": sum(x.spec_steps for x in r),
            "wall_s": self.wall,
            "throughput_tps": out / self.wall if self.wall > 0 else None,
            "requests_per_s": len(r) / self.wall if self.wall > 0 else None,
            **{f"ttft_p{q}_s": pct(ttft, q) for q in (50, 95, 99)},
            # Rates: the tail is the slow end, so p95 is the 5th percentile of tok/s.
            **{f"decode_tps_p{q}": pct(tps, 100 - q) for q in (50, 95, 99)},
            "tpot_p50_ms": 1000 * pct(tpot, 50) if len(tpot) else None,
            "latency_p50_s": pct(np.array([x.latency for x in r]), 50),
        }


# -- prompts ------------------------------------------------------------------------------
def make_texts(scenario: Scenario, seed: int, words_per_token: float = 1.0) -> list[str]:
    """One prompt text per request; "shared" prompts share all but a short unique tail."""
    rng = random.Random(seed)
    n_words = max(1, int(scenario.prompt_tokens * words_per_token))
    tail = max(1, min(16, n_words // 4))
    common = " ".join(rng.choice(WORDS) for _ in range(n_words - tail))
    texts = []
    for i in range(scenario.num_requests):
        if scenario.prefix == "shared":
            texts.append(f"{common} {i} " + " ".join(rng.choice(WORDS) for _ in range(tail)))
        else:
            texts.append(f"{i} " + " ".join(rng.choice(WORDS) for _ in range(n_words)))
    return texts


def make_token_prompts(scenario: Scenario, seed: int, tokenizer) -> list[list[int]]:
    """Exactly prompt_tokens ids per request; "shared" prompts share all but the last <= 16."""
    rng = random.Random(seed)
    n = scenario.prompt_tokens
    tail = max(1, min(16, n // 4)) if scenario.prefix == "shared" else n

    def random_ids(k: int, tag: str, special: bool) -> list[int]:
        ids: list[int] = []
        while len(ids) < k:
            text = f"{tag} " + " ".join(rng.choice(WORDS) for _ in range(min(k, 64)))
            try:
                ids += tokenizer.encode(text, add_special_tokens=special and not ids)
            except TypeError:  # a tokenizer without the keyword
                ids += tokenizer.encode(text)
        return ids[:k]

    common = random_ids(n - tail, "", True) if n > tail else []
    return [common + random_ids(tail, str(i), not common) for i in range(scenario.num_requests)]


# -- backends -----------------------------------------------------------------------------
class InProcessBackend:
    """macinfer's engine, driven through AsyncEngine like the server does."""

    label = "macinfer"

    def __init__(self, llm):
        from macinfer.serve.async_engine import AsyncEngine

        self.llm = llm
        self.aengine = AsyncEngine(llm.engine).start()

    def prompts(self, scenario: Scenario, seed: int):
        return make_token_prompts(scenario, seed, self.llm.tokenizer)

    async def run(self, prompt: list[int], max_tokens: int) -> RequestResult:
        from macinfer.core.sampling import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        first = None
        async for d in self.aengine.generate(prompt, params):
            if first is None and (d.token_ids or d.finish_reason):
                first = time.perf_counter()
            if d.output is not None:
                out = d.output
        end = time.perf_counter()
        m = out.metrics
        return RequestResult(len(prompt), len(out.token_ids), first - t0, end - t0, m.cached_tokens,
                             m.draft_tokens, m.accepted_tokens, m.spec_steps)

    def close(self):
        self.aengine.shutdown()


class HTTPBackend:
    """An OpenAI-compatible server: streamed /v1/completions, usage from the last chunk."""

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None, timeout: float = 600,
                 label: str | None = None):
        base = url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self.api_key, self.timeout, self.model = api_key or "none", timeout, model
        self.label = label or urlparse(base).netloc or url
        self.client = None

    async def open(self):
        """A client bound to the running event loop (each scenario runs in its own loop)."""
        from openai import AsyncOpenAI

        self.client = AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=self.timeout)
        if self.model is None:
            from openai import APIConnectionError

            try:
                self.model = (await self.client.models.list()).data[0].id
            except APIConnectionError as e:
                raise MacinferError(f"cannot reach {self.label}: {type(e).__name__}: {e}") from None
            except Exception:  # reachable, but no usable /v1/models (mlx_lm.server without a HF cache)
                self.model = "default_model"  # mlx_lm.server's name for the model it loaded

    def prompts(self, scenario: Scenario, seed: int):
        return make_texts(scenario, seed)

    async def run(self, prompt: str, max_tokens: int) -> RequestResult:
        t0 = time.perf_counter()
        first, n_chunks, usage = None, 0, None
        stream = await self.client.completions.create(
            model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                n_chunks += 1
                if first is None:
                    first = time.perf_counter()
            if getattr(chunk, "usage", None):
                usage = chunk.usage
        end = time.perf_counter()
        first = first or end
        if usage is not None:
            cached = getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", 0) or 0
            return RequestResult(usage.prompt_tokens, usage.completion_tokens, first - t0, end - t0, cached)
        return RequestResult(len(prompt.split()), n_chunks, first - t0, end - t0)

    async def aclose(self):
        await self.client.close()

    def close(self):
        pass


def run_scenario(backend, scenario: Scenario, seed: int = 0, warmup: bool = True) -> ScenarioResult:
    """C workers, each sending its share of the prompts back to back (after one short warm-up request)."""
    prompts = backend.prompts(scenario, seed)

    async def main():
        if hasattr(backend, "open"):
            await backend.open()
        try:
            if warmup:
                await backend.run(backend.prompts(Scenario(1, 8, "unique", 4), seed + 10_000)[0], 4)
            results: list[RequestResult] = []

            async def worker(k: int):
                for i in range(k, len(prompts), scenario.concurrency):
                    results.append(await backend.run(prompts[i], scenario.max_tokens))

            t0 = time.perf_counter()
            await asyncio.gather(*(worker(k) for k in range(scenario.concurrency)))
            return ScenarioResult(scenario, time.perf_counter() - t0, results)
        finally:
            if hasattr(backend, "aclose"):
                await backend.aclose()

    return asyncio.run(main())


def run_mlx_lm_scenario(model, tokenizer, scenario: Scenario, seed: int = 0) -> ScenarioResult:
    """The same closed loop on mlx-lm's BatchGenerator (no stop tokens: fixed lengths)."""
    from mlx_lm.generate import BatchGenerator

    prompts = make_token_prompts(scenario, seed, tokenizer)
    gen = BatchGenerator(model, max_tokens=scenario.max_tokens, completion_batch_size=scenario.concurrency,
                         prefill_batch_size=min(8, scenario.concurrency))
    start, first, count, results = {}, {}, {}, []
    todo = list(range(len(prompts)))

    def submit():
        i = todo.pop(0)
        (uid,) = gen.insert([prompts[i]], [scenario.max_tokens])
        start[uid], count[uid] = (time.perf_counter(), len(prompts[i])), 0

    warm = gen.insert([make_token_prompts(Scenario(1, 8, "unique", 4), seed + 10_000, tokenizer)[0]], [4])
    while not any(r.finish_reason for r in gen.next_generated() if r.uid in warm):
        pass
    t0 = time.perf_counter()
    for _ in range(min(scenario.concurrency, len(todo))):
        submit()
    try:
        while len(results) < len(prompts):
            responses = gen.next_generated()
            now = time.perf_counter()
            for r in responses:
                first.setdefault(r.uid, now)
                count[r.uid] += 1
                if r.finish_reason is not None:
                    ts, n_prompt = start[r.uid]
                    results.append(RequestResult(n_prompt, count[r.uid], first[r.uid] - ts, now - ts))
                    if todo:
                        submit()
    finally:
        gen.close()
    scenario = Scenario(**{**asdict(scenario), "label": "mlx-lm"})
    return ScenarioResult(scenario, time.perf_counter() - t0, results)


# -- reporting ----------------------------------------------------------------------------
RATIOS = {  # ratio column -> (summary field, True if higher is better)
    "throughput_x": ("throughput_tps", True),
    "decode_p50_x": ("decode_tps_p50", True),
    "ttft_p50_speedup": ("ttft_p50_s", False),
}


def draft_rows(plain: list[dict], drafted: list[dict], spec) -> list[dict]:
    """Per scenario, speculation's decode speed-up as the cost model predicts it and as measured.

    Predicted (macinfer.spec_decode.step_cost.predicted_speedup): from the drafts each request made and
    had accepted, the engine's own fit of what a decode step costs, and its measured draft round.
    Measured: the drafted engine's p50 decode tok/s over the plain engine's, same scenario.

    Args:
        spec: the drafted engine's SpecDecoder (its step-cost fit and draft round).
    """
    from macinfer.spec_decode.step_cost import predicted_speedup

    rows = []
    for a, b in zip(plain, drafted):
        runs = b.get("repeats") or [b]
        steps = sum(r["spec_steps"] for r in runs)
        n = sum(r["requests"] for r in runs)
        plain_tokens = sum(r["decode_tokens"] - r["spec_steps"] - r["accepted_tokens"] for r in runs)
        predicted = None
        if spec is not None and spec.step_cost.ready and n:
            predicted = predicted_speedup(spec.step_cost, spec.draft_round_seconds(), b["concurrency"], steps / n,
                                          sum(r["draft_tokens"] for r in runs) / n,
                                          sum(r["accepted_tokens"] for r in runs) / n, plain_tokens / n,
                                          spec.step_cost.sync_penalty)
        measured = b["decode_tps_p50"] / a["decode_tps_p50"] if a["decode_tps_p50"] and b["decode_tps_p50"] else None
        drafted_n = sum(r["draft_tokens"] for r in runs)
        rows.append({"concurrency": b["concurrency"], "prompt_tokens": b["prompt_tokens"], "prefix": b["prefix"],
                     "acceptance": sum(r["accepted_tokens"] for r in runs) / drafted_n if drafted_n else None,
                     "k": drafted_n / steps if steps else None, "predicted_x": predicted, "measured_x": measured})
    return rows


def render_draft(rows: list[dict], label: str, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=max(Console().width, 100))
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    t = Table(title=f"{label}: decode speed-up over plain, predicted by the cost model (docs/speculation.md) "
                    "and measured")
    for col in ("C", "prompt", "prefix", "acceptance", "k / step", "predicted x", "measured x"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["concurrency"]), str(r["prompt_tokens"]), r["prefix"], f(r["acceptance"], ".2f"),
                  f(r["k"], ".2f"), f(r["predicted_x"], ".2f"), f(r["measured_x"], ".2f"))
    console.print(t)


def ratios(ours: list[dict], base: list[dict]) -> list[dict]:
    """Per scenario: throughput and decode ours/base (>1 is better), TTFT base/ours (>1 is better).

    A summary may carry "repeats" (median_summary): the ratio is then the median of the
    per-repeat ratios, each repeat's two runs having been measured back to back.
    """
    div = lambda a, b: a / b if a and b else None  # noqa: E731

    def one(a: dict, b: dict) -> dict:
        return {col: div(a[f], b[f]) if up else div(b[f], a[f]) for col, (f, up) in RATIOS.items()}

    rows = []
    for a, b in zip(ours, base):
        pairs = list(zip(a.get("repeats") or [a], b.get("repeats") or [b]))
        per = [one(x, y) for x, y in pairs]
        row = {"concurrency": a["concurrency"], "prompt_tokens": a["prompt_tokens"], "prefix": a["prefix"]}
        for col in RATIOS:
            vals = [r[col] for r in per if r[col] is not None]
            row[col] = float(np.median(vals)) if vals else None
        if len(pairs) > 1:
            row["repeats"] = len(pairs)
        rows.append(row)
    return rows


def median_summary(runs: list[dict]) -> dict:
    """One scenario measured several times: the run with the median throughput, and every run under "repeats"."""
    if len(runs) == 1:
        return runs[0]
    order = sorted(runs, key=lambda s: s["throughput_tps"] or 0.0)
    return {**order[(len(order) - 1) // 2], "repeats": runs}


def render(summaries: list[dict], ratio_rows: list[dict] | None = None, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=max(Console().width, 100))
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    n = max((len(s.get("repeats") or [s]) for s in summaries), default=1)
    runs = f"; the median of {n} runs, alternating engines" if n > 1 else ""
    t = Table(title=f"per request p50/p95/p99; throughput = all output tokens / wall time{runs}")
    for col in ("engine", "C", "prompt", "prefix", "reqs", "TTFT s", "decode tok/s", "tok/s"):
        t.add_column(col, justify="left" if col in ("engine", "prefix") else "right", no_wrap=True,
                     max_width=21 if col == "engine" else None, min_width=6 if col == "prefix" else None)
    for s in summaries:
        ttft = "/".join(f(s[f"ttft_p{q}_s"], ".3f") for q in (50, 95, 99))
        decode = "/".join(f(s[f"decode_tps_p{q}"], ".1f") for q in (50, 95, 99))
        t.add_row(s["label"], str(s["concurrency"]), f(s["mean_prompt_tokens"], ".0f"), s["prefix"], str(s["requests"]),
                  ttft, decode, f(s["throughput_tps"], ".1f"))
    console.print(t)
    if ratio_rows:
        r = Table(title="macinfer vs baseline (>1: macinfer better)")
        for col in ("C", "prompt", "prefix", "throughput x", "decode p50 x", "TTFT p50 speed-up"):
            r.add_column(col, justify="right")
        for x in ratio_rows:
            r.add_row(str(x["concurrency"]), str(x["prompt_tokens"]), x["prefix"], f(x["throughput_x"], ".2f"),
                      f(x["decode_p50_x"], ".2f"), f(x["ttft_p50_speedup"], ".2f"))
        console.print(r)


def plot(summaries: list[dict], path: str) -> None:
    """Two panels: per-user latency vs total throughput (one curve per prompt length and
    engine, points labelled with C), and TTFT vs prompt length (one curve per C)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.8))
    groups: dict[tuple, list[dict]] = {}
    for s in summaries:
        groups.setdefault((s["label"], s["prompt_tokens"], s["prefix"]), []).append(s)
    for (label, n, prefix), rows in groups.items():
        rows = sorted((r for r in rows if r["tpot_p50_ms"] is not None), key=lambda r: r["concurrency"])
        if not rows:
            continue
        x = [r["throughput_tps"] for r in rows]
        y = [r["tpot_p50_ms"] for r in rows]
        a.plot(x, y, marker="o", ls="-" if label.startswith("macinfer") else "--",
               label=f"{label}, {n}-tok prompt, {prefix}")
        for r, xi, yi in zip(rows, x, y):
            a.annotate(f"C={r['concurrency']}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
    a.set(xlabel="total throughput (output tok/s)", ylabel="per-request latency, p50 (ms / output token)",
          title="latency vs throughput")
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
    curves: dict[tuple, list[dict]] = {}
    for s in summaries:
        curves.setdefault((s["label"], s["concurrency"], s["prefix"]), []).append(s)
    for (label, c, prefix), rows in sorted(curves.items()):
        rows = sorted(rows, key=lambda r: r["mean_prompt_tokens"])
        x = [r["mean_prompt_tokens"] for r in rows]
        y = [r["ttft_p50_s"] for r in rows]
        err = [[0] * len(rows), [max(0.0, r["ttft_p95_s"] - r["ttft_p50_s"]) for r in rows]]
        b.errorbar(x, y, yerr=err, marker="o", capsize=3, ls="-" if label.startswith("macinfer") else "--",
                   label=f"{label}, C={c}, {prefix}")
    b.set(xlabel="prompt length (tokens)", ylabel="TTFT p50 (s), bar to p95", title="TTFT vs prompt length")
    lengths = sorted({s["prompt_tokens"] for s in summaries})
    if len(lengths) > 1 and lengths[-1] / lengths[0] >= 10:
        b.set_xscale("log")
        b.set_xticks(lengths, [str(n) for n in lengths])
        b.minorticks_off()
    b.grid(alpha=0.3)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
