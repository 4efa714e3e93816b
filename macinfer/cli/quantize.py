"""`macinfer quantize` and `macinfer eval`: make a quantised model and measure what it costs.

Both are plain click commands (quantize_cmd, eval_cmd) registered by macinfer.cli.main.
The work is in macinfer.modelio.quantize and macinfer.modelio.evaluate; this file only parses
options, draws progress on stderr and prints the summary / table on stdout.
"""

from __future__ import annotations

from pathlib import Path

import click

from macinfer.cli.options import one_line
from macinfer.errors import MacinferError
from macinfer.units import fmt_bytes  # noqa: F401  (evaluate and bench_quantize import it from here)
from macinfer.units import fmt_size_change




class StageProgress:
    """progress(stage, done, total, item) drawn as one rich bar per stage on stderr."""

    def __init__(self):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
                            TimeRemainingColumn(), TextColumn("[dim]{task.fields[item]}"),
                            console=Console(stderr=True), transient=True)
        self.tasks: dict[str, int] = {}

    def __call__(self, stage: str, done: int, total: int, item: str = "") -> None:
        if stage not in self.tasks:
            self.tasks[stage] = self.bar.add_task(stage, total=total, item=item)
        self.bar.update(self.tasks[stage], completed=done, total=total, item=item)

    def __enter__(self):
        self.bar.start()
        return self

    def __exit__(self, *exc):
        self.bar.stop()


@click.command("quantize")
@click.argument("src")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--bits", "-b", type=int, default=4, show_default=True, help="Bits per weight: 2, 3, 4, 5, 6 or 8.")
@click.option("--group-size", "-g", type=int, default=64, show_default=True,
              help="Weights sharing one scale and bias: 32, 64 or 128.")
@click.option("--recipe", default="uniform", show_default=True,
              help="uniform: every layer at --bits. mixed: embeddings/lm_head at 8 bits and a "
                   "third of v_proj/down_proj at 6 bits (llama.cpp Q4_K_M's choice).")
@click.option("--awq", is_flag=True, help="Activation-aware scales and clipping searched on a calibration text.")
@click.option("--calibration", type=click.Path(path_type=Path),
              help="Calibration text for --awq (default: models/calibration.txt).")
@click.option("--calibration-tokens", type=int, default=1024, show_default=True,
              help="Calibration tokens for --awq (in sequences of 256).")
@click.option("--dtype", help="float16, bfloat16 or float32 for scales and float layers (default: the source's).")
@click.option("--force", "-f", is_flag=True, help="Replace OUT if it exists.")
def quantize_cmd(src, out, bits, group_size, recipe, awq, calibration, calibration_tokens, dtype, force):
    """Quantise SRC to grouped affine MLX weights in a new directory OUT.

    SRC is a catalog name, a Hugging Face / MLX model directory, a .gguf file or
    a Hugging Face repo id. OUT loads unchanged in macinfer and mlx_lm.load. A
    quantised source (GGUF Q4_1 for instance) is dequantised, then requantised.

    \b
    Examples:
      macinfer quantize ./Llama-3.2-1B-Instruct llama-q4
      macinfer quantize smollm2-135m smol-q3 --bits 3 --awq
      macinfer quantize model.gguf model-q4m --recipe mixed --group-size 32
    """
    from macinfer.modelio.quantize import QuantConfig, quantize

    try:
        cfg = QuantConfig(bits=bits, group_size=group_size, recipe=recipe, awq=awq, calibration=calibration,
                          calibration_tokens=calibration_tokens, dtype=dtype)
        with StageProgress() as progress:
            report = quantize(src, out, cfg, force=force, progress=progress,
                              log=lambda s: click.echo(f"note: {s}", err=True))
    except MacinferError as e:
        raise one_line(e) from None
    r = report
    layers = ", ".join(f"{n} at {b}-bit" for b, n in r.layers_by_bits.items())
    method = "AWQ" if awq else "round-to-nearest"
    click.echo(f"quantized {r.source} -> {r.out}  ({bits}-bit g{group_size}, recipe {recipe}, {method})")
    before = f"{fmt_bytes(r.size_before)}" + (f" ({r.requantized_from})" if r.requantized_from else "")
    click.echo(f"  size           {before} -> {fmt_bytes(r.size_after)}"
               f"  ({fmt_size_change(r.size_before, r.size_after)})")
    click.echo(f"  bits/weight    {r.bpw_before:.2f} -> {r.bpw_after:.3f}  ({r.num_params:,} parameters)")
    click.echo(f"  layers         {layers}")
    if r.awq_loss_ratio:
        mean = sum(r.awq_loss_ratio) / len(r.awq_loss_ratio)
        click.echo(f"  AWQ            block output error {mean:.2f}x of round-to-nearest "
                   f"(mean of {len(r.awq_loss_ratio)} blocks)")
    click.echo(f"  time           {r.seconds:.1f} s")


@click.command("eval")
@click.argument("models", nargs=-1, required=True, metavar="MODEL...")
@click.option("--against", "-a", metavar="MODEL", help="Reference model for top-1 agreement (same tokenizer).")
@click.option("--text", "-t", type=click.Path(path_type=Path), help="Text to score (default: models/eval.txt).")
@click.option("--max-tokens", type=int, default=1024, show_default=True, help="Score at most this many tokens.")
@click.option("--window", type=int, default=512, show_default=True, help="Context window for perplexity.")
@click.option("--decode-tokens", type=int, default=32, show_default=True,
              help="Tokens generated to time decoding (0: skip).")
@click.option("--markdown", "as_markdown", is_flag=True, help="Print the table as Markdown.")
def eval_cmd(models, against, text, max_tokens, window, decode_tokens, as_markdown):
    """Perplexity, top-1 agreement and decode speed of each MODEL, as a table.

    Top-1 agreement is the share of positions in the text where MODEL's most
    likely next token is the same as the --against model's. Quality is computed
    on dequantised weights (same values; fast on CPU); speed on the model as loaded.

    \b
    Examples:
      macinfer eval smol-q4 smol-q8 --against smollm2-135m
      macinfer eval ./llama-q3-awq ./llama-q3 --against ./Llama-3.2-1B-Instruct --text wiki.txt
    """
    from rich.console import Console

    from macinfer.modelio.evaluate import compare, markdown, table

    if max_tokens < 2 or window < 1 or decode_tokens < 0:
        raise click.ClickException("--max-tokens must be >= 2, --window >= 1 and --decode-tokens >= 0")
    err = Console(stderr=True)
    try:
        with err.status("evaluating") as status:
            results = compare(list(models), against, text, progress=status.update, max_tokens=max_tokens,
                              window=window, decode_tokens=decode_tokens)
    except MacinferError as e:
        raise one_line(e) from None
    if as_markdown:
        click.echo(markdown(results))
    else:
        Console().print(table(results))
