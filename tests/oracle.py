"""mlx-lm's own output, the oracle every generation test compares against."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=8)
def mlx_lm_load(path: str):
    import mlx_lm

    return mlx_lm.load(path)


def mlx_lm_greedy(path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy token ids from mlx_lm.stream_generate, stopping at EOS like it does."""
    from mlx_lm.generate import stream_generate

    model, tok = mlx_lm_load(str(path))
    out = []
    for r in stream_generate(model, tok, list(prompt_ids), max_tokens=max_tokens):
        if r.finish_reason == "stop":
            break
        out.append(int(r.token))
    return out


def mlx_lm_server_reply(path, body: dict, tokens: list[int], finish_reason: str):
    """What mlx-lm's own server (mlx_lm.server.APIHandler) returns for `body` when its model generates `tokens`.

    The request runs through mlx-lm's HTTP handler on a loopback port, its prompt through mlx-lm's own
    tokenisation and chat template (ResponseGenerator._tokenize), its text through the
    TextStateMachine and tool parser that server builds; only the generation is replayed: `tokens`
    (and, for finish_reason "stop", the EOS that ended them), detokenised as mlx_lm.stream_generate
    does. Returns the response JSON, or the list of streamed chunks for a streamed body.
    """
    import http.server
    import json
    import threading
    from functools import partial
    from types import SimpleNamespace

    import httpx2 as httpx
    from mlx_lm import server as S
    from mlx_lm.generate import make_stop_sequences, make_text_state_machine

    _, tok = mlx_lm_load(str(path))
    cli_args = SimpleNamespace(allowed_origins=["*"], max_tokens=512, temp=0.0, top_p=1.0, top_k=0, min_p=0.0,
                               num_draft_tokens=3, chat_template_args={})

    class Replay:
        model_provider = SimpleNamespace(processor=None, cli_args=cli_args)

        def __init__(self):
            self.cli_args = cli_args

        def generate(self, request, args, progress_callback=None):
            prompt, _, _, initial, _ = S.ResponseGenerator._tokenize(self, tok, request, args)
            make_stop_sequences(tok, args.stop_words)
            ctx = S.GenerationContext(has_tool_calling=tok.has_tool_calling, has_thinking=tok.has_thinking,
                                      tool_parser=tok.tool_parser, text_sm=make_text_state_machine(tok, args.stop_words),
                                      initial_state=initial, prompt=prompt)

            def responses():  # mlx_lm.generate.stream_generate's texts for these tokens
                detok = tok.detokenizer
                for t in tokens:
                    detok.add_token(t)
                    yield S.Response(detok.last_segment, t, 0.0, None, ())
                detok.finalize()
                last = next(iter(tok.eos_token_ids)) if finish_reason == "stop" else tokens[-1]
                yield S.Response(detok.last_segment, last, 0.0, finish_reason, ())
            return ctx, responses()

    httpd = http.server.HTTPServer(("127.0.0.1", 0), partial(S.APIHandler, Replay(), system_fingerprint="oracle"))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/v1/chat/completions"
        r = httpx.post(url, json=body, timeout=60)
        r.raise_for_status()
        if not body.get("stream"):
            return r.json()
        return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    finally:
        httpd.shutdown()
        httpd.server_close()
