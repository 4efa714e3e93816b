"""Feature drafts (EAGLE-style): a one-layer draft that reads the target's own hidden states.

A token-only draft has to guess what the target's 30 layers will make of the text; a feature
draft is handed what they already made of it. At every position t the target computes f_t, the
final hidden state its lm_head reads (it predicts token t+1). The draft's input at t is

    x_t = fc([embed(token_{t+1}), f_t])        (2D -> D; the target's frozen embedding)

and one llama decoder layer plus a norm turn x_0..x_t (causal attention over the draft's own
paged KV cache) into f^_{t+1}, its guess of the target's next hidden state. The target's tied
embedding rows for the kept tokens (a `SubsetHead`) read token t+2 off it. The next draft token
feeds f^ back in place of the (not yet computed) f:

    target verified  ... f_{p-1}  (token p known, f_p not yet)
    round 0          rows t = last fed .. p-1 with true f_t    -> f^_p,   d_0 (token p+1)
    round 1          row p with (f^_p, d_0)                    -> f^_{p+1}, d_1
    ...

Rows fed with true features stay in the draft's KV cache; rows fed with f^ are cut off at the
next step (rollback) and fed again once the target has computed their real features.

Where the features come from: the target's ModelRunner calls `FeatureDrafter.observe` with the
hidden states of every forward (lazy arrays; `hidden_sink`). A verify forward also covers
rejected drafts; those positions are overwritten by the next forward (same positions) and never
read past the target's `num_computed_tokens`. Positions the target never ran (a prompt prefix
served from the prefix cache) have no features: the draft's context then starts after them.

Li, Wei, Zhang, Zhang: "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"
(ICML 2024). The draft for the embedded SmolLM2 is built by scripts/train/train_eagle.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from macinfer.core.block_pool import BlockPool
from macinfer.core.lm_head import SubsetHead, embedding_and_head, embedding_rows_and_dim
from macinfer.core.model_runner import ModelRunner
from macinfer.kv.model_probe import inspect_model
from macinfer.modelio.cpu_linear import use_cpu_linears
from macinfer.spec_decode.drafter import STEADY_TOKENS, module_bytes, pick_kept
from macinfer.errors import MacinferError
from macinfer.core.sequence import Sequence


class FeatureDraft(nn.Module):
    """fc + a llama body of `num_hidden_layers` layers (usually 1); embed_tokens is the target's.

    Args:
        args: mlx-lm llama ModelArgs (the target's hidden size, heads and vocabulary).

    Call: ``draft(tokens (B, L), feats (B, L, D), cache) -> f^ (B, L, D)``; ``draft.head(f^)``
    gives the logits (set by `load_feature_draft`, or by the training script).
    """

    def __init__(self, args):
        super().__init__()
        from mlx_lm.models import llama

        self.args = args
        D = args.hidden_size
        self.fc = nn.Linear(2 * D, D, bias=False)
        self.model = llama.LlamaModel(args)

    @property
    def layers(self):
        return self.model.layers

    # What FeatureDrafter runs (the feature-draft interface, shared with MTP and EAGLE-3 drafts):
    # `body` is what its paged runner pages, `features` turns the target's final hidden states into
    # this draft's inputs, `logits` reads tokens off a guessed feature over `vocab`'s columns.
    @property
    def body(self):
        return self.model

    @property
    def vocab(self):
        return self.head

    def features(self, hidden: mx.array) -> mx.array:
        return hidden

    def logits(self, fhat: mx.array) -> mx.array:
        return fhat @ self.head.weight.T  # (B, N) over the head's kept columns

    def __call__(self, tokens: mx.array, feats: mx.array, cache=None) -> mx.array:
        e = self.model.embed_tokens(tokens)
        x = self.fc(mx.concatenate([e, feats.astype(e.dtype)], axis=-1))
        return self.model(tokens, cache, input_embeddings=x)


def feature_draft_config(target_config: dict, head_vocab: int, num_layers: int = 1, **meta) -> dict:
    """config.json of a feature draft for a target with `target_config` (an mlx-lm llama config)."""
    cfg = {k: v for k, v in target_config.items()
           if k not in ("quantization", "quantization_config", "layer_types", "sliding_window")}
    cfg.update(model_type="llama", num_hidden_layers=num_layers, tie_word_embeddings=True)
    cfg["macinfer_draft"] = {"kind": "feature", "embedding": "target", "head_vocab": head_vocab, **meta}
    return cfg


def is_feature_draft(path: Path) -> bool:
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (cfg.get("macinfer_draft") or {}).get("kind") == "feature"


def load_feature_draft(path: Path, target_model) -> FeatureDraft:
    """Load a feature draft directory for `target_model` (checked to fit it); float32 weights.

    The stored linear weights are mlx-affine 8-bit (see draft_model.save_draft); they are
    dequantised here: the draft is ~5M parameters, and float32 is what the CPU backend wants.
    """
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    path = Path(path)
    if not is_feature_draft(path):
        raise MacinferError(f"{path} is not a feature draft (a directory whose config.json has "
                            "macinfer_draft.kind = \"feature\")")
    cfg = json.loads((path / "config.json").read_text())
    embed, head = embedding_and_head(target_model)
    rows, dim = embedding_rows_and_dim(embed)
    if cfg.get("vocab_size") != rows or cfg.get("hidden_size") != dim:
        raise MacinferError(
            f"draft {path.name} is for a {cfg.get('vocab_size')}-token, {cfg.get('hidden_size')}-wide model "
            f"but the target is {rows} x {dim}: use a draft made for this target")
    if head is not None:
        raise MacinferError(f"draft {path.name} reads tokens off the tied embedding but the target's lm_head is untied")
    try:
        stored = {}
        for f in sorted(path.glob("model*.safetensors")):
            stored.update(mx.load(str(f)))
    except (ValueError, RuntimeError, OSError) as e:
        raise MacinferError(f"could not load draft {path.name} ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    q = cfg.get("quantization") or {}
    weights = {}
    for k, v in stored.items():
        if k.endswith(".scales") or k.endswith(".biases") and k[: -len(".biases")] + ".scales" in stored:
            continue
        base = k[: -len(".weight")] if k.endswith(".weight") else None
        if base is not None and base + ".scales" in stored:
            v = mx.dequantize(v, stored[base + ".scales"].astype(mx.float32), stored[base + ".biases"].astype(mx.float32),
                              group_size=q.get("group_size", 64), bits=q.get("bits", 8))
        weights[k] = v.astype(mx.float32)
    ids = weights.pop("macinfer.head_ids", None)
    draft = FeatureDraft(llama.ModelArgs.from_dict(cfg))
    want = {k for k, _ in tree_flatten(draft.parameters()) if "embed_tokens" not in k}
    missing = sorted(want - weights.keys())
    if missing or ids is None:
        raise MacinferError(f"draft {path.name} is incomplete ({missing[0] if missing else 'head ids'} missing): rebuild it")
    draft.load_weights(list(weights.items()), strict=False)
    use_cpu_linears(draft)  # float32 already: only the layers' form for a few rows
    draft.model.embed_tokens = embed  # shared with the target, never copied
    draft.head = SubsetHead(embed, ids.astype(mx.int32), rows)  # a plain attribute: not a parameter
    if draft.head.weight.dtype != mx.float32 and not mx.metal.is_available():
        draft.head.weight = draft.head.weight.astype(mx.float32)
    mx.eval(draft.parameters(), draft.head.weight)
    return draft


class _FeatState:
    """The draft's view of one request: its paged KV rows map to target positions base, base+1, ..."""

    def __init__(self, request_id: str, base: int):
        self.request_id = request_id
        self.base = base  # target position of draft row 0
        self.true_rows = 0  # leading rows fed with the target's real features
        self.num_computed_tokens = 0  # rows with K/V in the draft pool (true ones + this step's drafts)
        self.block_table: list[int] = []


class FeatureDrafter:
    """Drafts with a FeatureDraft over its own paged KV cache, fed by the target's hidden states.

    Args:
        draft: a FeatureDraft with .head, or any draft with the same interface: `body` (the layers
            paged here), `draft(tokens, feats, cache) -> f^`, `features(target hidden) -> feats`,
            `logits(f^) -> (B, N)` over `vocab` (a SubsetHead's kept ids, or None: the whole
            vocabulary). MTP layers (macinfer.spec_decode.mtp) and EAGLE-3 drafts
            (macinfer.spec_decode.eagle3) are such drafts.
        num_blocks, block_size: the draft's own block pool.

    The target's ModelRunner reports each forward's hidden states to `hidden_sink` (its constructor's
    `hidden_sink=`, which the engine passes).
    """

    has_model = True
    # Stop a chain where the chance it is all accepted falls below this: about what one more
    # verified token plus one more draft round cost, as a fraction of a decode step. Measured
    # in the engine with float32 SmolLM2 on a 2-core x86 CPU (MLX's CPU backend): a 45-48 ms decode
    # step; each verified draft adds 5-7 ms (macinfer.modelio.cpu_linear; the 49k-row head ~1 ms of
    # it); a draft round costs 3-5 ms. A lower cut for the first token alone (0.15: its round is
    # paid either way) measured 1.19x against 1.23x over 12 held-out prompts.
    min_joint = 0.25

    def __init__(self, draft: FeatureDraft, num_blocks: int, block_size: int, name: str = "feature draft"):
        self.name = name
        self.draft = draft
        self.pool = BlockPool(num_blocks, block_size)
        self.runner = ModelRunner(draft.body, inspect_model(draft.body, name), num_blocks, block_size)
        self.states: dict[str, _FeatState] = {}
        self.feats: dict[str, list[list]] = {}  # request_id -> [[start position, (n, D) lazy array]]
        self.round_s: float | None = None  # seconds per decode draft round (EMA), as DraftModelDrafter
        self.hidden_sink = self.observe

    # -- features from the target ---------------------------------------------------------
    # Unfed features kept per request. A request that goes many steps without drafting (adaptive
    # k at 0) would otherwise keep one chunk per step; past this, the draft's context restarts
    # at the oldest position kept (see _sync), which costs acceptance, never exactness.
    max_unfed = 256

    def observe(self, seqs: list, starts: list[int], counts: list[int], hidden: mx.array) -> None:
        """A target forward computed positions starts[j] .. starts[j] + counts[j] - 1 of seqs[j]."""
        hidden = self.draft.features(hidden)  # lazy: evaluated with the forward (its inputs are)
        for j, (seq, start, n) in enumerate(zip(seqs, starts, counts)):
            chunks = self.feats.setdefault(seq.request_id, [])
            while chunks and chunks[-1][0] >= start:  # recomputed positions replace what was there
                chunks.pop()
            if chunks and chunks[-1][0] + chunks[-1][1].shape[0] > start:
                chunks[-1][1] = chunks[-1][1][: start - chunks[-1][0]]
            chunks.append([start, hidden[j, :n]])
            while len(chunks) > 1 and start + n - (chunks[1][0]) >= self.max_unfed:
                chunks.pop(0)

    def _features(self, rid: str, end: int) -> list[list]:
        """The contiguous run of feature chunks that ends at `end` (exclusive), clipped to it."""
        run, pos = [], end
        for start, arr in reversed(self.feats.get(rid, [])):
            stop = min(start + arr.shape[0], end)
            if stop < pos or start >= stop:  # a gap, or a chunk past end
                if start >= end:
                    continue
                break
            run.append([start, arr[: stop - start]])
            pos = start
        return run[::-1]

    # -- drafting -------------------------------------------------------------------------
    def available(self, seq: Sequence, k: int) -> int:
        return k

    def nbytes(self, shared: set[int]) -> int:
        """The draft's weights (not the target's embedding it reads), its head's kept rows, its KV pool."""
        head = getattr(getattr(self.draft, "head", None), "weight", None)  # a SubsetHead's copy: not a parameter
        head_bytes = head.nbytes if isinstance(head, mx.array) and id(head) not in shared else 0
        return module_bytes(self.draft, shared) + head_bytes + self.runner.kv_bytes

    def _sync(self, seq: Sequence):
        """Roll back last step's drafted rows; -> (state, features (L, D), tokens) of the rows to feed now."""
        rid, end = seq.request_id, seq.num_computed_tokens  # features exist below end
        chunks = self._features(rid, end)
        first = chunks[0][0] if chunks else end
        st = self.states.get(rid)
        if st is not None:
            st.num_computed_tokens = st.true_rows
            self.pool.trim(st, st.true_rows)
            nxt = st.base + st.true_rows
            if not first <= nxt <= end:  # recomputed (preemption) or features missing: start afresh
                self.pool.free(st)
                st = None
        if st is None:
            st = self.states[rid] = _FeatState(rid, first)
        nxt = st.base + st.true_rows
        self.feats[rid] = chunks  # only what can still be fed
        feats = mx.concatenate([a for _, a in chunks], axis=0)[nxt - first:] if chunks else None
        tokens = seq.token_ids[nxt + 1: end + 1]
        return st, feats, tokens

    def _run(self, sts: list[_FeatState], tokens: list[list[int]], feats: list[mx.array]) -> mx.array:
        """One draft forward: rows padded at the end to the longest -> each row's last f^ (B, D)."""
        starts = [st.num_computed_tokens for st in sts]
        L = self.runner.set_context([st.block_table for st in sts], starts, [len(t) for t in tokens])
        D = feats[0].shape[-1]
        x = mx.array([t + [0] * (L - len(t)) for t in tokens], dtype=mx.int32)
        f = mx.stack([a if a.shape[0] == L else mx.concatenate([a, mx.zeros((L - a.shape[0], D), a.dtype)])
                      for a in feats])
        out = self.draft(x, f, cache=self.runner.caches)  # (B, L, D)
        if all(len(t) == L for t in tokens):
            return out[:, -1]
        return out[mx.arange(len(tokens)), mx.array([len(t) - 1 for t in tokens])]

    _pick = staticmethod(pick_kept)  # tests may script the drafts by replacing it

    def propose(self, seqs: list[Sequence], num_draft: list[int]) -> None:
        """Draft up to num_draft[i] tokens per row; a row's chain stops early where the draft is unsure.

        The draft's confidence (its top probability, well calibrated on held-out text: see
        scripts/train/train_eagle.py) times that of the drafts before it is the chance the whole chain
        so far is accepted; below `min_joint` one more token would cost more verify and draft
        time than it is expected to save, so the chain stops there (EAGLE-2's rule, on a chain).
        The rule looks at the draft's distribution, never at the token drawn from it, so a
        sampled draft still comes from q and rejection sampling stays exact.
        """
        rows, toks, fts, ks, joint = [], [], [], [], []
        for seq, k in zip(seqs, num_draft):
            seq.spec_token_ids, seq.spec_probs = [], None
            if k <= 0:
                continue
            st, feats, tokens = self._sync(seq)
            if not tokens or not self.pool.allocate_slots(st, len(tokens) + k - 1):
                continue  # nothing new to feed (cannot happen after a step), or the draft pool is full
            rows.append((seq, st))
            toks.append(tokens)
            fts.append(feats)
            ks.append(k)
            joint.append(1.0)
        probs: dict[str, list[mx.array]] = {}
        r = 0
        while idx := [i for i, k in enumerate(ks) if k > r]:
            t0 = time.perf_counter()
            steady = all(len(toks[i]) <= STEADY_TOKENS for i in idx)
            fhat = self._run([rows[i][1] for i in idx], [toks[i] for i in idx], [fts[i] for i in idx])
            # Logits over the head's kept columns only (see _pick); the confidence is the same over
            # them as over the full vocabulary, whose other columns are -inf.
            head = self.draft.vocab
            sub = self.draft.logits(fhat)  # (B, N)
            conf = mx.softmax(sub.astype(mx.float32), axis=-1).max(axis=-1)
            picked = [self._pick(rows[i][0], sub[j], head) for j, i in enumerate(idx)]
            picks = mx.stack([t for t, _ in picked])
            mx.eval(picks, conf, fhat, [c.state for c in self.runner.caches])  # see ModelRunner.execute_model
            for j, (i, tok, c) in enumerate(zip(idx, picks.tolist(), conf.tolist())):
                seq, st = rows[i]
                n = len(toks[i])
                st.num_computed_tokens += n
                if r == 0:
                    st.true_rows += n
                joint[i] *= c
                if joint[i] < self.min_joint:
                    ks[i] = r  # not worth verifying: this row's chain ends before this token
                    continue
                seq.spec_token_ids.append(tok)
                if picked[j][1] is not None:
                    probs.setdefault(seq.request_id, []).append(picked[j][1])
                toks[i], fts[i] = [tok], fhat[j: j + 1]
            if steady:
                dt = time.perf_counter() - t0
                self.round_s = dt if self.round_s is None else 0.7 * self.round_s + 0.3 * dt
            r += 1
        for seq, st in rows:
            if seq.request_id in probs:
                seq.spec_probs = mx.stack(probs[seq.request_id])  # (k, V)
            # What round 0 fed is in the draft's cache now: drop the features no longer needed.
            nxt = st.base + st.true_rows
            self.feats[seq.request_id] = [c for c in self.feats.get(seq.request_id, []) if c[0] + c[1].shape[0] > nxt]

    def remove(self, request_id: str) -> None:
        st = self.states.pop(request_id, None)
        if st is not None:
            self.pool.free(st)
        self.feats.pop(request_id, None)
