"""Benchmark the prefix cache: TTFT with a shared prefix, warm vs cold, against mlx-lm's prompt cache.

Every figure is a ratio to a baseline measured in the same run (docs/platform.md: the
dev machines are shared and noisy). The model is the embedded SmolLM2-135M
dequantised to float32 with OpenBLAS (the fast configuration on a CPU host);
`--tiny` uses a tiny random model instead (fast, for checking the script).

  1. A 2,000-token system prompt + a question: TTFT of the first request (cold)
     vs a second request with another question (warm, prefix in memory).
  2. A second process: the same prompt from the persistent tier on disk (process 1
     saved the blocks when its request finished), then another question with the
     prefix in memory, side by side in each of --repeats fresh engines (each warmed up
     on a short prompt first); the figure is disk / in-memory TTFT (criterion: <= 2x).
  3. A 10-turn chat (chat template, greedy replies): TTFT per turn with the
     cache vs without it (history grows every turn).
  4. mlx-lm on scenarios 1 and 3 with its prompt cache (KVCache reused and
     trimmed to the common prefix, as mlx_lm.server does).

`--hybrid qwen3_next` (or lfm2, mamba2, ...: tests/test_hybrid.py's tiny configurations) runs
instead a tiny random hybrid / SSM model, whose prefix cache rests on recurrent-state snapshots
(macinfer.core.state_snapshots; no disk tier, and mlx-lm cannot trim their caches): a
600-token system prompt + a question, cold, then the same prompt again, another question, and
a third; then a chat, cache vs no cache. TTFT ratios are medians of --repeats fresh engines;
outputs are checked against the engine without the cache and mlx-lm.

Usage:
    python scripts/bench/prefix.py                    # ~10-20 min on 2 shared cores
    python scripts/bench/prefix.py --tiny             # seconds
    python scripts/bench/prefix.py --disk-only        # the persistent tier vs memory, ~2 min
    python scripts/bench/prefix.py --system-tokens 1000 --turns 6
    python scripts/bench/prefix.py --hybrid qwen3_next --system-tokens 600   # ~1 min
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import macinfer  # noqa: E402,F401  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402

from macinfer.engine.llm_engine import LLMEngine  # noqa: E402
from macinfer.core.sampling import SamplingParams  # noqa: E402

TEXT = (
    "You are a careful assistant for a library. Answer questions about opening hours, loans, "
    "renewals, fines, reading rooms, printing, interlibrary requests and events. Be brief and polite. "
    "Rule {i}: when a reader asks about item {i}, check the catalogue, the shelf mark and the due date first. "
)
QUESTIONS = [
    "When does the library open on Sunday?", "How many books can I borrow at once?",
    "Can I renew a loan online?", "What is the fine for a late book?", "Is there a quiet reading room?",
    "How do I print a document?", "Can I request a book from another library?", "Are there events for children?",
    "Do you lend e-readers?", "Where can I find old newspapers?", "Can I bring my laptop?",
]
ENGINE = dict(kv_memory="512MB", max_num_seqs=4, max_num_batched_tokens=512, block_size=16)


def load(tiny_path: str | None):
    """The embedded model in float32, or the tiny model at tiny_path (its engine is unused)."""
    from macinfer.llm import LLM

    if tiny_path:
        return LLM(tiny_path, enable_prefix_cache=False, num_blocks=2)
    return LLM(None, dequantize=True, enable_prefix_cache=False, num_blocks=2)


def build_tiny(directory: str) -> str:
    from tiny import build_tiny_model

    return str(build_tiny_model(Path(directory) / "tiny", "llama", max_position_embeddings=8192,
                                hidden_size=128, num_layers=4))


def system_ids(tok, n: int) -> list[int]:
    ids, i = [], 0
    while len(ids) < n:
        ids += tok.encode(TEXT.format(i=i))
        i += 1
    return ids[:n]


def ttft(engine: LLMEngine, ids: list[int], max_tokens: int = 1):
    """(TTFT s, cached tokens, output) of one request alone."""
    rid = engine.add_request(ids, SamplingParams(max_tokens=max_tokens))
    while True:
        for d in engine.step():
            if d.output is not None and d.request_id == rid:
                return d.output.metrics.ttft, d.output.metrics.cached_tokens, d.output


# -- 1 + 2: one process, then another with the persistent tier ------------------------------
def child(args) -> None:
    """Process 1 (--repeats 0): cold, then warm in memory. Process 2: per fresh engine, from disk then in memory."""
    llm = load(args.tiny_path)
    system = system_ids(llm.tokenizer, args.system_tokens)
    # Process 2's in-memory question is one process 1 never saw: none of its blocks is on disk.
    picked = (QUESTIONS[0], QUESTIONS[2] if args.repeats else QUESTIONS[1])
    questions = [system + llm.tokenizer.encode("\n" + q) for q in picked]
    rows = []
    for _ in range(max(1, args.repeats)):
        engine = LLMEngine(llm.model, llm.tokenizer, llm.info, **ENGINE, persist_prefix_cache=True,
                           prefix_cache_dir=args.dir)
        if args.repeats:
            ttft(engine, llm.tokenizer.encode("Warm-up."), 2)  # first-forward costs out of the figure
        res = {}
        for name, ids in zip(("q1", "q2"), questions):
            t0 = time.perf_counter()
            t, cached, out = ttft(engine, ids)
            res[name] = {"ttft": t, "cached": cached, "token": out.token_ids, "wall": time.perf_counter() - t0}
        res["disk_loaded"] = engine.kv_stats()["disk_loaded_blocks"]
        rows.append(res)
        del engine
        gc.collect()
    print(json.dumps(rows))


def run_child(args, tmp: str, repeats: int) -> list[dict]:
    cmd = [sys.executable, __file__, "--child", "--dir", tmp, "--system-tokens", str(args.system_tokens),
           "--repeats", str(repeats)]
    cmd += ["--tiny-path", args.tiny_path] if args.tiny_path else []
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- hybrid / SSM models: state snapshots -----------------------------------------------------
def build_hybrid(directory: str, name: str) -> str:
    from test_hybrid import HYBRID
    from tiny import build_tiny_model

    return str(build_tiny_model(Path(directory) / name, "llama", max_position_embeddings=8192, **HYBRID[name]))


def hybrid_main(args, path: str) -> None:
    import mlx_lm
    from mlx_lm.generate import generate_step

    model, tok = mlx_lm.load(path)
    system = system_ids(tok, args.system_tokens)
    q = [tok.encode("\n" + x) for x in QUESTIONS[:3]]
    n_out = 8
    print(f"model: tiny random {args.hybrid} (tests/test_hybrid.py), {args.system_tokens}-token system prompt, "
          f"{ENGINE}")
    rows = []
    for rep_ in range(args.repeats):
        engine = LLMEngine(model, tok, None, **ENGINE)
        ttft(engine, tok.encode("Warm-up."), 2)
        r = {}
        for name, ids in (("cold", system + q[0]), ("same", system + q[0]), ("other", system + q[1]),
                          ("third", system + q[2])):
            t, cached, out = ttft(engine, ids, n_out)
            r[name] = (t, cached, out.token_ids, len(ids))
        r["stats"] = engine.kv_stats()
        rows.append(r)
        del engine
    ref = LLMEngine(model, tok, None, **ENGINE, enable_prefix_cache=False)
    for name, ids in (("cold", system + q[0]), ("other", system + q[1]), ("third", system + q[2])):
        _, _, out = ttft(ref, ids, n_out)
        want = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n_out)]
        eos = set(tok.eos_token_ids)
        want = want[: next((i for i, t in enumerate(want) if t in eos), len(want))]
        for r in rows:
            assert r[name][2] == out.token_ids == want, f"{name}: outputs differ"
    assert all(r["same"][2] == r["cold"][2] for r in rows), "the warm repeat differs"
    print("outputs identical: cache on / off / mlx-lm")
    print(f"\nTTFT in s over {args.repeats} fresh engines (cached tokens):")
    for name, what in (("cold", "first request"), ("same", "same prompt again"),
                       ("other", "same system prompt, another question"), ("third", "and a third question")):
        ts = [r[name][0] for r in rows]
        print(f"   {what:40s} {statistics.median(ts):8.4f}  ({rows[0][name][1]} of {rows[0][name][3]})"
              + ("" if name == "cold" else f"   first/this = {statistics.median(r['cold'][0] / r[name][0] for r in rows):5.1f}x"))
    for i, r in enumerate(rows):
        print(f"   engine {i + 1}: " + ", ".join(f"{k} {r[k][0]:.4f}" for k in ("cold", "same", "other", "third")))
    st = rows[0]["stats"]
    print(f"   snapshots: {st['state_snapshots']} kept ({st['state_snapshot_bytes']} B of {st['state_snapshot_capacity']}),"
          f" {st['state_snapshots_taken']} taken, {st['state_snapshot_hits']} hits, {st['prefix_hits_shortened']} shortened")

    chat_system = tok.decode(system_ids(tok, args.chat_system_tokens))
    results = {}
    for name, on in (("cache", True), ("no cache", False)):
        engine = LLMEngine(model, tok, None, **ENGINE, enable_prefix_cache=on)
        ttft(engine, tok.encode("Warm-up."), 2)

        def turn(ids, n, engine=engine):
            t, cached, out = ttft(engine, ids, n)
            return t, cached, out.token_ids

        results[name] = chat(turn, tok, chat_system, args.turns, args.reply_tokens)
        del engine
    print(f"\n{args.turns}-turn chat (system {args.chat_system_tokens} tok, replies <= {args.reply_tokens} tok),"
          " TTFT per turn in s (cached tokens)")
    print("   turn  prompt   macinfer cache        no cache")
    for i in range(args.turns):
        c, n = results["cache"][i], results["no cache"][i]
        print(f"   {i + 1:4d}  {c[1]:6d}   {c[0]:7.4f} ({c[2]:5d})   {n[0]:8.4f}")
    c, n = ([r[0] for r in results[k]] for k in ("cache", "no cache"))
    print(f"   total TTFT no cache / cache = {sum(n) / sum(c):.1f}x; turns 2-{args.turns}: {sum(n[1:]) / sum(c[1:]):.1f}x")


# -- mlx-lm's prompt cache ------------------------------------------------------------------
class MlxLmSession:
    """mlx-lm generate_step over one prompt cache, trimmed to the common prefix each turn."""

    def __init__(self, model, eos: set[int]):
        from mlx_lm.models.cache import make_prompt_cache

        self.model, self.eos = model, eos
        self.cache = make_prompt_cache(model)
        self.tokens: list[int] = []  # what the cache holds

    def generate(self, ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import trim_prompt_cache

        p = 0
        while p < min(len(ids), len(self.tokens)) and ids[p] == self.tokens[p]:
            p += 1
        p = min(p, len(ids) - 1)  # at least one token to get logits from
        trim_prompt_cache(self.cache, self.cache[0].offset - p)
        t0, first, fed = time.perf_counter(), None, []
        for tok, _ in generate_step(mx.array(ids[p:]), self.model, max_tokens=max_tokens,
                                    prompt_cache=self.cache, prefill_step_size=512):
            first = first or time.perf_counter() - t0
            fed.append(int(tok))
            if fed[-1] in self.eos:  # stop like macinfer does (the EOS is not output)
                break
        self.tokens = (ids + fed)[: self.cache[0].offset]
        return first, [t for t in fed if t not in self.eos]


def chat(run_turn, tok, system: str, turns: int, reply_tokens: int) -> list[tuple[float, int, int]]:
    """(TTFT, prompt tokens, cached tokens) per turn; replies are fed back as history."""
    messages = [{"role": "system", "content": system}]
    rows = []
    for q in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": q})
        ids = list(tok.apply_chat_template(messages, add_generation_prompt=True))
        t, cached, out_ids = run_turn(ids, reply_tokens)
        rows.append((t, len(ids), cached))
        messages.append({"role": "assistant", "content": tok.decode(out_ids)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--chat-system-tokens", type=int, default=300)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--reply-tokens", type=int, default=24)
    ap.add_argument("--hybrid", metavar="FAMILY", help="a tiny hybrid / SSM model instead (qwen3_next, lfm2, mamba2, ...)")
    ap.add_argument("--repeats", type=int, default=3, help="fresh engines per TTFT figure (disk vs memory; --hybrid)")
    ap.add_argument("--disk-only", action="store_true", help="scenarios 1 and 2 only (the persistent tier)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--tiny-path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    scratch = tempfile.TemporaryDirectory()
    if args.hybrid:
        return hybrid_main(args, build_hybrid(scratch.name, args.hybrid))
    if args.tiny:  # built once, so both processes see the same model (same identity)
        args.tiny_path = build_tiny(scratch.name)

    from macinfer import _blas

    print(f"model: {'tiny random llama' if args.tiny else 'SmolLM2-135M float32'}, BLAS {_blas.loaded or 'bundled'}")
    # 1 + 2: two processes sharing a persistent tier.
    with tempfile.TemporaryDirectory() as tmp:
        (a,) = run_child(args, tmp, 0)
        bs = run_child(args, tmp, args.repeats)
    cold, warm = a["q1"]["ttft"], a["q2"]["ttft"]
    assert all(b["q1"]["token"] == a["q1"]["token"] for b in bs), "outputs differ"
    print(f"\n1. {args.system_tokens}-token system prompt + question, TTFT")
    print(f"   cold                 {cold:8.3f} s  (cached {a['q1']['cached']})")
    print(f"   warm, in memory      {warm:8.3f} s  (cached {a['q2']['cached']})   cold/warm = {cold / warm:.1f}x")
    print(f"   (request 1 wall incl. saving to disk: {a['q1']['wall']:.2f} s)")
    disk = statistics.median(b["q1"]["ttft"] for b in bs)
    mem = statistics.median(b["q2"]["ttft"] for b in bs)
    ratio = statistics.median(b["q1"]["ttft"] / b["q2"]["ttft"] for b in bs)
    print(f"2. second process, {len(bs)} fresh engines: the same prompt from disk, then a third question from memory")
    print(f"   warm, from disk      {disk:8.3f} s  (cached {bs[0]['q1']['cached']}, {bs[0]['disk_loaded']} blocks loaded)"
          f"   cold/warm = {cold / disk:.1f}x")
    print(f"   warm, in memory      {mem:8.3f} s  (cached {bs[0]['q2']['cached']})   cold/warm = {cold / mem:.1f}x")
    best = min(b["q1"]["ttft"] for b in bs) / min(b["q2"]["ttft"] for b in bs)
    print(f"   disk / in-memory TTFT = {ratio:.2f}x (median of per-engine ratios; criterion <= 2x), best of"
          f" {len(bs)} each {best:.2f}x: " + ", ".join(f"{b['q1']['ttft']:.3f}/{b['q2']['ttft']:.3f}" for b in bs))
    if args.disk_only:
        return

    llm = load(args.tiny_path)
    model, tok = llm.model, llm.tokenizer
    system = system_ids(tok, args.system_tokens)
    q1, q2 = (tok.encode("\n" + q) for q in QUESTIONS[:2])
    eos = set(tok.eos_token_ids)
    s = MlxLmSession(model, eos)
    m_cold, _ = s.generate(system + q1, 1)
    from mlx_lm.models.cache import trim_prompt_cache

    trim_prompt_cache(s.cache, s.cache[0].offset - len(system))
    s.tokens = system
    m_warm, _ = s.generate(system + q2, 1)
    print(f"   mlx-lm prompt cache: cold {m_cold:.3f} s, warm {m_warm:.3f} s, cold/warm = {m_cold / m_warm:.1f}x;"
          f" macinfer warm / mlx-lm warm = {warm / m_warm:.2f}")
    del s

    # 3 + 4: a chat.
    chat_system = tok.decode(system_ids(tok, args.chat_system_tokens))
    results = {}
    for name, on in (("cache", True), ("no cache", False)):
        engine = LLMEngine(model, tok, llm.info, **ENGINE, enable_prefix_cache=on)
        ttft(engine, tok.encode("Warm-up."), 2)  # first-forward costs out of turn 1

        def turn(ids, n, engine=engine):
            t, cached, out = ttft(engine, ids, n)
            return t, cached, out.token_ids

        results[name] = chat(turn, tok, chat_system, args.turns, args.reply_tokens)
        del engine
    session = MlxLmSession(model, eos)

    def mlx_turn(ids, n):
        common = 0
        while common < min(len(session.tokens), len(ids) - 1) and ids[common] == session.tokens[common]:
            common += 1
        t, out = session.generate(ids, n)
        return t, common, out

    results["mlx-lm"] = chat(mlx_turn, tok, chat_system, args.turns, args.reply_tokens)
    print(f"\n3. {args.turns}-turn chat (system {args.chat_system_tokens} tok, replies <= {args.reply_tokens} tok),"
          " TTFT per turn in s (cached tokens)")
    print("   turn  prompt   macinfer cache        no cache   mlx-lm prompt cache")
    for i in range(args.turns):
        c, n, m = results["cache"][i], results["no cache"][i], results["mlx-lm"][i]
        print(f"   {i + 1:4d}  {c[1]:6d}   {c[0]:7.3f} ({c[2]:5d})   {n[0]:8.3f}   {m[0]:7.3f} ({m[2]:5d})")
    c, n, m = ([r[0] for r in results[k]] for k in ("cache", "no cache", "mlx-lm"))
    print(f"   last/first turn: cache {c[-1] / c[0]:.2f}x, no cache {n[-1] / n[0]:.2f}x, mlx-lm {m[-1] / m[0]:.2f}x;"
          f" total TTFT no cache / cache = {sum(n) / sum(c):.1f}x")
    print(f"   warm turns 2-{args.turns}: cache max/min {max(c[1:]) / min(c[1:]):.2f}x,"
          f" mlx-lm {max(m[1:]) / min(m[1:]):.2f}x; no cache last/turn 2 {n[-1] / n[1]:.2f}x")


if __name__ == "__main__":
    main()
