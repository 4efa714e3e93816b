#!/usr/bin/env python3
"""Probe `macinfer serve` as an attacker and a careless client would; one line per check.

The server runs in this process (uvicorn on a thread, as the tests run it), so the engine can be
inspected afterwards. Checks:

    bad:<name>     one malformed or out-of-range request (48 kinds): a 4xx with OpenAI's error body
                   ({"error": {"message", "type", "param", "code"}}), `param` as OpenAI names it
                   where the request names a field, a `code` always, no traceback or source path
                   in the body, and the server still answers the next request
    auth           a request without the key: 401 with `WWW-Authenticate: Bearer`
    concurrency    64 streams at once, greedy: each equal to the same request alone
    disconnects    200 streams the client drops at random points: every KV block back afterwards
    n4-logprobs    n=4 with logprobs under load: four choices, each with its logprobs
    in-flight      nothing left running at the end

Usage: python scripts/probe_server.py [--model smollm2-135m|tiny] [--seed 0]
Prints one line per check (`held` or `FAILED: ...`) and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HI = [{"role": "user", "content": "hi"}]


def chat(**extra) -> dict:
    return {"messages": HI, "max_tokens": 4, **extra}


def schema(s) -> dict:
    return chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": s}})


# name -> (path, body (dict, bytes or None), expected status, expected param or None (any))
BAD: dict[str, tuple] = {
    "invalid-json": ("/v1/chat/completions", b"{not json", 400, None),
    "invalid-utf8": ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    "deep-json": ("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, 400, None),
    "not-an-object": ("/v1/chat/completions", b"[1, 2]", 400, None),
    "empty-body": ("/v1/chat/completions", b"", 400, None),
    "no-messages": ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    "messages-not-list": ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    "empty-messages": ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    "no-role": ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    "bad-role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    "content-int": ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    "unknown-field": ("/v1/chat/completions", chat(max_token=3), 400, "max_token"),
    "unknown-model": ("/v1/chat/completions", chat(model="gpt-9"), 404, "model"),
    "temperature-negative": ("/v1/chat/completions", chat(temperature=-1), 400, "temperature"),
    "temperature-huge": ("/v1/chat/completions", chat(temperature=1e9), 400, "temperature"),
    "temperature-string": ("/v1/chat/completions", chat(temperature="hot"), 400, "temperature"),
    "top-p-zero": ("/v1/chat/completions", chat(top_p=0), 400, "top_p"),
    "top-p-two": ("/v1/chat/completions", chat(top_p=2), 400, "top_p"),
    "top-k-negative": ("/v1/chat/completions", chat(top_k=-2), 400, "top_k"),
    "min-p-two": ("/v1/chat/completions", chat(min_p=2), 400, "min_p"),
    "max-tokens-zero": ("/v1/chat/completions", chat(max_tokens=0), 400, "max_tokens"),
    "max-tokens-negative": ("/v1/chat/completions", chat(max_tokens=-3), 400, "max_tokens"),
    "max-tokens-string": ("/v1/chat/completions", chat(max_tokens="many"), 400, "max_tokens"),
    "n-zero": ("/v1/chat/completions", chat(n=0), 400, "n"),
    "n-huge": ("/v1/chat/completions", chat(n=1000), 400, "n"),
    "stop-many": ("/v1/chat/completions", chat(stop=["x"] * 40), 400, "stop"),
    "stop-100kb": ("/v1/chat/completions", chat(stop="x" * 100_000), 400, "stop"),
    "seed-huge": ("/v1/chat/completions", chat(seed=2**70), 400, "seed"),
    "presence-penalty": ("/v1/chat/completions", chat(presence_penalty=3), 400, "presence_penalty"),
    "frequency-penalty": ("/v1/chat/completions", chat(frequency_penalty=-3), 400, "frequency_penalty"),
    "logit-bias-key": ("/v1/chat/completions", chat(logit_bias={"dog": 1}), 400, "logit_bias"),
    "logit-bias-value": ("/v1/chat/completions", chat(logit_bias={"1": 500}), 400, "logit_bias"),
    "top-logprobs-21": ("/v1/chat/completions", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    "top-logprobs-alone": ("/v1/chat/completions", chat(top_logprobs=2), 400, "top_logprobs"),
    "stream-string": ("/v1/chat/completions", chat(stream="yes"), 400, "stream"),
    "stream-options-alone": ("/v1/chat/completions", chat(stream_options={"include_usage": True}), 400,
                             "stream_options"),
    "response-format-unknown": ("/v1/chat/completions", chat(response_format={"type": "xml"}), 400,
                                "response_format.type"),
    "schema-invalid": ("/v1/chat/completions", schema({"type": "frob"}), 400, "response_format"),
    "schema-degenerate": ("/v1/chat/completions", schema({"$ref": "#"}), 400, "response_format"),
    "schema-impossible": ("/v1/chat/completions", schema({"type": "string", "minLength": 5, "maxLength": 2}), 400,
                          "response_format"),
    "tools-not-list": ("/v1/chat/completions", chat(tools={"type": "function"}), 400, "tools"),
    "tool-choice-unknown": ("/v1/chat/completions",
                            chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
                                 tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    "prompt-too-long": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 40_000}],
                                                 "max_tokens": 4}, 400, None),
    "completion-no-prompt": ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    "completion-batch": ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 4}, 400, "prompt"),
    "completion-bad-ids": ("/v1/completions", {"prompt": [10**9], "max_tokens": 4}, 400, "prompt"),
    "completion-empty": ("/v1/completions", {"prompt": "", "max_tokens": 4}, 400, "prompt"),
    "body-over-limit": ("/v1/chat/completions", None, 413, None),  # 9 MiB, chunked
}
TRACE = re.compile(r"Traceback|File \"|\.py\", line")


async def _oversized():
    for _ in range(9):
        yield b"x" * (1 << 20)


def _check_error(r, status: int, param) -> str | None:
    """What is wrong with an error response, or None."""
    if r.status_code != status:
        return f"status {r.status_code}, expected {status}: {r.text[:120]}"
    try:
        err = r.json()["error"]
    except Exception:
        return f"not OpenAI's error body: {r.text[:120]}"
    if not err.get("message") or TRACE.search(r.text):
        return f"message {err.get('message')!r}"
    if not err.get("code"):
        return f"no code ({err.get('message')!r})"
    if param is not None and err.get("param") != param:
        return f"param {err.get('param')!r}, expected {param!r}"
    return None


async def check_bad(client) -> dict[str, str | None]:
    out = {}
    for name, (path, body, status, param) in BAD.items():
        if body is None:
            r = await client.post(path, content=_oversized(), headers={"Content-Type": "application/json"})
        elif isinstance(body, bytes):
            r = await client.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = await client.post(path, json=body)
        problem = _check_error(r, status, param)
        alive = await client.post("/v1/chat/completions", json=chat(max_tokens=1))
        if problem is None and alive.status_code != 200:
            problem = f"the next request got {alive.status_code}"
        out[f"bad:{name}"] = problem
    return out


async def check_concurrency(client, n: int = 64, tokens: int = 8) -> str | None:
    prompts = [f"Count to {i}:" for i in range(n)]

    async def stream(p):
        text = ""
        async with client.stream("POST", "/v1/completions", json={"prompt": p, "max_tokens": tokens,
                                                                  "temperature": 0, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    together = await asyncio.gather(*(stream(p) for p in prompts))
    for p, got in zip(prompts[:8], together[:8]):  # solo runs of the first eight
        if await stream(p) != got:
            return f"{p!r}: batched output differs from the same request alone"
    return None


async def check_disconnects(client, n: int = 200) -> str | None:
    rng = random.Random(0)

    async def drop(i):
        try:
            async with client.stream("POST", "/v1/chat/completions",
                                     json={**chat(max_tokens=32), "stream": True}) as r:
                k = rng.randrange(0, 6)
                async for line in r.aiter_lines():
                    k -= line.startswith("data: ")
                    if k <= 0:
                        return
        except Exception:
            return

    await asyncio.gather(*(drop(i) for i in range(n)))
    return None


async def check_n4(client) -> str | None:
    load = [client.post("/v1/completions", json={"prompt": f"load {i}", "max_tokens": 8}) for i in range(8)]
    r, *_ = await asyncio.gather(client.post("/v1/chat/completions", json=chat(n=4, logprobs=True, top_logprobs=2,
                                                                               temperature=0.8, max_tokens=6)), *load)
    choices = r.json().get("choices", [])
    if r.status_code != 200 or len(choices) != 4:
        return f"status {r.status_code}, {len(choices)} choices"
    if any(not (c.get("logprobs") or {}).get("content") for c in choices):
        return "a choice without logprobs"
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="any model `macinfer run` takes (default: the embedded SmolLM2), "
                                                 "or 'tiny' (the tests' random-weight llama)")
    a = p.parse_args()

    import macinfer  # noqa: F401  (OpenBLAS before mlx)
    import httpx2 as httpx  # the HTTP client the openai SDK installs here
    from macinfer.llm import LLM
    from macinfer.serve.server import create_app, serve_in_thread
    from soak import settle  # scripts/soak.py: wait for aborts to reach the engine

    model = a.model
    if model == "tiny":
        import tempfile

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from tiny import build_tiny_model

        model = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="macinfer-probe-")), "llama"))
    llm = LLM(model, max_num_seqs=64, persist_prefix_cache=False)
    results: dict[str, str | None] = {}

    async def run(url: str, keyed: str):
        async with httpx.AsyncClient(base_url=url, timeout=600, headers={"Authorization": f"Bearer {keyed}"}) as c:
            results.update(await check_bad(c))
            results["concurrency"] = await check_concurrency(c)
            results["disconnects"] = await check_disconnects(c)
            results["n4-logprobs"] = await check_n4(c)
        async with httpx.AsyncClient(base_url=url, timeout=60) as anonymous:
            r = await anonymous.get("/v1/models")
            results["auth"] = (None if r.status_code == 401 and r.headers.get("www-authenticate", "").startswith("Bearer")
                               else f"status {r.status_code}, WWW-Authenticate {r.headers.get('www-authenticate')!r}")

    app = create_app(llm, api_key="probe-key")
    aengine = app.state.server.engine
    with serve_in_thread(app) as url:
        asyncio.run(run(url, "probe-key"))
        stats = settle(llm, aengine)
    if results["disconnects"] is None and stats["used_blocks"]:
        results["disconnects"] = f"{stats['used_blocks']} KV blocks still held"
    results["in-flight"] = None if aengine.num_active == 0 else f"{aengine.num_active} requests still in flight"
    for name, problem in results.items():
        print(f"{name:32s} {'held' if problem is None else 'FAILED: ' + problem}")
    failed = sum(v is not None for v in results.values())
    print(f"{len(results) - failed} of {len(results)} checks held ({llm.info.name})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
