"""`macinfer serve`: the OpenAI-compatible HTTP server (registered by macinfer.cli.main).

The command's docstring is its --help. MacinferError becomes one line, never a traceback.
"""

from __future__ import annotations

import click

from macinfer.cli.options import engine_option, engine_options, one_line_errors, parallel_option


@click.command("serve")
@click.argument("model", required=False)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 exposes it to the network).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--api-key", envvar="MACINFER_API_KEY", help="Require 'Authorization: Bearer KEY' on every request.")
@click.option("--served-model-name", help="The model name clients send (default: the model's name).")
@click.option("--kv-memory", help="KV cache budget, e.g. 4GB (default: sized from the machine).")
@click.option("--max-num-seqs", type=click.IntRange(1), help="Requests decoded together at most.")
@click.option("--dequantize/--keep-quantized", default=None,
              help="Load quantised weights as float, or keep them quantised (default: float where there is no Metal and it fits, where it is faster).")
@engine_option
@parallel_option
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@one_line_errors
def serve_cmd(model, host, port, api_key, served_model_name, kv_memory, max_num_seqs, dequantize, log_level, engine,
              parallel):
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
      mlx.launch --hostfile hosts.json --backend ring -- macinfer serve MODEL   # across Macs: rank 0 serves
    """
    from macinfer.llm import LLM
    from macinfer.serve.server import create_app

    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        click.echo(f"warning: serving on {host} without --api-key: anyone who can reach it can use it", err=True)
    llm = LLM(model, dequantize=dequantize, engine=engine, parallel=parallel, **engine_options(kv_memory, max_num_seqs))
    engine = getattr(llm, "engine", None)
    if hasattr(engine, "describe"):
        click.echo(engine.describe(), err=True)
    import uvicorn

    app = create_app(llm, api_key=api_key, model_name=served_model_name)
    click.echo(f"serving {served_model_name or llm.info.name} on http://{host}:{port}/v1", err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
