"""Which grammar engine costs less per decode step: llguidance or xgrammar, one run.

The workload is what the engine does for structured output at batch 16: each step,
compute the next-token bitmask of 16 matchers (one per request) and advance each by the
token it sampled. The vocabulary is Qwen-sized: the embedded SmolLM2's byte-level BPE
(49,152 tokens) grown to 151,643 tokens by merges of pairs of its own tokens (a valid BPE:
every new token is a merge of two existing ones), with logits 151,936 wide as Qwen2's.
No tokenizer of that size is available offline; this one has the same shape of trie.

The 16 requests follow one JSON schema (strings, an enum, bounded integers, an array of
objects) and replay 16 different documents valid under it, tokenized by that tokenizer.
The engines run interleaved step by step (order alternating), so both see the same load
on a shared machine. Reported per engine: one-time tokenizer set-up, grammar compile per
request, and the median per-step cost of masks for the batch + advancing it (ms, wall and
CPU), and their ratio.

xgrammar imports torch at start-up (on Linux the PyPI torch pulls the CUDA libraries:
gigabytes), so it is measured only where it is importable; run this script with
`--engine both` from an environment that has it, e.g. a venv with
`pip install xgrammar llguidance` beside macinfer's (`--system-site-packages`).

Usage:
    python scripts/bench/grammar_engines.py                  # llguidance only
    /tmp/venv/bin/python scripts/bench/grammar_engines.py --engine both
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

VOCAB = 151_643   # Qwen2's regular tokens
LOGITS = 151_936  # Qwen2's logits width (padded)
BATCH = 16

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "city": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "friends": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "score": {"type": "number"}}, "required": ["name", "score"],
            "additionalProperties": False}},
    },
    "required": ["name", "city", "age", "role", "tags", "friends"],
    "additionalProperties": False,
}


def big_tokenizer(seed: int = 0):
    """SmolLM2's tokenizer grown to VOCAB tokens by pair merges: a transformers fast tokenizer."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from macinfer.modelio.embedded import embedded_gguf_path, ensure_converted

    path = ensure_converted(embedded_gguf_path())
    spec = json.loads((path / "tokenizer.json").read_text())
    model = spec["model"]
    vocab, merges = model["vocab"], model["merges"]
    pieces = [t for t in vocab if len(t) > 1]
    rng = random.Random(seed)
    next_id = max(vocab.values()) + 1
    for a in spec.get("added_tokens", []):
        next_id = max(next_id, a["id"] + 1)
    while len(vocab) < VOCAB:
        a, b = rng.choice(pieces), rng.choice(pieces)
        if a + b in vocab or len(a + b) > 24:
            continue
        vocab[a + b] = next_id
        merges.append([a, b] if isinstance(merges[0], list) else f"{a} {b}")
        next_id += 1
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


def documents(n: int) -> list[str]:
    """n JSON documents valid under SCHEMA, with escapes and non-ASCII text (none in "name": see below)."""
    rng = random.Random(1)
    plain = "alpha beta gamma delta Paris London Tokyo résumé 東京 naïve x y z".split()
    words = plain + ['quote"', "tab\t", "back\\slash"]
    out = []
    for _ in range(n):
        # NOTE: xgrammar 0.2.9 rejects any escape (\\, \", \t) in a string with maxLength, so "name" has none.
        doc = {"name": " ".join(rng.choices(plain, k=3))[:40], "city": rng.choice(words),
               "age": rng.randint(0, 150), "role": rng.choice(["admin", "user", "guest"]),
               "tags": rng.choices(words, k=rng.randint(0, 5)),
               "friends": [{"name": rng.choice(words), "score": round(rng.uniform(-100, 100), 3)}
                           for _ in range(rng.randint(1, 4))]}
        out.append(json.dumps(doc, ensure_ascii=False))
    return out


def llguidance_steps(hf, docs_ids: list[list[int]], parallel: bool = True):
    """((set-up s wall, s CPU), compile ms per request, step(t): the batch's masks, then advance it).

    parallel: masks computed by llguidance's thread pool (LLExecutor), else one after the other
    in the calling thread.
    """
    import llguidance
    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask, fill_next_token_bitmask_par

    t0, c0 = time.perf_counter(), time.process_time()
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=LOGITS)
    setup = (time.perf_counter() - t0, time.process_time() - c0)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    t0 = time.perf_counter()
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(BATCH)]
    compile_ms = 1e3 * (time.perf_counter() - t0) / BATCH
    executor = llguidance.LLExecutor()
    mask = allocate_token_bitmask(BATCH, LOGITS)

    def step(t: int) -> None:
        live = [(m, i) for i, m in enumerate(matchers) if t < len(docs_ids[i])]
        if parallel:
            fill_next_token_bitmask_par(executor, live, mask)
        else:
            for m, i in live:
                fill_next_token_bitmask(m, mask, i)
        for m, i in live:
            assert _allowed(mask[i], docs_ids[i][t]), "llguidance masked out the document's token"
            assert m.consume_token(docs_ids[i][t]), m.get_error()

    return setup, compile_ms, step


def xgrammar_steps(hf, docs_ids: list[list[int]]):
    """As llguidance_steps, with xgrammar's BatchGrammarMatcher."""
    import xgrammar as xgr

    t0, c0 = time.perf_counter(), time.process_time()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=LOGITS)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = (time.perf_counter() - t0, time.process_time() - c0)
    t0 = time.perf_counter()
    compiled = [compiler.compile_json_schema(json.dumps(SCHEMA)) for _ in range(BATCH)]
    compile_ms = 1e3 * (time.perf_counter() - t0) / BATCH
    matchers = [xgr.GrammarMatcher(c) for c in compiled]
    mask = xgr.allocate_token_bitmask(BATCH, LOGITS)
    batch = xgr.BatchGrammarMatcher()

    def step(t: int) -> None:
        live = [i for i in range(BATCH) if t < len(docs_ids[i])]
        batch.batch_fill_next_token_bitmask([matchers[i] for i in live], mask, live)
        for i in live:
            assert _allowed(mask[i].numpy(), docs_ids[i][t]), "xgrammar masked out the document's token"
            assert matchers[i].accept_token(docs_ids[i][t])

    return setup, compile_ms, step


def _allowed(row: np.ndarray, tok: int) -> bool:
    return bool((int(row[tok // 32]) >> (tok % 32)) & 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=["llguidance", "xgrammar", "both"], default="llguidance",
                    help="llguidance runs twice: its thread pool, and one thread ('llguidance-1')")
    args = ap.parse_args()
    hf = big_tokenizer()
    docs_ids = [hf.encode(d, add_special_tokens=False) + [hf.eos_token_id] for d in documents(BATCH)]
    print(f"vocabulary {len(hf)} tokens, logits {LOGITS} wide; batch {BATCH}; "
          f"documents of {min(map(len, docs_ids))}-{max(map(len, docs_ids))} tokens (EOS included)")
    names = {"both": ["llguidance", "llguidance-1", "xgrammar"], "llguidance": ["llguidance", "llguidance-1"],
             "xgrammar": ["xgrammar"]}[args.engine]
    makers = {"llguidance": llguidance_steps, "xgrammar": xgrammar_steps,
              "llguidance-1": lambda hf, ids: llguidance_steps(hf, ids, parallel=False)}
    engines = {n: makers[n](hf, docs_ids) for n in names}
    wall, cpu = {n: [] for n in names}, {n: [] for n in names}
    for t in range(max(map(len, docs_ids))):
        for n in names if t % 2 else names[::-1]:  # interleaved, order alternating: the same machine load
            t0, c0 = time.perf_counter(), time.process_time()
            engines[n][2](t)
            wall[n].append(time.perf_counter() - t0)
            cpu[n].append(time.process_time() - c0)
    for n in names:
        (sw, sc), compile_ms, _ = engines[n]
        w, c = wall[n][1:], cpu[n][1:]  # the first step warms caches
        print(f"{n:12s}  tokenizer set-up {sw:.2f} s ({sc:.2f} s CPU), compile {compile_ms:.1f} ms/request; "
              f"a step (masks for {BATCH} + advance): median {1e3 * statistics.median(w):.2f} ms wall, "
              f"{1e3 * statistics.median(c):.2f} ms CPU; mean {1e3 * statistics.mean(w):.2f} ms wall; {len(w)} steps")
    for n in names[1:]:
        for what, d in (("wall", wall), ("CPU", cpu)):
            a, b = (statistics.median(d[m][1:]) for m in (names[0], n))
            print(f"median step {what} time, {n} / {names[0]}: {b / a:.2f}x")


if __name__ == "__main__":
    main()
