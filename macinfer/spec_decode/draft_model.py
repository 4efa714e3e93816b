"""Draft models for speculative decoding: load one that is guaranteed to share the target's tokenizer.

Two kinds of draft directory load here:

- **Embedding-less drafts** (what macinfer ships, e.g. ``models/smollm2-135m-draft``): an mlx-lm
  model directory whose ``model.safetensors`` holds only transformer layers and the final norm;
  ``config.json`` has ``"macinfer_draft": {"embedding": "target", ...}``. The input embedding and
  the tied lm_head are taken from the target model (shared, not copied), so the draft uses the
  target's tokenizer by construction. Its hidden size and vocabulary size must match the target's.
- **Full mlx-lm models** (own embedding and tokenizer), given as a path, catalog name or
  Hugging Face repo id (whatever ``macinfer.modelio.loader`` accepts). Its tokenizer vocabulary must equal
  the target's, token for token.

An embedding-less draft may also carry a **vocabulary-subset head** (``"head_vocab": N`` in
``macinfer_draft`` and the N kept token ids as ``macinfer.head_ids`` in its safetensors): its
logits are computed only for those N tokens (the target's embedding rows for them, copied once)
and every other token gets -inf. A small draft's cost is mostly its lm_head (SmolLM2: 49,152 x 576,
twice the four layers' weights), and the tokens a chat model actually emits are a few thousand;
a draft can never propose the others, which only ever costs acceptance, never exactness
(the verifier samples from max(0, p - q) with q exactly what the draft drew from).

Either mismatch is a one-line ``MacinferError``. On hosts without Metal, half-precision
parameters are cast to float32 (and a quantised full draft is dequantised by default): the CPU
backend emulates float16 and its quantised matmul is slow (docs/platform.md, "MLX's CPU backend").
"""

from __future__ import annotations

import json
from pathlib import Path

from macinfer.errors import MacinferError
from macinfer.core.lm_head import SubsetHead, embedding_and_head, embedding_rows_and_dim
from macinfer.modelio.hub import draft_snapshot, fetch_draft
from macinfer.modelio.loader import REPO_ID, fit_for_cpu, load_model
from macinfer.paths import models_dir
from macinfer.spec_decode.eagle3 import is_eagle3, load_eagle3
from macinfer.spec_decode.feature_draft import is_feature_draft, load_feature_draft

_MODELS = models_dir()

# By target name: the default draft, then the others. "smollm2-135m" is a feature draft
# (macinfer.spec_decode.feature_draft: reads the target's hidden states); "-tokens" is a small token-only
# model that any speculative decoder (mlx-lm's too) can run.
SHIPPED_DRAFTS = {"smollm2-135m": _MODELS / "smollm2-135m-eagle", "smollm2-135m-tokens": _MODELS / "smollm2-135m-draft"}


def tokenizer_vocab(tokenizer) -> dict:
    """The vocabulary (token -> id) of a Hugging Face tokenizer or mlx-lm's wrapper (which passes
    the call on)."""
    try:
        return tokenizer.get_vocab()
    except Exception as e:  # pragma: no cover - exotic tokenizers
        raise MacinferError(f"cannot read the tokenizer vocabulary ({type(e).__name__})") from None


def _resolve(spec_or_path) -> Path | None:
    """A local directory for an embedding-less or full draft; None if it is a name for the loader."""
    if isinstance(spec_or_path, Path) or spec_or_path in SHIPPED_DRAFTS:
        path = SHIPPED_DRAFTS.get(spec_or_path, spec_or_path) if not isinstance(spec_or_path, Path) else spec_or_path
        if not Path(path).is_dir():
            raise MacinferError(f"draft '{spec_or_path}' not found at {path}: is the checkout complete?")
        return Path(path)
    path = Path(str(spec_or_path)).expanduser()
    return path if path.is_dir() else None


def _cached_draft_repo(repo: str) -> Path | None:
    """A repo id's snapshot when it is an EAGLE-3 draft: from the Hugging Face cache, else downloaded
    (config and safetensors only); None for anything else (the loader takes it as a model)."""
    path = draft_snapshot(repo)
    if path is None:
        try:
            path = fetch_draft(repo, config_only=True)
        except MacinferError:
            return None
        if not is_eagle3(path):
            return None
        path = fetch_draft(repo)
    return path if is_eagle3(path) else None


def _is_embeddingless(path: Path) -> bool:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (cfg.get("macinfer_draft") or {}).get("embedding") == "target"


def _load_embeddingless(path: Path, target_model, target_tokenizer, dequantize: bool | None = None):
    import mlx.core as mx
    from mlx_lm.utils import load_model as mlx_load_model

    cfg = json.loads((path / "config.json").read_text())
    embed, head = embedding_and_head(target_model)
    rows, dim = embedding_rows_and_dim(embed)
    vocab = cfg.get("vocab_size")
    name = path.name
    if vocab != rows:
        raise MacinferError(
            f"draft {name} is for a {vocab}-token vocabulary but the target has {rows}: use a draft made for this target"
        )
    if cfg.get("hidden_size") != dim:
        raise MacinferError(
            f"draft {name} has hidden size {cfg.get('hidden_size')} but the target's embedding is {dim} wide: "
            "use a draft made for this target"
        )
    n_tok = len(tokenizer_vocab(target_tokenizer))
    if n_tok > rows:
        raise MacinferError(f"the target tokenizer has {n_tok} tokens but draft {name} covers {rows}")
    try:
        draft, _ = mlx_load_model(path, strict=False)
        stored = {}
        for f in path.glob("model*.safetensors"):
            stored.update(mx.load(str(f)))
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MacinferError(f"could not load draft {name} ({msg})") from None
    from mlx.utils import tree_flatten

    missing = [k for k, _ in tree_flatten(draft.parameters()) if "embed_tokens" not in k and k not in stored]
    if missing:
        raise MacinferError(f"draft {name} is incomplete: {len(missing)} weights missing (e.g. {missing[0]})")
    if dequantize is None:
        dequantize = not mx.metal.is_available()
    if dequantize and "quantization" in cfg:
        from mlx_lm.utils import dequantize_model

        draft = dequantize_model(draft)
    # Share the target's embedding (and head, if untied) instead of holding a copy.
    draft.model.embed_tokens = embed
    head_vocab = (cfg.get("macinfer_draft") or {}).get("head_vocab")
    if head_vocab:
        if head is not None:
            raise MacinferError(f"draft {name} has a subset head of the tied embedding but the target's lm_head is untied")
        ids = stored.get("macinfer.head_ids")
        if ids is None or ids.size != head_vocab or int(ids.max()) >= rows:
            raise MacinferError(f"draft {name}: its head token ids are missing or out of range: rebuild the draft")
    elif head is not None:
        draft.args.tie_word_embeddings = False
        draft.lm_head = head
    fit_for_cpu(draft)
    if head_vocab:  # after the cast: the copied rows come out of the (possibly float16) embedding
        draft.args.tie_word_embeddings = False
        # Not an nn.Module: it stays a plain attribute, outside draft.parameters().
        draft.lm_head = SubsetHead(embed, ids, rows)
        if not mx.metal.is_available() and draft.lm_head.weight.dtype != mx.float32:
            draft.lm_head.weight = draft.lm_head.weight.astype(mx.float32)
        mx.eval(draft.lm_head.weight)
    mx.eval(draft.parameters())
    return draft


def save_draft(draft, config: dict, out: Path, *, head_ids=None, bits: int = 8, group_size: int = 64) -> int:
    """Write an embedding-less draft directory that `load_draft` reads back; return its bytes.

    Args:
        draft: an mlx-lm model whose embedding is the target's (it is not written).
        config: its config.json, with ``"macinfer_draft": {"embedding": "target", ...}``
            (and ``"head_vocab": len(head_ids)`` for a subset head).
        head_ids: the token ids of a SubsetHead, or None for the tied full head.
        bits, group_size: linear weights are stored mlx-affine-quantised (float16 scales and
            biases) so four SmolLM2 layers fit in ~15 MB; 0 bits keeps them float16. Norms are
            float16. `load_draft` dequantises to float32 where there is no Metal.
    """
    import os

    import mlx.core as mx
    from mlx.utils import tree_flatten

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = {}
    for k, v in tree_flatten(draft.parameters()):
        if "embed_tokens" in k:
            continue
        if bits and v.ndim == 2 and k.endswith(".weight"):
            wq, sc, bi = mx.quantize(v.astype(mx.float32), group_size=group_size, bits=bits)
            base = k[: -len(".weight")]
            weights[k] = wq
            weights[base + ".scales"] = sc.astype(mx.float16)
            weights[base + ".biases"] = bi.astype(mx.float16)
        else:
            weights[k] = v.astype(mx.float16)
    if head_ids is not None:
        weights["macinfer.head_ids"] = mx.array(head_ids, dtype=mx.int32)
    config = dict(config)
    if bits:
        config["quantization"] = config["quantization_config"] = {"group_size": group_size, "bits": bits}
    else:
        config.pop("quantization", None), config.pop("quantization_config", None)
    tmp = out / "model.tmp.safetensors"
    mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
    os.replace(tmp, out / "model.safetensors")
    tmp = out / "config.tmp.json"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, out / "config.json")
    return sum((out / f).stat().st_size for f in ("model.safetensors", "config.json"))


def load_draft(spec_or_path, target_model, target_tokenizer, *, dequantize: bool | None = None):
    """Load a draft model for `target_model` that is checked to share its tokenizer.

    Args:
        spec_or_path: a shipped draft name (``SHIPPED_DRAFTS``, e.g. "smollm2-135m"), a directory
            (embedding-less draft, EAGLE-3 draft, or full mlx-lm model), a repo id (an EAGLE-3
            draft, or a model), or anything ``macinfer.modelio.loader`` resolves.
        target_model: the loaded target (an mlx-lm model).
        target_tokenizer: the target's tokenizer (mlx-lm TokenizerWrapper or HF tokenizer).
        dequantize: dequantise quantised draft weights (default: when there is no Metal, where
            quantised matmul is slow; the shared target embedding is never touched).

    Returns:
        the draft as an mlx-lm model (``draft(tokens, cache=...) -> logits``; ``draft.make_cache()``).
    """
    import mlx.core as mx

    path = _resolve(spec_or_path)
    if path is None and isinstance(spec_or_path, str) and REPO_ID.match(spec_or_path):
        path = _cached_draft_repo(spec_or_path)  # an EAGLE-3 repo has no config mlx-lm could load
    if path is not None and is_feature_draft(path):
        return load_feature_draft(path, target_model)
    if path is not None and is_eagle3(path):
        return load_eagle3(path, target_model, str(spec_or_path))
    if path is not None and _is_embeddingless(path):
        return _load_embeddingless(path, target_model, target_tokenizer, dequantize)

    if dequantize is None:
        dequantize = not mx.metal.is_available()
    draft, draft_tok, info = load_model(str(path) if path is not None else spec_or_path, dequantize=dequantize)
    mine, theirs = tokenizer_vocab(draft_tok), tokenizer_vocab(target_tokenizer)
    if mine != theirs:
        diff = len(set(mine.items()) ^ set(theirs.items()))
        raise MacinferError(
            f"draft {info.name} does not share the target's tokenizer ({len(mine)} vs {len(theirs)} tokens, "
            f"{diff} entries differ): pick a draft from the target's model family"
        )
    # A full draft's output rows must cover the target's tokens (ids index the same table).
    rows = info.config.get("vocab_size") or len(mine)
    if rows < len(theirs):
        raise MacinferError(f"draft {info.name} has {rows} output rows for a {len(theirs)}-token tokenizer")
    return draft
