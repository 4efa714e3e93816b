"""The `macinfer` command line: run, chat, serve, quantize, eval, bench, kv.

Each command's docstring is its --help. Errors the user can fix are printed as
one line (`error: ...`) with a non-zero exit, never a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import click

from macinfer.cli.options import engine_option, one_line, parallel_option
from macinfer.errors import MacinferError
from macinfer.modelio.images import read_image
from macinfer.units import fmt_bytes


class Group(click.Group):
    """Turns MacinferError / ValueError from any command into one clean line."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (MacinferError, ValueError) as e:
            raise one_line(e) from None
        except KeyboardInterrupt:
            click.echo("", err=True)
            ctx.exit(130)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="macinfer")
def main():
    """macinfer: run language models locally on Apple silicon (MLX).

    \b
    Examples:
      macinfer run "What is the capital of France?"       # embedded SmolLM2-135M
      macinfer run ./my-mlx-model "Explain the KV cache"
      macinfer run mlx-community/Qwen3-0.6B-4bit "Hello"
      macinfer chat                                       # terminal UI with live metrics
    """


def run_stats(out, info, peak, reasoning_tokens: int = 0) -> dict:
    """Every figure of one finished request, for the stats line and --json (reasoning_tokens: the thought's)."""
    import mlx.core as mx

    from macinfer.perf.bandwidth import bytes_per_step, utilisation

    m = out.metrics
    per_step = bytes_per_step(info, m.mean_kv_tokens)
    rate = m.decode_forward_rate  # forwards, not tokens: accepted drafts cost no extra read
    util = utilisation(per_step, rate, peak) if (rate and peak) else None
    return {
        "prompt_tokens": m.prompt_tokens,
        "cached_tokens": m.cached_tokens,
        "ttft_s": m.ttft,
        "prefill_tps": m.prefill_tps,
        "prompt_cached": m.prompt_cached,
        "generation_tokens": m.generation_tokens,
        "reasoning_tokens": reasoning_tokens,
        "decode_tps": m.decode_tps,
        "peak_memory_bytes": mx.get_peak_memory(),
        "bytes_per_decode_step": int(per_step),
        "peak_bandwidth_gbps": peak.gbps if peak else None,
        "peak_bandwidth_source": peak.source if peak else None,
        "bandwidth_utilisation": util,
        "draft_tokens": m.draft_tokens,
        "accepted_tokens": m.accepted_tokens,
        "acceptance_rate": m.acceptance_rate,
        "accepted_per_step": m.accepted_per_step,
        "lookup_draft_tokens": m.lookup_draft_tokens,
        "lookup_accepted_tokens": m.lookup_accepted_tokens,
        "finish_reason": out.finish_reason,
    }


def stats_line(s: dict) -> str:
    def f(x, spec):
        return "n/a" if x is None else format(x, spec)

    parts = [
        f"prompt {s['prompt_tokens']} tok" + (f" ({s['cached_tokens']} cached)" if s["cached_tokens"] else ""),
        f"TTFT {f(s['ttft_s'], '.2f')} s",
        "prompt cached" if s["prompt_cached"] else f"prefill {f(s['prefill_tps'], '.1f')} tok/s",
        f"generated {s['generation_tokens']} tok" + (f" ({s['reasoning_tokens']} thinking)"
                                                    if s.get("reasoning_tokens") else ""),
        f"decode {f(s['decode_tps'], '.1f')} tok/s",
        f"peak mem {fmt_bytes(s['peak_memory_bytes'])}",
    ]
    if s["bandwidth_utilisation"] is not None:
        parts.append(
            f"bandwidth {100 * s['bandwidth_utilisation']:.1f}% of {s['peak_bandwidth_gbps']:.1f} GB/s "
            f"({s['peak_bandwidth_source']})"
        )
    if s["draft_tokens"]:
        lookup = s["lookup_draft_tokens"]
        split = (f"; lookup {s['lookup_accepted_tokens']}/{lookup}, model {s['accepted_tokens'] - s['lookup_accepted_tokens']}"
                 f"/{s['draft_tokens'] - lookup}" if 0 < lookup < s["draft_tokens"] else "")
        parts.append(f"draft acceptance {100 * s['acceptance_rate']:.0f}% ({s['accepted_per_step']:.2f} accepted/step{split})")
    return " | ".join(parts)


@main.command("run")
@click.argument("args", nargs=-1, required=True, metavar="[MODEL] PROMPT")
@click.option("--system", help="System prompt (chat models).")
@click.option("--max-tokens", "-n", default=256, show_default=True, help="Tokens to generate at most.")
@click.option("--temp", default=0.0, show_default=True, help="Sampling temperature; 0 is greedy.")
@click.option("--top-p", default=1.0, show_default=True, help="Nucleus sampling threshold in (0, 1].")
@click.option("--top-k", default=0, show_default=True, help="Sample from the k most likely tokens (0: off).")
@click.option("--min-p", default=0.0, show_default=True, help="Drop tokens below min-p x p(top token) (0: off).")
@click.option("--seed", type=int, help="Random seed for reproducible sampling (0 to 2**64 - 1).")
@click.option("--stop", multiple=True, help="End the reply before this text (repeatable).")
@click.option("--repetition-penalty", default=1.0, show_default=True,
              help="Divide the logits of the last 20 tokens by this (> 1 repeats less; mlx-lm's penalty).")
@click.option("--no-chat-template", is_flag=True, help="Send PROMPT as raw text, without the chat template.")
@click.option("--think/--no-think", "think", default=None,
              help="Let a thinking model think before it answers, or not (default: its template's).")
@click.option("--hide-thinking", is_flag=True, help="Do not show the thought on stderr (it still counts in the stats).")
@click.option("--image", "images", multiple=True, type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="An image to ask about (repeatable; vision-language models), placed before PROMPT.")
@click.option("--json", "as_json", is_flag=True, help="Print text and every figure as one JSON object.")
@click.option("--json-schema", "json_schema", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="The reply is JSON valid under the JSON schema in FILE (enforced while sampling).")
@click.option("--peak-bandwidth", type=float, help="Peak memory bandwidth in GB/s (default: detected or probed).")
@click.option("--kv-memory", help="KV cache budget, e.g. 2GB (default: sized from the machine).")
@click.option("--attention", type=click.Choice(["auto", "metal", "reference"]), default="auto", show_default=True,
              help="Paged attention backend: the fused Metal kernel (checked at start-up) or gather + SDPA.")
@click.option("--kv-bits", type=click.Choice(["4", "8"]), help="Store the KV cache quantised to 8 (or 4) bits.")
@click.option("--dequantize/--keep-quantized", default=None,
              help="Load quantised weights as float, or keep them quantised (default: float where there is no Metal and it fits, where it is faster).")
@click.option("--no-prefix-cache", is_flag=True,
              help="Recompute the whole prompt: no reuse of a prefix cached in memory or on disk.")
@click.option("--draft", metavar="auto|MODEL|mtp|ngram|MODEL+ngram",
              help="Speculative decoding: auto (the default: the best drafter found for the model), a draft "
                   "model or EAGLE-3 draft (name, path or repo id), the model's own MTP layers, n-gram lookup, both.")
@click.option("--no-draft", is_flag=True, help="No speculative decoding.")
@click.option("--verbose", "-v", is_flag=True, help="Print model and engine details to stderr.")
@engine_option
@parallel_option
def run_cmd(args, system, max_tokens, temp, top_p, top_k, min_p, seed, stop, repetition_penalty, no_chat_template,
            think, hide_thinking, images, as_json, json_schema, peak_bandwidth, kv_memory, attention, kv_bits, dequantize, no_prefix_cache, draft, no_draft, verbose, engine,
            parallel, micro_batches):
    """Generate a reply to PROMPT and stream it to stdout.

    MODEL is a catalog name (default: smollm2-135m, embedded), a local MLX or
    Hugging Face model directory, a .gguf file, or a Hugging Face repo id. With
    one argument it is the prompt and the embedded model answers. PROMPT "-"
    reads the prompt from stdin. A stats line goes to stderr at the end.

    The K/V of the prompt's full blocks is kept on disk (the prefix cache's
    persistent tier, under ~/.cache/macinfer/prefix), so a later run sharing a
    long system prompt skips that part of the prefill ("N cached" in the stats).

    Speculative decoding (exact: greedy output is unchanged, sampling keeps the
    model's distribution; k adapts to measured acceptance and costs, down to
    none). By default --draft auto finds a drafter: the model's own MTP layers,
    a draft made for it (shipped, or an EAGLE-3 draft the catalog lists, on
    disk), a smaller model on disk with the same tokenizer, else n-gram lookup;
    -v says which. --draft ngram drafts from the prompt itself (editing,
    quoting), --draft MODEL uses a draft model or EAGLE-3 draft, --draft mtp
    the checkpoint's MTP layers, --draft MODEL+ngram both. With --seed and
    --temp > 0 it is off unless asked for (k depends on timing, so drafts make
    a seeded run unrepeatable); with quantised weights on a host without Metal
    auto drafts nothing (verifying k drafts costs k steps there).

    --json-schema FILE constrains the reply to JSON valid under that schema: every
    token is sampled from those the grammar allows (llguidance), and the reply
    ends as soon as the JSON is complete (after the thought, for a model that thinks).

    A model that thinks first (Qwen3, DeepSeek-R1, gpt-oss, ...): the answer goes
    to stdout, the thought to stderr, dimmed (--hide-thinking leaves it out);
    --no-think asks the template for no thought; --json has it as "reasoning".

    --image FILE (repeatable) shows a vision-language model the image(s) before
    PROMPT; the model's processor sizes them (needs macinfer[vision]).

    \b
    Examples:
      macinfer run "What is the capital of France?"
      macinfer run ./SmolLM2-135M-Instruct.Q4_1.gguf "Tell me a joke" --temp 0.7 --seed 1
      macinfer run mlx-community/Qwen3-0.6B-4bit "Hello" --max-tokens 64 --json
      macinfer run --draft ngram "Fix the typo: def add(a, b): retrun a + b"
      macinfer run -v --draft mtp ./Qwen3-Next-80B-A3B-Instruct "Hello"
      macinfer run "Describe Paris as JSON" --json-schema city.json
      macinfer run mlx-community/Qwen3-0.6B-4bit "Why is the sky blue?" --hide-thinking
      macinfer run gemma3-4b --image cat.jpg "Describe it"
      mlx.launch --hostfile hosts.json --backend ring -- macinfer run MODEL "Hello"   # across Macs
    """
    from macinfer.core.sampling import SamplingParams

    model, prompt = _model_and_prompt(args)
    schema = _read_schema(json_schema) if json_schema else None
    pictures = [read_image(p, f"--image {p}") for p in images]  # a bad file fails before the model loads
    params = SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                            max_tokens=max_tokens, stop=list(stop), repetition_penalty=repetition_penalty)

    from macinfer.perf.bandwidth import peak_bandwidth as find_peak
    from macinfer.llm import LLM

    if draft and no_draft:
        raise MacinferError("--draft and --no-draft contradict each other: pick one")
    # One request: size the KV pool for one full-context sequence, not for a server's worth.
    options = {"max_num_seqs": 1, **({"kv_memory": kv_memory} if kv_memory else {}),
               "enable_prefix_cache": not no_prefix_cache, "persist_prefix_cache": not no_prefix_cache,
               "kv_bits": int(kv_bits) if kv_bits else None, "attention": attention}
    options["draft"] = None if no_draft else draft or _default_draft(seed, temp, engine)
    llm = LLM(model, dequantize=dequantize, engine=engine, parallel=parallel, micro_batches=micro_batches, **options)
    info = llm.info
    if verbose:
        _print_details(llm)
    mm = None
    if pictures:  # the images' prompt through the chat template as it is (no thinking parse)
        ids, mm = _image_prompt(llm, prompt, system, no_chat_template, pictures)
        params, parser = dataclasses.replace(params, structured=schema), None
    else:
        ids, params, parser = _prepare(llm, prompt, system, no_chat_template, params, schema, think)
    reply = _stream(llm, ids, params, parser, echo=not as_json, show_thinking=not hide_thinking, mm=mm)
    out = reply.output
    stats = run_stats(out, info, find_peak(peak_bandwidth), reply.reasoning_tokens)
    if as_json:
        click.echo(json.dumps({"model": info.name, "text": reply.text, "reasoning": reply.reasoning,
                               "token_ids": out.token_ids, **stats}))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        click.echo(stats_line(stats), err=True)


def _default_draft(seed, temp: float, engine: str) -> str | None:
    """`auto` unless drafts would cost what the user asked for: a seeded sampled run repeats only
    without them (k depends on timing), mlx-lm's engine has none, and across ranks it is off.

    NOTE: auto itself drafts nothing where verifying does not pay (quantised weights on MLX's CPU
    backend: macinfer.spec_decode.auto_draft.verify_pays).
    """
    if (seed is not None and temp > 0) or engine == "mlx-lm" or os.environ.get("MLX_RANK") is not None:
        return None
    return "auto"


def _model_and_prompt(args: tuple[str, ...]) -> tuple[str | None, str]:
    """[MODEL] PROMPT from the arguments; PROMPT "-" is read from stdin."""
    if len(args) > 2:
        raise MacinferError(f"expected [MODEL] PROMPT, got {len(args)} arguments: quote the prompt")
    model, prompt = (None, args[0]) if len(args) == 1 else args
    if prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise MacinferError("the prompt is empty: give some text to complete")
    return model, prompt


def _read_schema(path: Path):
    """--json-schema FILE as a StructuredOutput, checked before the model loads."""
    from macinfer.core.grammar import StructuredOutput

    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise MacinferError(f"--json-schema {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    try:
        structured = StructuredOutput(json_schema=text)
        structured.lark()
    except ValueError as e:
        raise MacinferError(f"--json-schema {path}: {e}") from None
    return structured


def _print_details(llm) -> None:
    """--verbose: the model, the BLAS library and the engine's capacity, on stderr."""
    from macinfer import _blas

    info = llm.info
    click.echo(f"model {info.name}: {info.model_type}, {info.num_params / 1e6:.0f}M params, "
               f"{info.quantization}, {fmt_bytes(info.weight_bytes)}, from {info.path}", err=True)
    if "dequantized_from" in info.extra:
        click.echo(f"weights dequantised from {info.extra['dequantized_from']}; --keep-quantized keeps them", err=True)
    click.echo(f"BLAS: {_blas.loaded or 'bundled'}", err=True)
    click.echo(llm.engine.describe(), err=True)


def _prepare(llm, prompt: str, system: str | None, no_chat_template: bool, params, schema, think):
    """(prompt ids, sampling, the reply's OutputParser or None): through the chat template when the
    model has one and it is wanted (macinfer.chat: thinking, the schema after the thought)."""
    import dataclasses

    from macinfer.chat.request import ChatRequest, prepare

    if no_chat_template or not getattr(llm.tokenizer, "chat_template", None):
        return llm.encode(prompt), dataclasses.replace(params, structured=schema), None
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    rf = {"type": "json_schema", "json_schema": {"schema": schema.json_schema}} if schema is not None else None
    prepared = prepare(llm.tokenizer, ChatRequest(messages, response_format=rf, enable_thinking=think), params)
    return prepared.prompt_ids, prepared.params, prepared.new_parser()


def _image_prompt(llm, prompt: str, system: str | None, no_chat_template: bool, pictures: list):
    """(ids, MultiModalInputs) of PROMPT with --image pictures before it."""
    if no_chat_template or not getattr(llm.tokenizer, "chat_template", None):
        return llm.image_prompt(prompt, pictures)
    content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": prompt}]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return llm.image_prompt(messages, pictures)


@dataclasses.dataclass
class Reply:
    """What `run` printed: the answer, the thought (None: none), the engine's output, thought tokens."""

    text: str
    reasoning: str | None
    output: object
    reasoning_tokens: int = 0


def _stream(llm, ids: list[int], params, parser, echo: bool, show_thinking: bool = True, mm=None) -> Reply:
    """Generate: the answer to stdout and the thought dimmed to stderr as they come (if `echo`); `mm`: the
    prompt's images."""
    from macinfer.chat.events import ContentDelta, Finish, ThinkingDelta

    answer, thought, out, reasoning_tokens = [], [], None, 0
    for delta in llm.stream(ids, params, mm=mm):
        events = parser.feed(delta) if parser is not None else [ContentDelta(delta.text)] if delta.text else []
        for e in events:
            if isinstance(e, ThinkingDelta):
                thought.append(e.text)
                if echo and show_thinking:
                    click.echo(click.style(e.text, dim=True), err=True, nl=False)
            elif isinstance(e, ContentDelta):
                if echo and show_thinking and thought and not answer:
                    click.echo("", err=True)  # the thought ends: the answer starts on its own line
                answer.append(e.text)
                if echo:
                    sys.stdout.write(e.text)
                    sys.stdout.flush()
            elif isinstance(e, Finish):
                reasoning_tokens = e.usage.reasoning_tokens
        if delta.output is not None:
            out = delta.output
    if parser is None:
        return Reply(out.text, None, out)
    return Reply("".join(answer), "".join(thought) if thought else None, out, reasoning_tokens)


def _register_optional_commands():
    """Commands owned by their own modules; a missing module just hides its command."""
    import importlib

    for module, names in (
        ("macinfer.cli.quantize", ("quantize_cmd", "eval_cmd")),
        ("macinfer.cli.serve", ("serve_cmd",)),
        ("macinfer.cli.bench", ("bench_cmd",)),
        ("macinfer.cli.kv", ("kv_cmd",)),
        ("macinfer.cli.chat", ("chat_cmd",)),
        ("macinfer.cli.doctor", ("doctor_cmd",)),
        ("macinfer.cli.models", ("ls_cmd", "pull_cmd", "rm_cmd", "show_cmd", "cache_cmd")),
    ):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        for name in names:
            if hasattr(mod, name):
                main.add_command(getattr(mod, name))


_register_optional_commands()
