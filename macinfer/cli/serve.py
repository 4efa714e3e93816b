"""`macinfer serve`: the OpenAI-compatible HTTP server (registered by macinfer.cli.main).

The command's docstring is its --help. MacinferError becomes one line, never a traceback.
"""

from __future__ import annotations

import click

from macinfer.errors import MacinferError
from macinfer.units import parse_bytes

from macinfer.cli.options import engine_option, engine_options, one_line_errors, parallel_option


@click.command("serve")
@click.argument("model", required=False)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 exposes it to the network).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--api-key", envvar="MACINFER_API_KEY", help="Require the key on every request: 'Authorization: Bearer KEY' (or Anthropic's 'x-api-key: KEY').")
@click.option("--health-auth", is_flag=True, help="Require the API key on /health too (open by default, for load balancers).")
@click.option("--max-queue", type=click.IntRange(0),
              help="Requests waiting beyond --max-num-seqs at most (default 256); more get 429 with Retry-After.")
@click.option("--served-model-name", help="The default model's name for clients (default: the model's name).")
@click.option("--model", "models", multiple=True,
              help="A model to serve (repeatable): the first given (or MODEL) is the default, for requests naming "
                   "none; the others load on the first request naming them.")
@click.option("--local-models/--no-local-models", default=True, show_default=True,
              help="Also serve every model `macinfer ls` lists as downloaded, by the name it lists.")
@click.option("--max-loaded-models", type=click.IntRange(0), default=1, show_default=True,
              help="Models loaded at once besides the default; loading another unloads the least recently used.")
@click.option("--models-memory",
              help="Memory the loaded models' weights and KV pools may take, e.g. 24GB; the least recently used "
                   "are unloaded to stay under it (default: no limit).")
@click.option("--kv-memory", help="KV cache budget, e.g. 4GB (default: sized from the machine).")
@click.option("--max-num-seqs", type=click.IntRange(1), help="Requests decoded together at most.")
@click.option("--dequantize/--keep-quantized", default=None,
              help="Load quantised weights as float, or keep them quantised (default: float where there is no Metal and it fits, where it is faster).")
@click.option("--draft", metavar="auto|MODEL|mtp|ngram|MODEL+ngram",
              help="Speculative decoding for every model served: auto (the best drafter found for each model), a "
                   "draft model or EAGLE-3 draft, the model's MTP layers, n-gram lookup (default: none).")
@click.option("--lenient", is_flag=True,
              help="Accept and ignore request fields the server does not know (default: a 400 naming the field).")
@click.option("--allow-remote-images", is_flag=True,
              help="Let image content parts name http(s) URLs, fetched by the server (default: data URLs and local paths).")
@click.option("--max-stored-responses", type=click.IntRange(0), default=1000, show_default=True,
              help="Responses kept for /v1/responses' previous_response_id (on disk, so they survive a restart; "
                   "the oldest go first; 0 keeps none).")
@click.option("--stored-responses-size", default="1GB", show_default=True, metavar="SIZE",
              help="Disk the stored responses may take (their images included); the oldest go first.")
@engine_option
@parallel_option
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@one_line_errors
def serve_cmd(model, host, port, api_key, health_auth, max_queue, served_model_name, models, local_models,
              max_loaded_models, models_memory, kv_memory, max_num_seqs, dequantize, draft, lenient, allow_remote_images,
              max_stored_responses, stored_responses_size, log_level, engine, parallel, micro_batches):
    """Serve MODEL over OpenAI's, Anthropic's and Ollama's HTTP APIs with continuous batching.

    \b
    OpenAI:    POST /v1/chat/completions, /v1/completions, /v1/responses
               (GET / DELETE /v1/responses/ID), GET /v1/models
    Anthropic: POST /v1/messages, /v1/messages/count_tokens
    Ollama:    POST /api/chat, /api/generate, /api/show, /api/pull,
               GET /api/tags, /api/ps, /api/version, DELETE /api/delete
    Also:      GET /health, /metrics (Prometheus; requests labelled by protocol)

    Every protocol streams ("stream": true; Ollama's by default) and goes through
    the same engine, sampling, grammar, thinking split, tool parsing, limits and
    auth (the key as 'Authorization: Bearer KEY' or 'x-api-key: KEY'); errors come
    in each protocol's own shape. Stored Responses (previous_response_id) live in
    $MACINFER_HOME/responses. Concurrent clients are batched by the engine; a client
    that disconnects aborts its request. See docs/protocols.md.

    Sampling defaults are OpenAI's (temperature 1). Also: logprobs, penalties,
    logit_bias, n > 1 (sharing the prompt's KV), tools; vLLM's top_k, min_p,
    ignore_eos, return_token_ids; mlx-lm's repetition_penalty. An unknown field
    is a 400 naming it, unless --lenient. With --api-key, every route but
    /health needs the key (--health-auth: /health too). Bodies over 8 MiB get 413;
    beyond --max-queue waiting requests, 429 with Retry-After. A vision-language
    model takes image_url content parts on /v1/chat/completions: data URLs and
    paths on this host (--allow-remote-images: http(s) URLs too).

    Several models: each --model, and any model `macinfer ls` lists, is loaded on
    the first request naming it ("model"); GET /v1/models lists them all, each
    with "loaded". The default model stays loaded; beyond --max-loaded-models
    others (or --models-memory), the least recently used one is unloaded once its
    requests have finished. /metrics then labels each series with model="...".

    --draft auto drafts for each model with what `--draft auto` finds for it
    (docs/speculation.md; exact, k adapts to the load); GET /v1/models says
    which drafter each loaded model uses ("draft").

    \b
    Examples:
      macinfer serve                                    # embedded SmolLM2-135M on 127.0.0.1:8000
      macinfer serve ./my-mlx-model --port 8080 --api-key secret
      macinfer serve --model smollm2-135m --model ./my-mlx-model --max-loaded-models 2
      macinfer serve qwen3-8b --draft auto
      curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}]}'
      OLLAMA_HOST=127.0.0.1:8000 ollama list              # Ollama's own CLI and clients
      ANTHROPIC_BASE_URL=http://127.0.0.1:8000 claude     # Anthropic's clients
      mlx.launch --hostfile hosts.json --backend ring -- macinfer serve MODEL   # across Macs: rank 0 serves
    """
    from macinfer.llm import LLM
    from macinfer.serve.guard import check_api_key
    from macinfer.paths import cache_dir
    from macinfer.serve.model_pool import PoolOptions
    from macinfer.serve.response_store import ResponseStore
    from macinfer.serve.server import create_app

    check_api_key(api_key)  # before the model loads
    stored_bytes = parse_bytes(stored_responses_size, "--stored-responses-size")
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        click.echo(f"warning: serving on {host} without --api-key: anyone who can reach it can use it", err=True)
    specs = ([model] if model else []) + list(models)
    others = _named(specs[1:])  # a typo is found now, not at the first request naming it
    PoolOptions(others=others, max_loaded=max_loaded_models)  # its refusals before the model loads
    options = engine_options(kv_memory, max_num_seqs) | ({"draft": draft} if draft else {})
    llm = LLM(specs[0] if specs else None, dequantize=dequantize, engine=engine, parallel=parallel,
              micro_batches=micro_batches, **options)
    click.echo(llm.engine.describe(), err=True)
    import uvicorn

    pool = _pool_options(llm, others, local_models, max_loaded_models, models_memory,
                         lambda spec: LLM(spec, dequantize=dequantize, engine=engine, **options), kv_memory)
    pool.lease_what = f"macinfer serve on port {port}"  # `macinfer rm` refuses a loaded model
    limits = {"max_queue": max_queue} if max_queue is not None else {}
    store = ResponseStore(cache_dir() / "responses", limit=max_stored_responses,
                          max_bytes=stored_bytes)
    app = create_app(llm, api_key=api_key, model_name=served_model_name, health_auth=health_auth, lenient=lenient,
                     models=pool, allow_remote_images=allow_remote_images, response_store=store, **limits)
    click.echo(f"serving {served_model_name or llm.info.name} on http://{host}:{port}/v1", err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def _named(specs: list[str]) -> dict[str, str]:
    """{the name `macinfer ls` gives it: spec} of each model (a catalog name, repo id, directory name)."""
    from macinfer.modelio.registry import find_model

    named = {}
    for spec in specs:
        name = find_model(spec).name
        if name in named and named[name] != spec:
            raise MacinferError(f"two models are named '{name}' ({named[name]}, {spec}): serve one of them")
        named[name] = spec
    return named


def _pool_options(llm, others: dict[str, str], local_models: bool, max_loaded: int, memory: str | None, load, kv_memory):
    """The models besides `llm` this server serves (none across ranks: every rank runs one model's forwards)."""
    from macinfer.serve.model_pool import PoolOptions, estimate_bytes, local_models as listed
    from macinfer.units import parse_bytes

    if getattr(llm, "ranks", None) is not None:
        if others:
            raise MacinferError("across ranks (mlx.launch) a server serves one model: leave out --model")
        return PoolOptions()
    return PoolOptions(others=others, load=load, discover=listed if local_models else None, max_loaded=max_loaded,
                       memory=parse_bytes(memory, "--models-memory") if memory else None,
                       estimate=lambda spec: estimate_bytes(spec, kv_memory))
