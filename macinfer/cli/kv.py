"""`macinfer kv`: KV-cache arithmetic for a model (registered by macinfer.cli.main).

The command's docstring is its --help. MacinferError becomes one line, never a traceback.
"""

from __future__ import annotations

import json

import click

from macinfer.cli.options import csv_list, one_line_errors
from macinfer.errors import MacinferError
from macinfer.units import parse_bytes


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
@one_line_errors
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
    ctxs = csv_list(contexts, kv_calc.parse_tokens)
    if not ctxs:
        raise MacinferError("--context needs at least one length, e.g. 8k,128k")
    report = kv_calc.plan(m, mem, ctxs, concurrency, int(kv_bits) if kv_bits else None, kv_group_size, block_size)
    if as_json:
        click.echo(json.dumps(report, indent=1))
    else:
        kv_calc.render(report)
