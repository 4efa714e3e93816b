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
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(1),
              help="Measure each scenario this many times (with --compare, alternating with the baseline); report medians.")
@click.option("--compare", type=click.Choice(["mlx-lm"]), help="Run the same sweep on mlx-lm's BatchGenerator and print ratios.")
@click.option("--compare-url", help="Run the same sweep against a second server (e.g. mlx_lm.server) and print ratios.")
@click.option("--draft", help="Also run every scenario with speculation on (auto, a draft model, mtp, ngram, MODEL+ngram), "
                              "and print the cost model's predicted speed-up beside the measured one.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write latency/throughput and TTFT plots (PNG).")
@click.option("--kv-memory", help="KV cache budget for the in-process engine, e.g. 2GB.")
@click.option("--max-num-seqs", type=click.IntRange(1), help="Requests decoded together at most (in-process).")
@click.option("--dequantize/--keep-quantized", default=None,
              help="Load quantised weights as float, or keep them quantised (default: float where there is no Metal and it fits, where it is faster).")
@engine_option
@click.option("--seed", default=0, show_default=True, help="Seed for the random prompts.")
@one_line_errors
def bench_cmd(model, url, api_key, concurrency, prompt_tokens, prefix, max_tokens, rounds, repeats, compare, compare_url,
              draft, as_json, plot_path, kv_memory, max_num_seqs, dequantize, seed, engine):
    """Measure TTFT, per-request decode tok/s and throughput over concurrency and prompt length.

    Each scenario runs C clients at once (a closed loop); the table shows p50/p95/p99
    (for tok/s, p95 is the speed 95% of requests reached). In-process by default;
    --url measures a running server, --compare / --compare-url a baseline in the same run.

    \b
    Examples:
      macinfer bench -c 1,4,16 -p 20,1k -n 32 --plot bench.png
      macinfer bench ./tiny-model --compare mlx-lm -c 1,16 -p 64 -n 32 --repeats 3
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
    summaries, base = _sweep(scenarios, backends, llm, compare, baseline, seed, repeats, progress)
    ours = [s for s in summaries if s["label"] == backends[0].label]
    ratio_rows = bench.ratios(ours, base) if base else None
    drafted = backends[1].llm.engine if draft else None
    draft_rows = (bench.draft_rows(ours, [s for s in summaries if s["label"] == backends[1].label], drafted.spec_decoder)
                  if drafted is not None and drafted.features.speculation else None)
    if plot_path:
        bench.plot(summaries + base, plot_path)
    if as_json:
        click.echo(json.dumps({"model": llm.info.name if llm else (model or url), "url": url,
                               "scenarios": summaries, "baseline": base, "ratios": ratio_rows,
                               "speculation": draft_rows}, indent=1))
    else:
        bench.render(summaries + base, ratio_rows)
        if draft_rows:
            bench.render_draft(draft_rows, backends[1].label)
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
        name = drafted.engine.features.drafter
        backends[-1].label = f"macinfer+{name if name and name != draft else draft}"
    return llm, backends


def _sweep(scenarios, backends, llm, compare, baseline, seed: int, repeats: int, progress) -> tuple[list, list]:
    """Every scenario on every backend, then on the baseline, `repeats` times; (summaries, baseline summaries).

    Each repeat gets prompts of its own (a repeat must not hit the prefix cache the last one
    filled), the same for every backend. The backends are closed at the end, whatever happens.
    """
    from macinfer.perf import bench

    runs: dict[tuple, list] = {}  # (scenario index, label) -> summaries
    try:
        for i, sc in enumerate(scenarios):
            for r in range(repeats):
                s = seed + i + 1000 * r
                for b in backends:
                    runs.setdefault((i, b.label), []).append(_measure(b.label, sc, progress, lambda sc_: (
                        bench.run_scenario(b, sc_, s))))
                if compare == "mlx-lm":
                    runs.setdefault((i, "mlx-lm"), []).append(_measure("mlx-lm", sc, progress, lambda sc_: (
                        bench.run_mlx_lm_scenario(llm.model, llm.tokenizer, sc_, s))))
                elif baseline is not None:
                    runs.setdefault((i, "baseline"), []).append(_measure("baseline", sc, progress, lambda sc_: (
                        bench.run_scenario(baseline, sc_, s))))
    finally:
        for b in backends:
            b.close()
    base_label = "mlx-lm" if compare == "mlx-lm" else "baseline" if baseline is not None else None
    summaries = [bench.median_summary(v) for (i, label), v in runs.items() if label != base_label]
    base = [bench.median_summary(v) for (i, label), v in runs.items() if label == base_label]
    return summaries, base


def _measure(label: str, sc, progress, run) -> dict:
    from macinfer.perf import bench

    progress(f"[{label}] C={sc.concurrency} prompt={sc.prompt_tokens} {sc.prefix} ...", err=True)
    return run(bench.Scenario(**{**sc.__dict__, "label": label})).summary()
