"""`macinfer serve`, `macinfer bench` and `macinfer kv` (registered by macinfer.cli.main).

Each command's docstring is its --help. MacinferError becomes one line, never a traceback.
"""

from __future__ import annotations

import functools
import json

import click

from macinfer.cli.options import engine_option
from macinfer.errors import MacinferError
from macinfer.units import parse_bytes


def _one_line_errors(f):
    """MacinferError / ValueError -> click.ClickException with a single line."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except (MacinferError, ValueError) as e:
            raise click.ClickException(str(e).splitlines()[0] if str(e) else type(e).__name__) from None

    return wrapper


def _csv(text: str, parse) -> list:
    try:
        return [parse(x) for x in text.split(",") if x.strip()]
    except (ValueError, MacinferError) as e:
        raise MacinferError(f"cannot read '{text}': {e}") from None


def _engine_options(kv_memory, max_num_seqs) -> dict:
    opts = {}
    if kv_memory:
        opts["kv_memory"] = kv_memory
    if max_num_seqs:
        opts["max_num_seqs"] = max_num_seqs
    return opts


@click.command("serve")
@click.argument("model", required=False)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 exposes it to the network).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--api-key", envvar="MACINFER_API_KEY", help="Require 'Authorization: Bearer KEY' on every request.")
@click.option("--served-model-name", help="The model name clients send (default: the model's name).")
@click.option("--kv-memory", help="KV cache budget, e.g. 4GB (default: sized from the machine).")
@click.option("--max-num-seqs", type=click.IntRange(1), help="Requests decoded together at most.")
@click.option("--dequantize", is_flag=True, help="Load quantised weights as float (faster on CPU hosts).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@engine_option
@_one_line_errors
def serve_cmd(model, host, port, api_key, served_model_name, kv_memory, max_num_seqs, dequantize, log_level, engine):
    """Serve MODEL over an OpenAI-compatible HTTP API with continuous batching.

    Routes: POST /v1/chat/completions, POST /v1/completions (both stream with
    "stream": true), GET /v1/models, /health, /metrics (Prometheus). Concurrent
    clients are batched by the engine; a client that disconnects aborts its request.
    Sampling defaults are OpenAI's (temperature 1); vLLM's extensions top_k, min_p,
    ignore_eos and return_token_ids are accepted too.

    \b
    Examples:
      macinfer serve                                    # embedded SmolLM2-135M on 127.0.0.1:8000
      macinfer serve ./my-mlx-model --port 8080 --api-key secret
      curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}]}'
    """
    from macinfer.llm import LLM
    from macinfer.serve.server import create_app

    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        click.echo(f"warning: serving on {host} without --api-key: anyone who can reach it can use it", err=True)
    llm = LLM(model, dequantize=dequantize, engine=engine, **_engine_options(kv_memory, max_num_seqs))
    engine = getattr(llm, "engine", None)
    if hasattr(engine, "describe"):
        click.echo(engine.describe(), err=True)
    import uvicorn

    app = create_app(llm, api_key=api_key, model_name=served_model_name)
    click.echo(f"serving {served_model_name or llm.info.name} on http://{host}:{port}/v1", err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


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
@click.option("--dequantize", is_flag=True, help="Load quantised weights as float (faster on CPU hosts).")
@click.option("--seed", default=0, show_default=True, help="Seed for the random prompts.")
@engine_option
@_one_line_errors
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

    cs = _csv(concurrency, int)
    ps = _csv(prompt_tokens, parse_tokens)
    if not cs or min(cs) < 1:
        raise MacinferError("--concurrency needs integers >= 1, e.g. 1,4,16")
    prefixes = ["unique", "shared"] if prefix == "both" else [prefix]
    scenarios = [bench.Scenario(c, p, pre, max_tokens, rounds) for pre in prefixes for p in ps for c in cs]
    if url and (compare or draft):
        raise MacinferError("--compare and --draft run in-process: use --compare-url with --url")

    llm = None
    if url:
        backends = [bench.HTTPBackend(url, model, api_key)]
    else:
        from macinfer.llm import LLM

        opts = {**_engine_options(kv_memory, max_num_seqs), "engine": engine}
        llm = LLM(model, dequantize=dequantize, **opts)
        backends = [bench.InProcessBackend(llm)]
        if draft:
            try:
                drafted = LLM(model, dequantize=dequantize, draft=draft, **opts)
            except TypeError:
                raise MacinferError("this engine does not take a draft yet (--draft)") from None
            backends.append(bench.InProcessBackend(drafted))
            backends[-1].label = f"macinfer+{draft}"
    baseline = bench.HTTPBackend(compare_url, None, api_key, label="baseline") if compare_url else None

    summaries, base = [], []
    progress = click.echo if not as_json else (lambda *a, **k: None)
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


@click.command("kv")
@click.argument("model", required=False)
@click.option("--memory", help="Memory to plan for, e.g. 64GB or 24GiB (default: this machine's).")
@click.option("--context", "contexts", default="8k,32k,128k", show_default=True,
              help="Context lengths per sequence (k = 1024; write 100000 for an exact count).")
@click.option("--concurrency", "-c", default=16, show_default=True, type=click.IntRange(1),
              help="Sequences served at once (per-server figure).")
@click.option("--kv-bits", type=click.Choice(["4", "8", "16", "32"]),
              help="KV cache precision; 4 and 8 are quantised (default: the model's dtype).")
@click.option("--kv-group-size", default=64, show_default=True, type=click.IntRange(1),
              help="Group size of quantised KV (one float16 scale and bias per group).")
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(0),
              help="Paged KV block size in tokens; 0 for a contiguous cache (no rounding).")
@click.option("--json", "as_json", is_flag=True, help="Print every figure as JSON.")
@_one_line_errors
def kv_cmd(model, memory, contexts, concurrency, kv_bits, kv_group_size, block_size, as_json):
    """KV-cache arithmetic for MODEL: bytes per token, per sequence, per server, max concurrency.

    MODEL is anything `macinfer run` takes, a config.json, or a preset
    (llama-2-7b, llama-2-70b, llama-3.1-8b, llama-3.1-70b, mistral-7b, qwen2.5-7b).
    Headroom is memory minus weights; "x weights" is one sequence's KV over the weights.

    \b
    Examples:
      macinfer kv                                        # the embedded model on this machine
      macinfer kv llama-2-70b --memory 192GB --context 8k,100000 -c 4
      macinfer kv ./my-model/config.json --memory 64GB --kv-bits 8
    """
    from macinfer.perf import kv_calc

    m = kv_calc.resolve_kv_model(model)
    mem = parse_bytes(memory) if memory else kv_calc.machine_memory()
    ctxs = _csv(contexts, kv_calc.parse_tokens)
    if not ctxs:
        raise MacinferError("--context needs at least one length, e.g. 8k,128k")
    report = kv_calc.plan(m, mem, ctxs, concurrency, int(kv_bits) if kv_bits else None, kv_group_size, block_size)
    if as_json:
        click.echo(json.dumps(report, indent=1))
    else:
        kv_calc.render(report)
