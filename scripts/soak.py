#!/usr/bin/env python3
"""Soak test of `macinfer serve`: many mixed requests, then nothing may be left behind.

The server runs in this process (uvicorn on a thread, as the tests run it) so the engine can
be inspected afterwards. A seeded mix of requests goes through it, --concurrency at a time:

    stream      streaming chat, read to the end
    complete    non-streaming completion
    disconnect  streaming, the client hangs up after a few chunks
    abort       the client gives up before the reply (cancelled mid-prefill or mid-decode)
    bad         a bad body: invalid JSON, wrong types, unknown model, bad sampling values,
                too many stop strings; one in 25 of them an oversized chunked body (413)

Pass: every request gets the answer its kind expects (a bad body a 4xx with OpenAI's error
body, never a 5xx or a dropped connection), and afterwards no request is in flight, every
KV block is back in the pool, and MLX's active memory grew by less than the KV pool's bytes
(measured after a warm-up of --warmup requests). RSS is sampled after the warm-up and after
each fifth of the requests, and printed.

Usage: python scripts/soak.py [--model smollm2-135m|tiny] [--requests 1000] [--concurrency 16]
       [--max-tokens 12] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KINDS = {"stream": 0.35, "complete": 0.2, "disconnect": 0.15, "abort": 0.1, "bad": 0.2}
BAD_BODIES = [
    b"{not json",
    b"[1, 2]",
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}).encode(),
    json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(),
    json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "top_p": 7}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "seed": 2**70}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "stop": ["x"] * 40}).encode(),
]


def rss_bytes() -> int:
    """Resident set size now (Linux /proc), else the peak so far (macOS reports it in bytes)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


async def _oversized():
    """A 9 MiB body sent chunked (no Content-Length): only the bytes read can tell it is too large."""
    for _ in range(9):
        yield b"x" * (1 << 20)


async def one(client, kind: str, rng: random.Random, a) -> str:
    """Run one request of `kind`; return "ok" or what went wrong."""
    content = f"Request {rng.randrange(10**6)}: tell me about paged attention. " * rng.randint(1, 4)
    chat = {"messages": [{"role": "user", "content": content}], "max_tokens": rng.randint(1, a.max_tokens),
            "temperature": rng.choice([0, 0.8]), "seed": rng.randrange(2**32)}
    if kind == "bad":
        if rng.random() < 0.04:
            body, want = _oversized(), 413
        else:
            body, want = rng.choice(BAD_BODIES), None
        r = await client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        ok = 400 <= r.status_code < 500 and (want is None or r.status_code == want) and r.json()["error"]["message"]
        return "ok" if ok else f"bad body got {r.status_code}"
    if kind == "complete":
        r = await client.post("/v1/completions", json={"prompt": content, "max_tokens": chat["max_tokens"]})
        return "ok" if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] else f"complete {r.status_code}"
    if kind == "abort":
        task = asyncio.ensure_future(client.post("/v1/chat/completions", json={**chat, "max_tokens": 64}))
        await asyncio.sleep(rng.uniform(0, 0.3))
        task.cancel()
        try:
            r = await task
            return "ok" if r.status_code == 200 else f"abort {r.status_code}"
        except asyncio.CancelledError:
            return "ok"
    async with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
        if r.status_code != 200:
            return f"{kind} {r.status_code}"
        n, done = 0, False
        async for line in r.aiter_lines():
            n += line.startswith("data: ")
            done = done or line == "data: [DONE]"
            if kind == "disconnect" and n >= 2:
                return "ok"
        return "ok" if done else "stream ended without [DONE]"


async def drive(url: str, a, kinds: list[str]) -> Counter:
    import httpx2 as httpx  # the HTTP client the openai SDK installs here (as the tests use it)

    rng = random.Random(a.seed)
    seeds = [rng.randrange(2**32) for _ in kinds]
    sem = asyncio.Semaphore(a.concurrency)
    outcomes: Counter = Counter()

    async def guarded(kind, seed):
        async with sem:
            try:
                outcomes[(kind, await one(client, kind, random.Random(seed), a))] += 1
            except Exception as e:  # a dropped connection, a timeout: a failure
                outcomes[(kind, f"{type(e).__name__}: {e}"[:80])] += 1

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await asyncio.gather(*(guarded(k, s) for k, s in zip(kinds, seeds)))
    return outcomes


def settle(llm, aengine, timeout: float = 60) -> dict:
    """Wait for aborts to reach the engine; return its KV stats."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (aengine.num_active or llm.engine.has_unfinished()):
        time.sleep(0.05)
    return llm.engine.kv_stats()


def _tiny_model() -> str:
    """The tests' tiny random-weight llama (tests/tiny.py), built in a temporary directory."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny import build_tiny_model

    return str(build_tiny_model(Path(tempfile.mkdtemp(prefix="macinfer-soak-")), "llama"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help="any model `macinfer run` takes (default: the embedded SmolLM2), or 'tiny' (the tests' model)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    import macinfer  # noqa: F401  (OpenBLAS before mlx)
    import mlx.core as mx
    from macinfer.llm import LLM
    from macinfer.serve.server import create_app, serve_in_thread

    llm = LLM(_tiny_model() if a.model == "tiny" else a.model, max_num_seqs=a.concurrency, persist_prefix_cache=False)
    app = create_app(llm)
    aengine = app.state.server.engine
    rng = random.Random(a.seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=a.requests)
    t0 = time.perf_counter()
    with serve_in_thread(app) as url:
        warm = asyncio.run(drive(url, argparse.Namespace(**{**vars(a), "seed": a.seed + 1}), ["stream"] * a.warmup))
        settle(llm, aengine)
        rss, active = [rss_bytes()], mx.get_active_memory()  # after the warm-up, then after each fifth
        outcomes: Counter = Counter()
        for part in range(5):
            chunk = kinds[part * len(kinds) // 5:(part + 1) * len(kinds) // 5]
            outcomes += asyncio.run(drive(url, argparse.Namespace(**{**vars(a), "seed": a.seed + 2 + part}), chunk))
            stats = settle(llm, aengine)
            rss.append(rss_bytes())
    active_growth = mx.get_active_memory() - active  # MLX arrays still alive: K/V or states leaked
    seconds = time.perf_counter() - t0
    failures = {f"{k}: {why}": n for (k, why), n in (outcomes + warm).items() if why != "ok"}
    result = {
        "model": llm.info.name, "requests": a.requests, "concurrency": a.concurrency, "seconds": round(seconds, 1),
        "kinds": dict(Counter(kinds)), "failures": failures, "in_flight_after": aengine.num_active,
        "kv_blocks_used_after": stats["used_blocks"], "kv_blocks": stats["num_blocks"],
        "aborted_by_engine": aengine.num_aborted, "rss_mb": [round(x / 2**20, 1) for x in rss],
        "mlx_active_growth_mb": round(active_growth / 2**20, 2), "kv_pool_mb": round(stats["pool_bytes"] / 2**20, 1),
    }
    # RSS is reported, not judged: malloc arenas of the tokenising threads and 8 MiB bodies buffered
    # at once raise it in steps that are not leaks. MLX's active memory is what K/V would leak into.
    ok = (not failures and result["in_flight_after"] == 0 and stats["used_blocks"] == 0
          and active_growth < stats["pool_bytes"])
    result["pass"] = ok
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
