"""`macinfer chat`: registered on the macinfer CLI by macinfer.cli."""

from __future__ import annotations

import os

import click

from macinfer.cli.options import engine_option, one_line_errors
from macinfer.errors import MacinferError


@click.command("chat")
@click.argument("model", required=False)
@click.option("--system", default="", help="System prompt (change it later with /system).")
@click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=512, show_default=True,
              help="Longest reply in tokens (/max-tokens).")
@click.option("--temp", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Sampling temperature; 0 is greedy (/temp).")
@click.option("--seed", type=click.IntRange(0, 2**64 - 1), help="Random seed for reproducible sampling.")
@click.option("--peak-bandwidth", type=float, help="Peak memory bandwidth in GB/s (default: detected or probed).")
@click.option("--kv-memory", help="KV cache budget, e.g. 2GB (default: sized from the machine).")
@click.option("--dequantize/--keep-quantized", default=None,
              help="Load quantised weights as float, or keep them quantised (default: float where there is no Metal and it fits, where it is faster).")
@click.option("--draft", help="Speculative decoding drafter: ngram, a draft model, MODEL+ngram or auto (toggle with /spec).")
@click.option("--no-prefix-cache", is_flag=True, help="Start with the prefix cache off (toggle with /prefix-cache).")
@click.option("--resume", type=click.Path(dir_okay=False),
              help="Continue a conversation saved with /save (its model and settings; options given here win).")
@click.option("--url", metavar="URL",
              help="Chat with a running OpenAI-compatible server (macinfer serve, also under mlx.launch) "
                   "instead of loading a model: http://HOST:PORT.")
@click.option("--api-key", metavar="KEY", help="With --url: the server's API key.")
@click.option("--model", "model_name", metavar="NAME",
              help="With --url: the served model to chat with (default: the first one it lists).")
@engine_option
@one_line_errors
def chat_cmd(model, system, max_tokens, temp, seed, peak_bandwidth, kv_memory, dequantize, draft, no_prefix_cache,
             resume, url, api_key, model_name, engine):
    """Chat with MODEL in a terminal UI that shows live speed and memory figures.

    MODEL is a catalog name (default: smollm2-135m, embedded), a local model
    directory, a .gguf file or a Hugging Face repo id. Enter sends, Ctrl+J adds
    a line, Esc cancels a reply, F1 lists keys and /commands, Ctrl+Q quits.

    \b
    Examples:
      macinfer chat
      macinfer chat ./my-mlx-model --system "Answer briefly." --temp 0.7
      macinfer chat --resume chat.json                    # after /save chat.json
      macinfer chat --url http://127.0.0.1:8000           # a running `macinfer serve`
    """
    from macinfer.tui.app import ChatApp  # light: MLX and the model load in the engine process, behind a progress bar
    from macinfer.tui.session import ChatSession

    session = None
    if resume:
        session, saved_model = ChatSession.load(resume)
        model = model or (None if url else saved_model)  # a saved local MODEL means nothing to a server
        ctx = click.get_current_context()
        for attr, name, value in (("system", "system", system), ("temperature", "temp", temp),
                                  ("max_tokens", "max_tokens", max_tokens), ("seed", "seed", seed)):
            if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE:
                setattr(session, attr, value)

    if os.environ.get("MLX_RANK") is not None:  # set by mlx.launch on every rank
        raise MacinferError("chat runs in one process: under mlx.launch, use `macinfer serve` (rank 0 serves) "
                            "or `macinfer run`, and watch it with `macinfer chat --url`")
    if url or api_key or model_name:
        model = _remote_model(url, model, model_name)
        ChatApp(model, system=system, temperature=temp, max_tokens=max_tokens, seed=seed, session=session,
                resumed_from=resume, url=url, api_key=api_key).run()
        return
    options = {"engine": engine, **({"kv_memory": kv_memory} if kv_memory else {})}
    if draft:
        options["draft"] = draft
    if no_prefix_cache:
        options["enable_prefix_cache"] = False
    ChatApp(model, dequantize=dequantize, peak_bandwidth=peak_bandwidth, system=system, temperature=temp,
            max_tokens=max_tokens, seed=seed, engine_options=options, session=session, resumed_from=resume).run()


# Options that act on a model loaded here: with --url the server's own settings apply.
_LOCAL_ONLY = ("kv_memory", "dequantize", "draft", "no_prefix_cache", "peak_bandwidth", "engine")


def _remote_model(url: str | None, model: str | None, model_name: str | None) -> str | None:
    """The model to ask the server for; refuses what needs a local engine, in one line."""
    ctx = click.get_current_context()
    if not url:
        raise MacinferError("--api-key and --model go with --url (a server to talk to)")
    given = [name for name in _LOCAL_ONLY
             if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise MacinferError(f"{flags}: set on a model loaded here; with --url, the server's own settings apply "
                            "(pass them to `macinfer serve`)")
    if model and model_name and model != model_name:
        raise MacinferError(f"two models asked for: MODEL {model} and --model {model_name}: give one")
    from macinfer.tui.remote import check_server

    check_server(url, ctx.params["api_key"], model_name or model)  # one line, before the UI starts
    return model_name or model
