#!/usr/bin/env python
"""Build the shipped feature draft (EAGLE-style) for the embedded SmolLM2-135M-Instruct (issue 5).

A token-only draft (``train_draft.py``) plateaued at 0.33 acceptance: four small layers cannot
guess what 30 layers will say. A feature draft is handed what the target already computed: the
target's last hidden state f_t (the vector its lm_head reads) at every verified position. Its
input at position t is ``fc([embed(token_{t+1}), f_t])``; one llama decoder layer and the final
norm turn it into f^_{t+1}, the guess of the target's next hidden state; the target's own
(tied, frozen) embedding rows read the token t+2 off it. Drafting further feeds f^ back in place
of f (macinfer.feature_drafter). See Li et al., "EAGLE: Speculative Sampling Requires Rethinking
Feature Uncertainty" (2024).

Stages (seeded; data from ``train_draft.py data``, cached in ``~/.cache/macinfer/draft-data``):

1. ``feats``: the target (float32, OpenBLAS) runs once over every cached sequence (prompt and
   its greedy continuation) and its final hidden states are stored, float16, next to the shards
   (``feats-<shard>.npy``; ~90 MB for the 77k positions; ~10 min on the 2-core dev box).
   ``train_draft.py data --features`` stores them while generating, with no extra pass.
2. ``train``: the draft's layer starts as a copy of the target's last layer, its norm as the
   target's final norm, ``fc`` as [0, I] (i.e. "pass the feature on"). Loss per position: soft
   cross-entropy to the target's stored top-16 next-token distribution plus a hard one to its
   greedy token (softmax over the ``--head-vocab`` kept tokens, as the token draft does), plus
   a smooth-L1 regression of f^ onto the target's real next feature. A second pass feeds the
   first pass's f^ back in as the feature (what drafting the 2nd..kth token does) and is trained
   the same way, so chains do not fall apart after one token.
3. Held-out acceptance is measured by real greedy chains (``chain_acceptance``): draft k tokens
   from every verified position with the draft's own KV cache and features, compare with the
   target's greedy continuation, accept the agreeing prefix; exactly what decoding does.
4. ``engine``: the acceptance users see: the held-out prompts through LLMEngine with a draft
   option (chains cut by confidence, adaptive k, n-gram lookup for "auto"), per kind of draft.

Usage:
    python scripts/train/train_eagle.py feats
    python scripts/train/train_eagle.py train --minutes 30
    python scripts/train/train_eagle.py eval --draft models/smollm2-135m-eagle
    python scripts/train/train_eagle.py engine --engine smollm2-135m,auto   # acceptance as deployed
    python scripts/train/train_eagle.py head --head-vocab 4096   # narrow the shipped draft's head
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import macinfer  # noqa: F401  (OpenBLAS before mlx)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_draft as td  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "models" / "smollm2-135m-eagle"
SEED = 1234


# ----------------------------------------------------------------------------------------------
# Stage 1: the target's features
# ----------------------------------------------------------------------------------------------


def shard_files(prefix: str):
    return [f for f in sorted(td.CACHE.glob(f"{prefix}*.npz")) if ".tmp" not in f.name]


def feats_path(shard: Path) -> Path:
    return shard.with_name("feats-" + shard.stem + ".npy")


def target_features(model, seqs: list, batch: int = 8):
    """Post-norm final hidden states (what the lm_head reads) for each token list: [(n, D) float16]."""
    import mlx.core as mx
    import numpy as np

    out = []
    for s in range(0, len(seqs), batch):
        chunk = seqs[s: s + batch]
        L = max(len(t) for t in chunk)
        x = np.zeros((len(chunk), L), np.int32)
        for r, t in enumerate(chunk):
            x[r, : len(t)] = t  # right padding: causal attention never looks at it
        h = model.model(mx.array(x)).astype(mx.float16)
        h = np.array(h)
        out += [h[r, : len(t)] for r, t in enumerate(chunk)]
    return out


def cmd_feats(args):
    import os

    import numpy as np

    model, _, _ = td.load_target()
    files = shard_files("heldout") + shard_files("train")
    todo = [f for f in files if not feats_path(f).exists()]
    print(f"[feats] {len(files)} shards, {len(todo)} to compute", flush=True)
    t0 = time.time()
    for i, f in enumerate(todo):
        d = np.load(f)
        toks, offs = d["tokens"], np.concatenate([[0], np.cumsum(d["lens"])])
        seqs = [toks[offs[j]: offs[j + 1]] for j in range(len(d["lens"]))]
        feats = np.concatenate(target_features(model, seqs))
        tmp = feats_path(f).with_suffix(".tmp.npy")
        np.save(tmp, feats)
        os.replace(tmp, feats_path(f))
        print(f"[feats] {i + 1}/{len(todo)} {f.name}: {len(toks)} positions, {time.time() - t0:.0f}s", flush=True)


def load_with_feats(prefix: str):
    """[(tokens, n_prompt, topi, topl, feats (n, D) float16)] for the shards that have features."""
    import numpy as np

    out = []
    for f in shard_files(prefix):
        fp = feats_path(f)
        if not fp.exists():
            continue
        d, F = np.load(f), np.load(fp)
        off_t = off_r = 0
        for n, n_p in zip(d["lens"], d["n_prompt"]):
            out.append((d["tokens"][off_t: off_t + n], int(n_p), d["topi"][off_r: off_r + n - 1],
                        d["topl"][off_r: off_r + n - 1].astype(np.float32), F[off_t: off_t + n]))
            off_t += n
            off_r += n - 1
    return out


# ----------------------------------------------------------------------------------------------
# Stage 2: the draft
# ----------------------------------------------------------------------------------------------


def build_draft(target, target_config: dict, head_ids: list[int], init_layer: int):
    """A FeatureDraft: the target's layer `init_layer` and final norm, fc = [0, I], the target's embedding."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from macinfer.core.lm_head import SubsetHead
    from macinfer.spec_decode.feature_draft import FeatureDraft, feature_draft_config

    cfg = feature_draft_config(target_config, len(head_ids), source_layer=init_layer)
    draft = FeatureDraft(llama.ModelArgs.from_dict(cfg))
    D = cfg["hidden_size"]
    weights = [("fc.weight", mx.concatenate([mx.zeros((D, D)), mx.eye(D)], axis=1)),
               ("model.norm.weight", mx.array(target.model.norm.weight))]
    weights += [(f"model.layers.0.{k}", mx.array(v)) for k, v in tree_flatten(target.model.layers[init_layer].parameters())]
    draft.load_weights(weights, strict=False)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.embed_tokens.freeze()
    draft.head = SubsetHead(target.model.embed_tokens, mx.array(head_ids), target.model.embed_tokens.weight.shape[0])
    mx.eval(draft.parameters(), draft.head.weight)
    return draft, cfg


def make_batches(seqs, batch_tokens: int, rng: random.Random, prompt_weight: float):
    """Right-padded batches of rows t = 0 .. n-3 of each sequence:

    token t+1, feature f_t -> labels of position t+1 (token t+2), feature target f_{t+1}.
    """
    import numpy as np

    groups = td.length_groups([len(s[0]) - 2 for s in seqs], batch_tokens, rng)
    out = []
    for b in groups:
        L = max(len(seqs[i][0]) for i in b) - 2
        D = seqs[b[0]][4].shape[1]
        x = np.zeros((len(b), L), np.int32)
        f = np.zeros((len(b), L, D), np.float16)
        fy = np.zeros((len(b), L, D), np.float16)
        ti = np.zeros((len(b), L, td.TOPK), np.int32)
        tl = np.full((len(b), L, td.TOPK), -1e4, np.float32)
        w = np.zeros((len(b), L), np.float32)
        for r, i in enumerate(b):
            tok, n_p, si, sl, F = seqs[i]
            n = len(tok) - 2
            x[r, :n] = tok[1:-1]
            f[r, :n] = F[:-2]
            fy[r, :n] = F[1:-1]
            ti[r, :n] = si[1:]
            tl[r, :n] = sl[1:]
            w[r, :n] = prompt_weight
            w[r, max(n_p - 2, 0): n] = 1.0  # rows whose label is an assistant token
        out.append((x, f, fy, ti, tl, w))
    return out


def chain_acceptance(draft, seqs, k: int, max_seqs: int | None = None) -> dict:
    """Real greedy drafting from every verified position (see module docstring, stage 3)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import KVCache

    acc = drafted = steps = produced = 0
    for tok, n_p, _, _, F in seqs[:max_seqs]:
        cache = [KVCache()]
        Fm = mx.array(F.astype(np.float32))
        n = len(tok)
        p, fed = n_p, 0  # tokens up to p are known; the draft holds rows < fed (true features)
        while p < n - 1:
            f = draft(mx.array(tok[None, fed + 1: p + 1]), Fm[None, fed:p], cache=cache)[:, -1:]
            fed = p
            kk = min(k, n - 1 - p)
            a = 0
            for i in range(kk):
                d = int(mx.argmax(draft.head(f[0, -1])))
                if d != int(tok[p + 1 + i]):
                    break
                a += 1
                if i < kk - 1:
                    f = draft(mx.array([[d]]), f, cache=cache)
            cache[0].trim(cache[0].offset - fed)
            acc += a
            drafted += kk
            steps += 1
            produced += a + 1 if p + 1 + a < n else a
            p += a + 1
    return {"k": k, "acceptance": acc / max(drafted, 1), "tokens_per_step": produced / max(steps, 1), "steps": steps}


def top1(draft, seqs, batch: int = 8) -> float:
    """Teacher-forced agreement on continuation tokens (= acceptance at k = 1)."""
    import mlx.core as mx
    import numpy as np

    hit = tot = 0
    for s in range(0, len(seqs), batch):
        chunk = seqs[s: s + batch]
        for x, f, _, ti, _, w in make_batches(chunk, 10**9, random.Random(0), 0.0):
            pred = np.array(mx.argmax(draft.head(draft(mx.array(x), mx.array(f.astype(np.float32)))), axis=-1))
            m = w > 0
            hit += int(((pred == ti[..., 0]) & m).sum())
            tot += int(m.sum())
    return hit / max(tot, 1)


def cmd_train(args):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx.utils import tree_flatten

    from macinfer.spec_decode.draft_model import save_draft

    random.seed(SEED)
    mx.random.seed(SEED)
    model, _, info = td.load_target()
    target_config = json.loads((Path(info.path) / "config.json").read_text())
    held = load_with_feats("heldout")
    train = load_with_feats("train")
    if not train or not held:
        sys.exit("no features: run `python scripts/train/train_draft.py data` then `python scripts/train/train_eagle.py feats`")
    vocab = model.model.embed_tokens.weight.shape[0]
    head_ids = td.choose_head_ids([t[:4] for t in train], vocab, args.head_vocab)
    draft, cfg = build_draft(model, target_config, head_ids, args.init_layer)
    if args.init:  # continue from a saved draft: its weights and its head's tokens
        from macinfer.spec_decode.feature_draft import load_feature_draft

        saved = load_feature_draft(Path(args.init), model)
        head_ids = np.array(saved.head.ids).tolist()
        draft, cfg = build_draft(model, target_config, head_ids, args.init_layer)
        draft.update(saved.trainable_parameters())
        mx.eval(draft.parameters())
    head_w = draft.head.weight
    pos_of = np.full(vocab, -1, np.int64)
    pos_of[head_ids] = np.arange(len(head_ids))
    n_trainable = sum(v.size for _, v in tree_flatten(draft.trainable_parameters()))
    print(f"[train] {n_trainable:,} trainable params, head over {len(head_ids):,} tokens, {len(train)} train seqs "
          f"({sum(len(t[0]) - 2 for t in train):,} rows), {len(held)} held-out", flush=True)
    held_eval = held[: args.eval_prompts]
    print(f"[eval] before: top1 {top1(draft, held_eval):.3f}", flush=True)

    def to_head(ti, tl):
        pos = pos_of[ti]
        missing = pos < 0
        return (np.where(missing, 0, pos).astype(np.int32), np.where(missing, -1e4, tl).astype(np.float32),
                (~missing[..., 0]).astype(np.float32))

    def ce(fhat, ti, tl, hard_ok):
        logits = fhat @ head_w.T
        lp = mx.take_along_axis(logits, ti, axis=-1) - mx.logsumexp(logits, axis=-1, keepdims=True)
        soft = -(mx.exp(tl) * lp).sum(-1)
        return soft + args.hard_weight * (-lp[..., 0] * hard_ok)

    def loss_fn(m, x, f, fy, ti, tl, w, hard_ok):
        fhat = m(x, f)
        per = ce(fhat, ti, tl, hard_ok)
        reg = nn.losses.smooth_l1_loss(fhat, fy, reduction="none").mean(-1)
        # Second pass: each row gets the previous row's guess instead of the real feature.
        f2 = mx.concatenate([f[:, :1], fhat[:, :-1]], axis=1)
        per2 = ce(m(x, f2), ti, tl, hard_ok)
        tot = per + args.reg_weight * reg + args.chain_weight * per2
        return (tot * w).sum() / w.sum(), (per * w).sum() / w.sum(), (per2 * w).sum() / w.sum()

    loss_and_grad = nn.value_and_grad(draft, lambda *a: loss_fn(*a)[0])
    rng = random.Random(SEED)
    sched = optim.join_schedules(
        [optim.linear_schedule(args.lr * 0.1, args.lr, args.warmup),
         optim.cosine_decay(args.lr, args.decay_steps, args.lr * 0.05)], [args.warmup])
    opt = optim.Adam(learning_rate=sched)
    out = Path(args.out)
    meta = {"n_trainable": n_trainable, "n_train_seqs": len(train), "lr": args.lr, "init_layer": args.init_layer}
    t0, step, epoch, best, run_loss = time.time(), 0, 0, -1.0, None
    deadline = t0 + args.minutes * 60
    while time.time() < deadline and step < args.max_steps:
        for x, f, fy, ti, tl, w in make_batches(train, args.batch_tokens, rng, args.prompt_weight):
            ti_h, tl_h, ok = to_head(ti, tl)
            loss, grads = loss_and_grad(draft, mx.array(x), mx.array(f.astype(np.float32)),
                                        mx.array(fy.astype(np.float32)), mx.array(ti_h), mx.array(tl_h),
                                        mx.array(w), mx.array(ok))
            opt.update(draft, grads)
            mx.eval(loss, draft.parameters(), opt.state)
            step += 1
            run_loss = float(loss) if run_loss is None else 0.95 * run_loss + 0.05 * float(loss)
            if step % 20 == 0:
                print(f"[train] step {step} epoch {epoch} loss {run_loss:.3f} lr {float(opt.learning_rate):.2e} "
                      f"{time.time() - t0:.0f}s", flush=True)
            last = time.time() >= deadline or step >= args.max_steps
            if step % args.eval_every == 0 or last:
                t1 = top1(draft, held_eval)
                ch = chain_acceptance(draft, held_eval, 3, max_seqs=8)
                print(f"[eval] step {step}: top1 {t1:.3f}, k=3 chains on 8: acceptance {ch['acceptance']:.3f} "
                      f"tokens/step {ch['tokens_per_step']:.2f}", flush=True)
                if t1 > best:
                    best = t1
                    meta.update(top1=t1, chain_k3=ch, steps=step, train_minutes=round((time.time() - t0) / 60, 1))
                    size = save_draft(draft, cfg, out, head_ids=head_ids)
                    (out / "train_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
                    print(f"[save] {out} ({size / 1e6:.1f} MB), top1 {best:.3f}", flush=True)
            if last:
                break
        epoch += 1
        fresh = load_with_feats("train")  # the feats stage may still be adding shards
        if len(fresh) > len(train):
            print(f"[train] {len(fresh) - len(train)} new sequences", flush=True)
            train = fresh
            meta["n_train_seqs"] = len(train)
    print(f"[train] done: {step} steps, {epoch} epochs, {time.time() - t0:.0f}s, best top1 {best:.3f}")


def readme(cfg: dict, meta: dict, ev: dict | None = None) -> str:
    """The shipped draft's README.md: what it is, how it was made, what it measured."""
    chains = ""
    if ev:
        chains = ("\n- **Measured** (`python scripts/train/train_eagle.py eval`, 48 held-out chat prompts, topics never "
                  f"trained on, greedy): top-1 agreement with the target **{ev['top1']:.3f}** (= acceptance at k = 1); "
                  "real chains of k drafts from every verified position, the draft feeding back its own "
                  "features: " + ", ".join(f"k = {r['k']}: {r['acceptance']:.3f} per drafted token, "
                                          f"{r['tokens_per_step']:.2f} tokens per target step" for r in ev["chains"])
                  + ". Its confidence is calibrated: " + ", ".join(
                      f"where it is at least {c:.1f} sure ({share:.0%} of tokens) it is right {acc:.0%} of the time"
                      for c, share, acc in ev["calibration"]) + "; the engine cuts chains there "
                  "(`FeatureDrafter.min_joint`).")
    narrowed = (f" Trained with {meta['head_narrowed'][0]:,} kept tokens, then narrowed to the {meta['head_narrowed'][1]:,} "
                "the target generates most often (`train_eagle.py head`): a draft round reads half the head rows, "
                "and the dropped tokens almost never won." + (" The last run trained the narrowed draft further."
                                                              if meta.get("trained_narrow") else "")
                if meta.get("head_narrowed") else "")
    return f"""# smollm2-135m-eagle

The default speculative-decoding draft for the embedded SmolLM2-135M-Instruct: a **feature draft**
(EAGLE-style, `macinfer/feature_draft.py`) that reads the target's own final hidden states.

- **What**: `fc` (2 x 576 -> 576) over [the next token's embedding, the target's hidden state], one
  llama decoder layer (9 heads / 3 KV heads, MLP 1536) and a final norm; it predicts the target's next
  hidden state, and the target's tied embedding rows for {cfg['macinfer_draft']['head_vocab']:,} kept tokens read the token off it.
  No embedding of its own (`"embedding": "target"`). `model.safetensors` holds {meta['n_trainable']:,} parameters
  (linear weights 8-bit affine, group 64; norms float16) and the head's token ids; loaded in float32.
  Load it with `macinfer.draft_model.load_draft("smollm2-135m", target_model, target_tokenizer)`;
  the engine feeds it through `macinfer.feature_draft.FeatureDrafter`. mlx-lm cannot run it (its
  speculative decoding hands a draft tokens, not hidden states).
- **How**: `scripts/train/train_eagle.py` (seeded). Data: the target's own chat continuations of
  `scripts/train/train_draft.py data` ({meta['n_train_seqs']} sequences{'; ' + meta['data'] if meta.get('data') else ''}), and the target's hidden state at every position
  (`train_eagle.py feats`, or stored while generating: `train_draft.py data --features`). Layer initialised from target layer {meta['init_layer']}, norm from the target's
  final norm, fc = [0, I]. Loss: soft cross-entropy to the target's top-16 next-token distribution +
  hard cross-entropy to its greedy token + smooth-L1 to its real next hidden state, on a first pass
  with real features and a second pass fed the first pass's guesses. Adam, lr {meta['lr']}, cosine decay,
  {meta.get('steps', '?')} steps, {meta.get('train_minutes', '?')} min on a 2-core x86 CPU.{narrowed}{chains}
"""


def cmd_eval(args):
    from macinfer.spec_decode.feature_draft import load_feature_draft

    model, _, _ = td.load_target()
    draft = load_feature_draft(Path(args.draft), model)
    held = load_with_feats("heldout")[: args.eval_prompts]
    ev = {"top1": top1(draft, held), "chains": [], "calibration": calibration(draft, held)}
    print(f"{len(held)} held-out prompts: top-1 agreement {ev['top1']:.3f}", flush=True)
    for c, share, acc in ev["calibration"]:
        print(f"  draft confidence >= {c:.1f}: {share:.0%} of tokens, {acc:.3f} right", flush=True)
    for k in (1, 2, 3, 4):
        r = chain_acceptance(draft, held, k)
        ev["chains"].append(r)
        print(f"k={k}: acceptance {r['acceptance']:.3f} per drafted token, {r['tokens_per_step']:.2f} tokens per "
              f"target step", flush=True)
    meta_path = Path(args.draft) / "train_meta.json"
    if args.write_readme and meta_path.exists():
        cfg = json.loads((Path(args.draft) / "config.json").read_text())
        (Path(args.draft) / "README.md").write_text(readme(cfg, json.loads(meta_path.read_text()), ev))
        print(f"wrote {Path(args.draft) / 'README.md'}")


def narrow_head(ids: list[int], train_seqs, n: int) -> list[int]:
    """The n of a head's kept ids the target generates most often in the training continuations
    (ties: lower id first), sorted."""
    import numpy as np

    counts = {}
    for tok, n_p, *_ in train_seqs:
        for t, c in zip(*np.unique(tok[n_p:], return_counts=True)):
            counts[int(t)] = counts.get(int(t), 0) + int(c)
    return sorted(sorted(ids, key=lambda t: (-counts.get(t, 0), t))[:n])


def cmd_head(args):
    """Narrow a draft's head to --head-vocab of its kept tokens, rewriting only its head ids.

    Each draft round reads the head's rows (8,192 x 576 float32 = 19 MB, half of what a round
    reads); the rarest half of them barely ever wins: on the held-out prompts, top-1 agreement was
    0.4395 with 8,192 rows and 0.4388 with the 4,096 most frequent (3,072: 0.4372; 2,048: 0.4327).
    """
    import os

    import mlx.core as mx
    import numpy as np

    from macinfer.spec_decode.feature_draft import is_feature_draft

    path = Path(args.draft)
    if not is_feature_draft(path):
        sys.exit(f"error: {path} is not a feature draft directory (config.json with macinfer_draft.kind = \"feature\")")
    weights = mx.load(str(path / "model.safetensors"))
    if "macinfer.head_ids" not in weights:
        sys.exit(f"error: {path} has a full-vocabulary head: nothing to narrow")
    ids = np.array(weights["macinfer.head_ids"]).tolist()
    if not 0 < args.head_vocab < len(ids):
        sys.exit(f"error: --head-vocab must be between 1 and the draft's {len(ids):,} kept tokens")
    seqs = td.load_shards("train")
    if not seqs:
        sys.exit(f"error: no training continuations in {td.CACHE}: run `python scripts/train/train_draft.py data` first")
    keep = narrow_head(ids, seqs, args.head_vocab)
    weights["macinfer.head_ids"] = mx.array(keep, dtype=mx.int32)
    tmp = path / "model.tmp.safetensors"
    mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
    os.replace(tmp, path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    cfg["macinfer_draft"]["head_vocab"] = len(keep)
    meta_path = path / "train_meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        meta["head_narrowed"] = [meta.get("head_narrowed", [len(ids)])[0], len(keep)]
        tmp = path / "train_meta.tmp.json"
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(tmp, meta_path)
    tmp = path / "config.tmp.json"
    tmp.write_text(json.dumps(cfg, indent=2) + "\n")
    os.replace(tmp, path / "config.json")
    print(f"{path}: head narrowed from {len(ids):,} to {len(keep):,} tokens (by frequency in {len(seqs):,} "
          f"training continuations); run `eval --write-readme` for its figures")


def calibration(draft, seqs, levels=(0.3, 0.5, 0.7)) -> list:
    """[(confidence level, share of continuation tokens at or above it, top-1 accuracy there)]."""
    import mlx.core as mx
    import numpy as np

    conf, hit = [], []
    for x, f, _, ti, _, w in make_batches(seqs, 4096, random.Random(0), 0.0):
        p = mx.softmax(draft.head(draft(mx.array(x), mx.array(f.astype(np.float32)))), axis=-1)
        m = w > 0
        conf.append(np.array(p.max(-1))[m])
        hit.append((np.array(p.argmax(-1)) == ti[..., 0])[m])
    conf, hit = np.concatenate(conf), np.concatenate(hit)
    return [(c, float((conf >= c).mean()), float(hit[conf >= c].mean())) for c in levels if (conf >= c).any()]


def cmd_engine(args):
    """Acceptance as the engine deploys a draft: chains cut by confidence, adaptive k, lookup.

    The held-out prompts run through LLMEngine (greedy, their cached continuation length,
    8 at a time) once per `--engine` option; every verified draft is counted by the kind of
    drafter that made it (macinfer.spec_decode.SpecDecoder.kind). With `--every-step`, adaptive
    k is off: every row drafts every step, as far as the drafter offers (chains still cut by
    the draft's confidence), so the figure no longer depends on measured timings, which on a
    shared machine decide how often drafting is judged worth it.
    """
    import collections

    from macinfer.engine.llm_engine import LLMEngine
    from macinfer.core.sampling import SamplingParams

    model, tok, info = td.load_target()
    held = load_with_feats("heldout")[: args.eval_prompts]
    for option in args.engine.split(","):
        engine = LLMEngine(model, tok, info, kv_memory="256MB", max_num_seqs=8, enable_prefix_cache=False,
                           draft=option, adaptive_speculation=not args.every_step)
        spec, counts = engine.spec_decoder, collections.defaultdict(lambda: [0, 0, 0])  # kind -> steps, drafted, accepted
        update = spec.update_from_output

        def spy(scheduled, sampled, seconds, spec=spec, counts=counts, update=update):
            for s, toks in zip(scheduled, sampled):
                if s.num_spec_tokens:
                    c = counts[spec._kinds.get(s.seq.request_id, "")]
                    c[0] += 1
                    c[1] += s.num_spec_tokens
                    c[2] += len(toks) - 1
            return update(scheduled, sampled, seconds)

        spec.update_from_output = spy
        t0, generated = time.time(), 0
        for tok_ids, n_p, *_ in held:
            engine.add_request(tok_ids[:n_p].tolist(), SamplingParams(max_tokens=len(tok_ids) - n_p, ignore_eos=True))
            generated += len(tok_ids) - n_p
        while engine.has_unfinished():
            engine.step()
        drafted, accepted = sum(c[1] for c in counts.values()), sum(c[2] for c in counts.values())
        print(f"draft={option}: {len(held)} held-out prompts, {generated} tokens, {time.time() - t0:.0f}s; "
              f"{drafted} drafted, {accepted} accepted ({accepted / max(drafted, 1):.3f} per drafted token)", flush=True)
        for kind, (steps, d, a) in sorted(counts.items()):
            print(f"  {kind or 'all'}: {steps} verify rows, {d} drafted, {a} accepted ({a / max(d, 1):.3f}), "
                  f"{(a + steps) / max(steps, 1):.2f} tokens per verify row", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["feats", "train", "eval", "engine", "head"])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--decay-steps", type=int, default=1500)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--hard-weight", type=float, default=0.5)
    ap.add_argument("--reg-weight", type=float, default=1.0, help="weight of the feature regression")
    ap.add_argument("--chain-weight", type=float, default=0.5, help="weight of the second (fed-back) pass")
    ap.add_argument("--prompt-weight", type=float, default=0.25)
    ap.add_argument("--init-layer", type=int, default=29, help="target layer the draft's layer starts from")
    ap.add_argument("--head-vocab", type=int, default=8192, help="train: tokens the head keeps; head: narrow it to")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-prompts", type=int, default=48)
    ap.add_argument("--every-step", action="store_true",
                    help="engine: adaptive k off, every row drafts every step (timing-independent acceptance)")
    ap.add_argument("--draft", default=str(DEFAULT_OUT), help="eval: the draft directory")
    ap.add_argument("--init", default="", help="train: continue from a saved draft directory")
    ap.add_argument("--write-readme", action="store_true", help="eval: write the draft's README.md with the figures")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--engine", default="smollm2-135m,auto",
                    help="engine: draft options to deploy on the held-out prompts, comma-separated")
    args = ap.parse_args()
    if args.eval_prompts < 1 or args.minutes <= 0:
        ap.error("--eval-prompts and --minutes must be positive")
    from macinfer.errors import MacinferError

    try:
        {"feats": cmd_feats, "train": cmd_train, "eval": cmd_eval, "engine": cmd_engine, "head": cmd_head}[args.stage](args)
    except MacinferError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
