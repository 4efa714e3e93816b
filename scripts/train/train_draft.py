#!/usr/bin/env python
"""Build the shipped draft model for the embedded SmolLM2-135M-Instruct (issue 5).

What it does (every stage is seeded, so a rerun reproduces the data and the draft):

1. ``data``: a few hundred chat prompts are composed from templates x topic pools (questions,
   explanations, instructions, stories, poems, code, lists, emails, comparisons). Each topic
   pool is split once (seeded) into train and held-out topics, so the held-out prompts
   (``heldout_prompts()``, 48 of the same kinds) use topics never trained on. The target
   (float32, dequantised, OpenBLAS) continues each chat-templated prompt greedily for up to
   ``--max-new`` tokens in left-padded batches with a batched KV cache; for training prompts a
   second continuation is sampled at temperature 0.7. At every position the target's top-16
   log-probabilities are stored (the labels), so the draft learns the target's next-token
   distribution on the target's own text. Shards go to ``~/.cache/macinfer/draft-data/``
   (not the repo); finished shards are reused on a rerun.

2. ``train``: the draft is an mlx-lm llama model with ``--layers`` transformer layers initialised
   from those layers of the target (default 0,1,2,29), the target's final norm, and the target's
   embedding as a frozen input embedding. Its lm_head is the target's embedding restricted to
   ``--head-vocab`` tokens (default 8,192: the special and byte tokens, then the tokens most
   frequent in the training continuations, then the lowest ids; see macinfer.spec_decode.draft_model's
   SubsetHead): a full 49,152-row head would cost twice the four layers per draft token. Only the
   layers and the norm train (Adam, cosine decay, float32), on a soft cross-entropy to the
   target's top-16 distribution plus a hard cross-entropy to the target's greedy token, softmax
   over the kept tokens (continuation positions weight 1, prompt positions 0.25). Every ``--eval-every`` steps the exact greedy speculative acceptance
   at k=4 is measured on the held-out prompts (see ``simulate_acceptance``); the best draft so
   far is written to ``--out`` each time it improves, so an interrupted run leaves a usable one.

3. The draft is saved WITHOUT the embedding (it is the target's): ``model.safetensors`` with the
   trained layers (8-bit) + norm (float16) and the kept head token ids, ``config.json`` (llama, num_hidden_layers = layer count,
   target's vocab/hidden/heads, ``macinfer_draft`` block naming the target and the source
   layers), ``README.md``. ``macinfer.draft_model.load_draft`` puts it back together.

Usage:
    python scripts/train/train_draft.py data            # ~10-15 min on the 2-core CPU dev box
    python scripts/train/train_draft.py train --minutes 25
    python scripts/train/train_draft.py all
    python scripts/train/eval_draft.py                  # acceptance on the held-out prompts
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import macinfer  # noqa: F401  (OpenBLAS before mlx)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "models" / "smollm2-135m-draft"
CACHE = Path(os.environ.get("MACINFER_DRAFT_DATA", Path.home() / ".cache" / "macinfer" / "draft-data"))
TOPK = 16
SEED = 1234
SAMPLE_B_SEED = 100_000  # added to the seeds of the second sampled continuation set (train-t07b)

# ----------------------------------------------------------------------------------------------
# Prompts: templates x topic pools. Pools are split (seeded) into train / held-out topics.
# ----------------------------------------------------------------------------------------------

# Templates (with weights) x topic pools, as data: scripts/train/prompts.json.
_PROMPTS = json.loads((Path(__file__).resolve().parent / "prompts.json").read_text())
POOLS = {k: [tuple(x) if isinstance(x, list) else x for x in v] for k, v in _PROMPTS["pools"].items()}  # pairs
TEMPLATES = [tuple(t) for t in _PROMPTS["templates"]]


def _split_pools(heldout_frac: float = 0.18):
    rng = random.Random(SEED)
    train, held = {}, {}
    for name, items in POOLS.items():
        items = list(dict.fromkeys(items)) if name != "lang" else list(items)
        if name == "lang":  # languages are a style knob, not a topic: shared
            train[name] = held[name] = items
            continue
        items = items[:]
        rng.shuffle(items)
        n_held = max(2, int(round(len(items) * heldout_frac)))
        held[name], train[name] = items[:n_held], items[n_held:]
    return train, held


def _compose(pools: dict, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    templates = [t for t, w in TEMPLATES for _ in range(w)]
    out, seen = [], set()
    tries = 0
    while len(out) < n and tries < n * 50:
        tries += 1
        t = rng.choice(templates)
        fill = {k: rng.choice(v) for k, v in pools.items() if k != "pair"}
        a, b = rng.choice(pools["pair"])
        p = t.format(pair0=a, pair1=b, **fill)
        p = p[0].upper() + p[1:]
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def train_prompts(n: int = 480) -> list[str]:
    return _compose(_split_pools()[0], n, SEED + 1)


def heldout_prompts(n: int = 48) -> list[str]:
    return _compose(_split_pools()[1], n, SEED + 2)


# ----------------------------------------------------------------------------------------------
# Stage 1: target continuations + top-k labels
# ----------------------------------------------------------------------------------------------


def load_target():
    from macinfer.modelio.loader import load_model

    model, tokenizer, info = load_model(None, dequantize=True)
    return model, tokenizer, info


def chat_ids(tokenizer, prompt: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True))


def generate_batch(model, prompts_ids: list[list[int]], max_new: int, temp: float, eos: set[int], seed: int,
                   features: bool = False):
    """Left-padded batched continuation; returns per sequence (tokens, n_prompt, topk_idx, topk_lp).

    topk_* hold, for every position j of the returned token list (j < len-1), the target's
    top-K next-token log-probs given tokens[:j+1]; so row j labels token j+1.
    With features, each tuple also ends with the target's final (post-norm) hidden state at
    every position, float16 (n, D): what ``train_eagle.py feats`` would compute, for free.
    """
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import BatchKVCache

    B = len(prompts_ids)
    L = max(len(p) for p in prompts_ids)
    pads = [L - len(p) for p in prompts_ids]
    x = mx.array([[0] * pad + p for pad, p in zip(pads, prompts_ids)])
    cache = [BatchKVCache(left_padding=pads) for _ in model.layers]
    key = mx.random.key(seed)

    def topk(logits):  # logits (B, T, V) -> (idx (B,T,K) int32, lp (B,T,K) float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        idx = mx.argpartition(-lp, TOPK - 1, axis=-1)[..., :TOPK]
        vals = mx.take_along_axis(lp, idx, axis=-1)
        order = mx.argsort(-vals, axis=-1)
        return mx.take_along_axis(idx, order, axis=-1).astype(mx.int32), mx.take_along_axis(vals, order, axis=-1)

    feats: list = []  # with features: the hidden states of every forward, in order
    if features:
        from macinfer.core.lm_head import split_head

        body, head = split_head(model)

        def forward(inp):  # the logits, keeping the hidden states the head read
            h = body(inp, cache=cache)
            feats.append(h.astype(mx.float16))
            return head(h)
    else:
        def forward(inp):
            return model(inp, cache=cache)
    logits = forward(x)
    pi, pl = topk(logits)
    mx.eval(pi, pl, feats)
    pi, pl = np.array(pi), np.array(pl)
    step_i, step_l, toks = [], [], []
    last = logits[:, -1, :]
    done = np.zeros(B, bool)
    for step in range(max_new):
        if temp > 0:
            key, sub = mx.random.split(key)
            nxt = mx.random.categorical(last / temp, key=sub)
        else:
            nxt = mx.argmax(last, axis=-1)
        nxt_np = np.array(nxt)
        toks.append(nxt_np)
        done |= np.isin(nxt_np, list(eos))
        if done.all() or step == max_new - 1:
            break
        logits = forward(nxt[:, None])
        i, l = topk(logits)
        last = logits[:, -1, :]
        mx.eval(i, l, last, feats[-1:])
        step_i.append(np.array(i)[:, 0])
        step_l.append(np.array(l)[:, 0])
    toks = np.stack(toks, 1)  # (B, n)
    gi = np.stack(step_i, 1) if step_i else np.zeros((B, 0, TOPK), np.int32)
    gl = np.stack(step_l, 1) if step_l else np.zeros((B, 0, TOPK), np.float32)
    out = []
    for b in range(B):
        n_p = len(prompts_ids[b])
        gen = toks[b].tolist()
        n_gen = len(gen)
        for j, t in enumerate(gen):
            if t in eos:
                n_gen = j + 1
                break
        seq = prompts_ids[b] + gen[:n_gen]
        # rows: prompt positions 0..n_p-1 (from prefill), then generated positions 0..n_gen-2
        ti = np.concatenate([pi[b, pads[b]:], gi[b, : n_gen - 1]], 0)
        tl = np.concatenate([pl[b, pads[b]:], gl[b, : n_gen - 1]], 0)
        assert ti.shape[0] == len(seq) - 1, (ti.shape, len(seq))
        row = (np.array(seq, np.int32), n_p, ti.astype(np.int32), tl.astype(np.float16))
        if features:  # prefill (left-padded) then one step per generated token; the last is never fed
            f = [np.array(feats[0][b, pads[b]:])] + [np.array(g[b]) for g in feats[1: n_gen]]
            f.append(np.zeros_like(f[0][:1]))  # the last token is never fed (train_eagle never reads its row)
            f = np.concatenate(f, 0)
            assert f.shape[0] == len(seq), (f.shape, len(seq))
            row += (f,)
        out.append(row)
    return out


def cmd_data(args):
    import numpy as np

    CACHE.mkdir(parents=True, exist_ok=True)
    model, tokenizer, _ = load_target()
    eos = set(tokenizer.eos_token_ids)
    jobs = [("heldout", heldout_prompts(), 0.0)]
    jobs.append(("train-greedy", train_prompts(args.n_train), 0.0))
    if args.sampled:
        jobs.append(("train-t07", train_prompts(args.n_train), 0.7))
    if "train-t07b" in args.only.split(","):  # a second temperature-0.7 sample, on other seeds
        jobs.append(("train-t07b", train_prompts(args.n_train), 0.7))
    if args.only:
        jobs = [j for j in jobs if j[0] in args.only.split(",")]
    t0 = time.time()
    ntok = 0
    for name, prompts, temp in jobs:
        starts = list(range(0, len(prompts), args.batch))
        if args.reverse:  # a second worker can fill the list from the other end
            starts = starts[::-1]
        for s in starts:
            shard = CACHE / f"{name}-{args.max_new}-{s:04d}.npz"
            if shard.exists():
                continue
            chunk = prompts[s: s + args.batch]
            ids = [chat_ids(tokenizer, p) for p in chunk]
            seed = SEED + s + (SAMPLE_B_SEED if name.endswith("-t07b") else 0)
            res = generate_batch(model, ids, args.max_new, temp, eos, seed=seed, features=args.features)
            lens = [len(r[0]) for r in res]
            if args.features:  # train_eagle.py's feats file, written first: a shard implies its features
                feats = np.concatenate([r[4] for r in res])
                ftmp = CACHE / f"feats-{shard.stem}.tmp.npy"
                np.save(ftmp, feats)
                os.replace(ftmp, CACHE / f"feats-{shard.stem}.npy")
            tmp = shard.with_suffix(".tmp.npz")
            np.savez(
                tmp,
                tokens=np.concatenate([r[0] for r in res]),
                lens=np.array(lens),
                n_prompt=np.array([r[1] for r in res]),
                topi=np.concatenate([r[2] for r in res]),
                topl=np.concatenate([r[3] for r in res]),
                prompts=np.array(chunk),
            )
            os.replace(tmp, shard)
            ntok += sum(l - r[1] for l, r in zip(lens, res))
            print(f"[data] {shard.name}: {len(chunk)} seqs, {ntok} new tokens so far, "
                  f"{ntok / (time.time() - t0):.1f} tok/s, {time.time() - t0:.0f}s", flush=True)
            if name == "heldout" and s == 0:
                print("  sample:", repr(tokenizer.decode(res[0][0][res[0][1]:].tolist()))[:300], flush=True)
    print(f"[data] done in {time.time() - t0:.0f}s", flush=True)


def load_shards(prefix: str, max_new: int | None = None):
    """-> list of (tokens, n_prompt, topi, topl) from every shard whose name starts with prefix."""
    import numpy as np

    seqs = []
    for f in sorted(CACHE.glob(f"{prefix}*.npz")):
        if ".tmp" in f.name:
            continue
        if max_new is not None and f"-{max_new}-" not in f.name:
            continue
        d = np.load(f)
        lens, n_prompt = d["lens"], d["n_prompt"]
        off_t = off_r = 0
        for n, n_p in zip(lens, n_prompt):
            seqs.append((d["tokens"][off_t: off_t + n], int(n_p), d["topi"][off_r: off_r + n - 1],
                         d["topl"][off_r: off_r + n - 1].astype(np.float32)))
            off_t += n
            off_r += n - 1
    return seqs


# ----------------------------------------------------------------------------------------------
# The draft model
# ----------------------------------------------------------------------------------------------


def draft_config(target_config: dict, layers: list[int], head_vocab: int = 0) -> dict:
    cfg = {k: v for k, v in target_config.items() if k not in ("quantization", "quantization_config")}
    cfg["num_hidden_layers"] = len(layers)
    cfg.pop("layer_types", None)
    cfg["model_type"] = "llama"
    cfg["tie_word_embeddings"] = True
    cfg["torch_dtype"] = "float16"
    cfg["macinfer_draft"] = {
        "target": "smollm2-135m",
        "embedding": "target",  # embed_tokens (and the tied lm_head) come from the target
        "source_layers": layers,
    }
    if head_vocab:
        cfg["macinfer_draft"]["head_vocab"] = head_vocab  # ids in model.safetensors
    return cfg


def choose_head_ids(train_seqs, vocab: int, n: int) -> list[int]:
    """The n tokens the draft can propose: ids < 512 (special and byte tokens), then the most
    frequent tokens of the training continuations, then the lowest remaining ids (BPE ids
    roughly follow merge order, i.e. corpus frequency). Sorted."""
    import numpy as np

    counts = np.zeros(vocab, np.int64)
    for tok, n_p, *_ in train_seqs:
        np.add.at(counts, tok[n_p:], 1)
    keep = list(range(min(512, n)))
    chosen = set(keep)
    for t in np.argsort(-counts, kind="stable"):
        if len(keep) >= n or counts[t] == 0:
            break
        if int(t) not in chosen:
            keep.append(int(t))
            chosen.add(int(t))
    keep += [t for t in range(vocab) if t not in chosen][: n - len(keep)]
    return sorted(keep)


def build_draft(target, target_config: dict, layers: list[int], head_vocab: int = 0):
    """A llama model with `layers` copied from the target, sharing its embedding array."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    cfg = draft_config(target_config, layers, head_vocab)
    model_cls, args_cls = _get_classes(cfg)
    draft = model_cls(args_cls.from_dict(cfg))
    weights = [("model.embed_tokens.weight", target.model.embed_tokens.weight),
               ("model.norm.weight", mx.array(target.model.norm.weight))]
    for new, old in enumerate(layers):
        for k, v in tree_flatten(target.model.layers[old].parameters()):
            weights.append((f"model.layers.{new}.{k}", mx.array(v)))
    draft.load_weights(weights)
    draft.model.embed_tokens.freeze()
    mx.eval(draft.parameters())
    return draft, cfg


def save_draft(draft, cfg: dict, out: Path, meta: dict, head_ids=None) -> int:
    """Write the draft (macinfer.draft_model.save_draft: 8-bit layers, no embedding) and its README."""
    from macinfer.spec_decode.draft_model import save_draft as save

    size = save(draft, cfg, out, head_ids=head_ids)
    (out / "README.md").write_text(readme(cfg, meta))
    return size + (out / "README.md").stat().st_size


def readme(cfg: dict, meta: dict) -> str:
    layers = cfg["macinfer_draft"]["source_layers"]
    acc = meta.get("acceptance", {})
    n_head = cfg["macinfer_draft"].get("head_vocab")
    head = (f"; the head covers only {n_head:,} of the {cfg['vocab_size']:,} tokens (the target's embedding rows "
            "for them: the special and byte tokens and the ones the target emits most), so a draft token "
            "costs the four layers plus a sixth of the full head" if n_head else "")
    ids = " and the head's token ids" if n_head else ""
    by_k = "; by k: " + ", ".join(f"k = {k}: {v:.3f}" for k, v in acc["by_k"].items()) if acc.get("by_k") else ""
    if acc.get("top1") is not None:
        by_k += f"; top-1 agreement with the target {acc['top1']:.3f}"
    return f"""# smollm2-135m-draft

A speculative-decoding draft for the embedded SmolLM2-135M-Instruct (macinfer's default model).

- **What**: an mlx-lm `llama` model with {len(layers)} transformer layers (hidden 576, 9 heads / 3 KV
  heads, MLP 1536) and the target's final norm. It has **no embedding of its own**: the input
  embedding and the lm_head are the target's (so the tokenizer is the target's by
  construction){head}. `model.safetensors` holds only the {meta.get('n_trainable', '?'):,} trained parameters
  (linear weights 8-bit affine, group 64; norms float16){ids}.
  Load it with `macinfer.draft_model.load_draft("smollm2-135m", target_model, target_tokenizer)`
  (casts to float32 on hosts without Metal).
- **How**: `scripts/train/train_draft.py` (seeded, reproducible). Layers initialised from target layers
  {layers}; trained to match the target's next-token distribution (top-{TOPK} soft cross-entropy
  + hard cross-entropy on the target's greedy token) on the target's own chat continuations:
  {meta.get('n_train_seqs', '?')} sequences / {meta.get('n_train_tokens', '?'):,} labelled positions from
  {meta.get('n_train_prompts', '?')} templated chat prompts ({meta.get('continuations', 'greedy')}
  continuations of up to {meta.get('max_new', '?')} tokens, prompt positions down-weighted).
  Adam, lr {meta.get('lr', '?')}, cosine decay, {meta.get('steps', '?')} steps, float32, {meta.get('train_minutes', '?')} min on a 2-core x86 CPU.
- **Measured acceptance** (`python scripts/train/eval_draft.py`): on {acc.get('n_prompts', '?')} held-out chat prompts
  (topics never trained on), greedy decoding, k = 4 drafted tokens per step:
  mean acceptance **{acc.get('acceptance', float('nan')):.3f}** per drafted token,
  **{acc.get('tokens_per_step', float('nan')):.2f}** tokens per target step
  (untrained truncated-layer drafts: 0.02-0.04){by_k}.
"""


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def length_groups(rows: list[int], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Shuffled groups of sequence indices, each padding to about batch_tokens rows
    (rows[i]: sequence i's row count), bucketed by length within windows of 64 for less padding."""
    order = list(range(len(rows)))
    rng.shuffle(order)
    order = sum((sorted(order[i:i + 64], key=lambda j: rows[j]) for i in range(0, len(order), 64)), [])
    groups, cur = [], []
    for j in order:
        cur.append(j)
        if max(rows[i] for i in cur) * len(cur) >= batch_tokens:
            groups.append(cur)
            cur = []
    if cur:
        groups.append(cur)
    rng.shuffle(groups)
    return groups


def make_batches(seqs, batch_tokens: int, rng: random.Random, prompt_weight: float):
    """Pack sequences (sorted-ish by length) into right-padded batches of ~batch_tokens tokens."""
    import numpy as np

    batches = length_groups([len(s[0]) - 1 for s in seqs], batch_tokens, rng)
    out = []
    for b in batches:
        L = max(len(seqs[i][0]) for i in b) - 1
        x = np.zeros((len(b), L), np.int32)
        ti = np.zeros((len(b), L, TOPK), np.int32)
        tl = np.full((len(b), L, TOPK), -1e4, np.float32)
        w = np.zeros((len(b), L), np.float32)
        for r, i in enumerate(b):
            tok, n_p, si, sl = seqs[i]
            n = len(tok) - 1
            x[r, :n] = tok[:-1]
            ti[r, :n] = si
            tl[r, :n] = sl
            w[r, :n] = prompt_weight
            w[r, n_p - 1: n] = 1.0  # rows predicting assistant tokens
        out.append((x, ti, tl, w))
    return out


def simulate_acceptance(correct_rows, k: int = 4):
    """Exact greedy speculative decoding from teacher-forced draft agreement.

    correct_rows: per sequence, a bool array over the continuation positions: whether the
    draft's greedy pick at that position (given the target's tokens before it) equals the
    target's greedy token. Drafting k tokens from position t with a greedy draft accepts the
    longest run of True from t (the draft sees exactly the target's prefix while it is right),
    capped at k; the target then adds one token. Returns (acceptance per drafted token,
    tokens per target step, steps).
    """
    acc = drafted = steps = produced = 0
    for c in correct_rows:
        t, n_pos = 0, len(c)
        while t < n_pos:
            kk = min(k, n_pos - t)
            n = 0
            while n < kk and c[t + n]:
                n += 1
            acc += n
            drafted += kk
            steps += 1
            produced += n + 1 if t + n < n_pos else n
            t += n + 1
    return acc / max(drafted, 1), produced / max(steps, 1), steps


def draft_agreement(draft, seqs, batch: int = 8):
    """Teacher-forced: per sequence, bool array (draft argmax == target greedy) on its continuation."""
    import mlx.core as mx
    import numpy as np

    rows = []
    for s in range(0, len(seqs), batch):
        chunk = seqs[s: s + batch]
        L = max(len(q[0]) for q in chunk) - 1
        x = np.zeros((len(chunk), L), np.int32)
        for r, q in enumerate(chunk):
            x[r, : len(q[0]) - 1] = q[0][:-1]
        h = draft.model(mx.array(x))
        # the head only on continuation positions (it is most of a small draft's cost)
        hs = mx.concatenate([h[r, q[1] - 1: len(q[0]) - 1] for r, q in enumerate(chunk)], 0)
        if getattr(draft.args, "tie_word_embeddings", True):
            logits = draft.model.embed_tokens.as_linear(hs)
        else:
            logits = draft.lm_head(hs)  # a SubsetHead gives full-width logits, -inf off its tokens
        pred = np.array(mx.argmax(logits, axis=-1))
        off = 0
        for tok, n_p, _, _ in chunk:
            n = len(tok) - n_p
            rows.append(pred[off: off + n] == tok[n_p:])
            off += n
    return rows


def evaluate(draft, held, k: int = 4) -> dict:
    rows = draft_agreement(draft, held)
    acc, tps, steps = simulate_acceptance(rows, k)
    top1 = float(sum(r.sum() for r in rows) / max(sum(len(r) for r in rows), 1))
    return {"acceptance": acc, "tokens_per_step": tps, "top1": top1, "k": k, "n_prompts": len(held),
            "target_steps": steps}


def cmd_train(args):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx.utils import tree_flatten

    random.seed(SEED)
    mx.random.seed(SEED)
    model, tokenizer, info = load_target()
    target_config = json.loads((Path(info.path) / "config.json").read_text())
    from macinfer.core.lm_head import SubsetHead
    from macinfer.spec_decode.draft_model import load_draft

    held = load_shards("heldout")
    train = load_shards("train")
    if not train or not held:
        sys.exit("no data: run `python scripts/train/train_draft.py data` first")
    vocab = model.model.embed_tokens.weight.shape[0]
    if args.init:  # continue from a saved draft (its layers and head; 8-bit weights dequantised)
        draft = load_draft(Path(args.init), model, tokenizer)
        draft.model.embed_tokens.freeze()
        saved = json.loads((Path(args.init) / "config.json").read_text())
        layers = saved["macinfer_draft"]["source_layers"]
        head_ids = (np.array(draft.lm_head.ids).tolist() if isinstance(getattr(draft, "lm_head", None), SubsetHead)
                    else list(range(vocab)))
        cfg = draft_config(target_config, layers, len(head_ids) if len(head_ids) < vocab else 0)
    else:
        layers = [int(v) for v in args.layers.split(",")]
        head_ids = choose_head_ids(train, vocab, args.head_vocab) if args.head_vocab else list(range(vocab))
        draft, cfg = build_draft(model, target_config, layers, len(head_ids) if len(head_ids) < vocab else 0)
        draft.args.tie_word_embeddings = False
        draft.lm_head = SubsetHead(draft.model.embed_tokens, mx.array(head_ids), vocab)
    del model
    head_w = draft.lm_head.weight  # (N, D), frozen: the target's embedding rows
    pos_of = np.full(vocab, -1, np.int64)
    pos_of[head_ids] = np.arange(len(head_ids))
    save_ids = head_ids if len(head_ids) < vocab else None
    n_tok = sum(len(t) - 1 for t, *_ in train)
    n_trainable = sum(v.size for _, v in tree_flatten(draft.trainable_parameters()))
    cont = np.concatenate([t[n_p:] for t, n_p, *_ in train])
    print(f"[train] layers {layers}, {n_trainable:,} trainable params, head over {len(head_ids):,} tokens "
          f"({(pos_of[cont] >= 0).mean():.1%} of training continuation tokens); {len(train)} train seqs "
          f"({n_tok:,} positions), {len(held)} held-out", flush=True)
    held = held[: args.eval_prompts]
    base = evaluate(draft, held)
    print(f"[train] before training: {base}", flush=True)

    def loss_fn(m, x, ti, tl, w, hard_ok):
        # Softmax over the head's tokens (what the draft can propose); the target's top-k
        # labels outside them carry no weight (tl = -1e4), the hard label only if it is inside.
        h = m.model(x)
        logits = h @ head_w.T
        lse = mx.logsumexp(logits, axis=-1, keepdims=True)
        lp = mx.take_along_axis(logits, ti, axis=-1) - lse
        p = mx.exp(tl)
        soft = -(p * lp).sum(-1)
        hard = -lp[..., 0] * hard_ok
        per = soft + args.hard_weight * hard
        return (per * w).sum() / w.sum()

    def to_head(ti, tl):
        pos = pos_of[ti]
        missing = pos < 0
        return np.where(missing, 0, pos).astype(np.int32), np.where(missing, -1e4, tl), (~missing[..., 0]).astype(np.float32)
    loss_and_grad = nn.value_and_grad(draft, loss_fn)
    rng = random.Random(SEED)
    batches = make_batches(train, args.batch_tokens, rng, args.prompt_weight)
    est_steps = args.max_steps or 10**9
    sched = optim.join_schedules(
        [optim.linear_schedule(args.lr * 0.1, args.lr, args.warmup),
         optim.cosine_decay(args.lr, args.decay_steps, args.lr * 0.05)], [args.warmup])
    opt = optim.Adam(learning_rate=sched)


    t0 = time.time()
    step = epoch = 0
    best = base["acceptance"]
    meta = {"n_trainable": n_trainable, "n_train_seqs": len(train), "n_train_tokens": n_tok,
            "n_train_prompts": len({tuple(t[:n_p]) for t, n_p, *_ in train}), "lr": args.lr,
            "max_new": args.max_new,
            "continuations": "greedy and temperature-0.7" if any(CACHE.glob("train-t07-*.npz")) else "greedy"}
    out = Path(args.out)
    prior_steps, prior_minutes = 0, 0.0
    if args.init and (Path(args.init) / "train_meta.json").exists():
        prior = json.loads((Path(args.init) / "train_meta.json").read_text())
        prior_steps, prior_minutes = prior.get("steps", 0), prior.get("train_minutes", 0.0)
    run_loss = None
    deadline = t0 + args.minutes * 60
    while time.time() < deadline and step < est_steps:
        for x, ti, tl, w in batches:
            ti_h, tl_h, hard_ok = to_head(ti, tl)
            loss, grads = loss_and_grad(draft, mx.array(x), mx.array(ti_h), mx.array(tl_h), mx.array(w), mx.array(hard_ok))
            opt.update(draft, grads)
            mx.eval(loss, draft.parameters(), opt.state)
            step += 1
            run_loss = float(loss) if run_loss is None else 0.95 * run_loss + 0.05 * float(loss)
            if step % 20 == 0:
                print(f"[train] step {step} epoch {epoch} loss {run_loss:.3f} "
                      f"lr {float(opt.learning_rate):.2e} {time.time() - t0:.0f}s", flush=True)
            if step % args.eval_every == 0 or time.time() >= deadline or step >= est_steps:
                ev = evaluate(draft, held)
                print(f"[eval] step {step}: acceptance {ev['acceptance']:.3f} tokens/step "
                      f"{ev['tokens_per_step']:.2f} top1 {ev['top1']:.3f}", flush=True)
                if ev["acceptance"] > best:
                    best = ev["acceptance"]
                    meta.update(acceptance=ev, steps=prior_steps + step,
                                train_minutes=round(prior_minutes + (time.time() - t0) / 60, 1))
                    size = save_draft(draft, cfg, out, meta, save_ids)
                    (out / "train_meta.json").write_text(json.dumps(meta, indent=2, default=float) + "\n")
                    print(f"[save] {out} ({size / 1e6:.1f} MB), acceptance {best:.3f}", flush=True)
            if time.time() >= deadline or step >= est_steps:
                break
        epoch += 1
        fresh = load_shards("train")  # the data stage may still be adding shards
        if len(fresh) > len(train):
            print(f"[train] {len(fresh) - len(train)} new sequences", flush=True)
            train = fresh
            meta.update(n_train_seqs=len(train), n_train_tokens=sum(len(t) - 1 for t, *_ in train),
                        n_train_prompts=len({tuple(t[:n_p]) for t, n_p, *_ in train}))
        batches = make_batches(train, args.batch_tokens, rng, args.prompt_weight)
    print(f"[train] done: {step} steps, {epoch} epochs, {time.time() - t0:.0f}s, best acceptance {best:.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["data", "train", "all", "prompts"])
    ap.add_argument("--n-train", type=int, default=480, help="training prompts")
    ap.add_argument("--max-new", type=int, default=96, help="continuation length")
    ap.add_argument("--batch", type=int, default=24, help="generation batch")
    ap.add_argument("--only", default="",
                    help="comma list of data jobs: heldout,train-greedy,train-t07, or train-t07b (only when named: "
                         "a second temperature-0.7 continuation of each prompt, other seeds)")
    ap.add_argument("--reverse", action="store_true", help="generate batches last-first")
    ap.add_argument("--features", action="store_true",
                    help="data: also store the target's hidden states (train_eagle.py's feats stage, for free)")
    ap.add_argument("--no-sampled", dest="sampled", action="store_false",
                    help="skip the temperature-0.7 continuations")
    ap.add_argument("--layers", default="0,1,2,29", help="target layers the draft starts from")
    ap.add_argument("--init", default="", help="continue training a saved draft directory")
    ap.add_argument("--minutes", type=float, default=25.0)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--decay-steps", type=int, default=1200)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--batch-tokens", type=int, default=512)
    ap.add_argument("--hard-weight", type=float, default=0.5)
    ap.add_argument("--prompt-weight", type=float, default=0.25)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts scored during training")
    ap.add_argument("--head-vocab", type=int, default=8192,
                    help="tokens the draft's head covers (0: the whole vocabulary)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args()
    if args.stage == "prompts":
        tr, he = train_prompts(args.n_train), heldout_prompts()
        print(f"{len(tr)} train, {len(he)} held-out, overlap {len(set(tr) & set(he))}")
        for p in he:
            print("  H:", p)
        for p in tr[:20]:
            print("  T:", p)
        return
    if args.stage in ("data", "all"):
        cmd_data(args)
    if args.stage in ("train", "all"):
        cmd_train(args)


if __name__ == "__main__":
    main()
