"""`macinfer bench`: latency and throughput over concurrency and prompt length (registered by macinfer.cli.main).

The command's docstring is its --help. MacinferError becomes one line, never a traceback.
The harness itself (scenarios, backends, tables, plots) is macinfer.perf.bench.
"""

from __future__ import annotations

import json

import click

from macinfer.cli.options import csv_list, engine_option, engine_options, one_line_errors
from macinfer.errors import MacinferError


@click.command("bench")
@click.argument("model", required=False)
@click.option("--url", help="Benchmark a running OpenAI-compatible server instead of an in-process engine.")
@click.option("--api-key", envvar="MACINFER_API_KEY", help="API key for --url.")
@click.option("--concurrency", "-c", default="1,4,16", show_default=True, help="Concurrent clients to sweep.")
@click.option("--prompt-tokens", "-p", default="20,4k", show_default=True, help="Prompt lengths to sweep (k = 1024).")
@click.option("--prefix", type=click.Choice(["unique", "shared", "both"]), default="unique", show_default=True,
              help="Prompts all different, or sharing all but a short tail (prefix cache).")
@click.option("--max-tokens", "-n", default=64, show_default=True, type=click.IntRange(1),
              help="Tokens generated per request (EOS ignored).")
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(1),
              help="Requests each client sends, back to back.")
@click.option("--compare", type=click.Choice(["mlx-lm"]), help="Run the same sweep on mlx-lm's BatchGenerator and print ratios.")
@click.option("--compare-url", help="Run the same sweep against a second server (e.g. mlx_lm.server) and print ratios.")
@click.option("--draft", help="Also run every scenario with speculation on (a draft model, 'ngram', MODEL+ngram or 'auto').")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write latency/throughput and TTFT plots (PNG).")
@click.option("--kv-memory", help="KV cache budget for the in-process engine, e.g. 2GB.")
@click.option("--max-num-seqs", type=click.IntRange(1), help="Requests decoded together at most (in-process).")
@click.option("--dequantize/--keep-quantized", default=None,
              help="Load quantised weights as float, or keep them quantised (default: float where there is no Metal and it fits, where it is faster).")
@engine_option
@click.option("--seed", default=0, show_default=True, help="Seed for the random prompts.")
@one_line_errors
def bench_cmd(model, url, api_key, concurrency, prompt_tokens, prefix, max_tokens, rounds, compare, compare_url,
              draft, as_json, plot_path, kv_memory, max_num_seqs, dequantize, seed, engine):
    """Measure TTFT, per-request decode tok/s and throughput over concurrency and prompt length.

    Each scenario runs C clients at once (a closed loop); the table shows p50/p95/p99
    (for tok/s, p95 is the speed 95% of requests reached). In-process by default;
    --url measures a running server, --compare / --compare-url a baseline in the same run.

    \b
    Examples:
      macinfer bench -c 1,4,16 -p 20,1k -n 32 --plot bench.png
      macinfer bench ./tiny-model --compare mlx-lm --json
      macinfer bench --url http://127.0.0.1:8000 --compare-url http://127.0.0.1:8080 -c 1,16 -p 20
    """
    from macinfer.perf import bench
    from macinfer.perf.kv_calc import parse_tokens

    cs = csv_list(concurrency, int)
    ps = csv_list(prompt_tokens, parse_tokens)
    if not cs or min(cs) < 1:
        raise MacinferError("--concurrency needs integers >= 1, e.g. 1,4,16")
    prefixes = ["unique", "shared"] if prefix == "both" else [prefix]
    scenarios = [bench.Scenario(c, p, pre, max_tokens, rounds) for pre in prefixes for p in ps for c in cs]
    if url and (compare or draft):
        raise MacinferError("--compare and --draft run in-process: use --compare-url with --url")

    llm, backends = _backends(model, url, api_key, draft, dequantize, {**engine_options(kv_memory, max_num_seqs), "engine": engine})
    baseline = bench.HTTPBackend(compare_url, None, api_key, label="baseline") if compare_url else None
    progress = click.echo if not as_json else (lambda *a, **k: None)
    summaries, base = _sweep(scenarios, backends, llm, compare, baseline, seed, progress)
    ours = [s for s in summaries if s["label"] == backends[0].label]
    ratio_rows = bench.ratios(ours, base) if base else None
    if plot_path:
        bench.plot(summaries + base, plot_path)
    if as_json:
        click.echo(json.dumps({"model": llm.info.name if llm else (model or url), "url": url,
                               "scenarios": summaries, "baseline": base, "ratios": ratio_rows}, indent=1))
    else:
        bench.render(summaries + base, ratio_rows)
        if plot_path:
            click.echo(f"plot written to {plot_path}", err=True)


def _backends(model, url, api_key, draft, dequantize, opts: dict) -> tuple:
    """(the in-process LLM, or None with --url; the backends to measure, ours first)."""
    from macinfer.perf import bench

    if url:
        return None, [bench.HTTPBackend(url, model, api_key)]
    from macinfer.llm import LLM

    llm = LLM(model, dequantize=dequantize, **opts)
    backends = [bench.InProcessBackend(llm)]
    if draft:
        try:
            drafted = LLM(model, dequantize=dequantize, draft=draft, **opts)
        except TypeError:
            raise MacinferError("this engine does not take a draft yet (--draft)") from None
        backends.append(bench.InProcessBackend(drafted))
        backends[-1].label = f"macinfer+{draft}"
    return llm, backends


def _sweep(scenarios, backends, llm, compare, baseline, seed: int, progress) -> tuple[list, list]:
    """Every scenario on every backend, then on the baseline; (summaries, baseline summaries).

    The backends are closed at the end, whatever happens.
    """
    from macinfer.perf import bench

    summaries, base = [], []
    try:
        for i, sc in enumerate(scenarios):
            for b in backends:
                progress(f"[{b.label}] C={sc.concurrency} prompt={sc.prompt_tokens} {sc.prefix} ...", err=True)
                res = bench.run_scenario(b, bench.Scenario(**{**sc.__dict__, "label": b.label}), seed + i)
                summaries.append(res.summary())
            if compare == "mlx-lm":
                progress(f"[mlx-lm] C={sc.concurrency} prompt={sc.prompt_tokens} {sc.prefix} ...", err=True)
                base.append(bench.run_mlx_lm_scenario(llm.model, llm.tokenizer, sc, seed + i).summary())
            elif baseline is not None:
                progress(f"[baseline] C={sc.concurrency} prompt={sc.prompt_tokens} {sc.prefix} ...", err=True)
                base.append(bench.run_scenario(baseline, bench.Scenario(**{**sc.__dict__, "label": "baseline"}),
                                               seed + i).summary())
    finally:
        for b in backends:
            b.close()
    return summaries, base
