"""EAGLE-3 drafts as their authors and vLLM's `speculators` publish them, run as a feature draft.

An EAGLE-3 draft reads three of the target's hidden states at once: the inputs of three of its
decoder layers (by default layers 2, L/2 and L-3; `eagle_aux_hidden_state_layer_ids` in the
config overrides), fused by `fc` (3D -> D). One llama-style layer whose attention sees the token
embedding and that feature side by side (q/k/v take 2D) guesses the target's next state; its
own head, often over a smaller draft vocabulary, reads the token, and `d2t` maps a draft id d to
the target's d + d2t[d]. The next round feeds the layer's output back instead of `fc`'s:

    true position t    x_t = [input_layernorm(embed(t+1)), hidden_norm(fc([a_low, a_mid, a_high]_t))]
    drafted position   x_t = [input_layernorm(embed(t+1)), hidden_norm(f^_t)]
    f^_{t+1} = layer(x_t) (attention over the draft's own paged K/V, residual from the feature)
    logits   = lm_head(norm(f^_{t+1}))                 (draft vocabulary -> target ids via d2t)

Two layouts load (Li et al., "EAGLE-3", 2025; vLLM's llama_eagle3.py reads both):
- `speculators` (RedHatAI/*-speculator.eagle3): config.json with "speculators_model_type":
  "eagle3", the layer's llama config in "transformer_layer_config", "draft_vocab_size",
  "norm_before_residual", "target_hidden_size"; tensors `layers.0.*`, `fc`, `norm`, `lm_head`,
  `d2t`, `t2d`, usually `embed_tokens` (a copy of the target's).
- the EAGLE-3 authors' (yuhuili/EAGLE3-*): a llama config.json with "draft_vocab_size" and an
  Eagle3 architecture name; tensors `midlayer.*` for the layer, the rest as above.

The target's layer inputs are recorded by `LayerTaps` (the tapped layers' class is subclassed in
place, so parameter names do not change) while the target's runner builds each forward; they are
evaluated with that forward's hidden states, of whose graph they are part.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from macinfer.core.lm_head import SubsetHead, embedding_and_head, embedding_rows_and_dim
from macinfer.errors import MacinferError
from macinfer.modelio.loader import fit_for_cpu
from macinfer.modelio.model_files import read_config

# What each tapped layer instance records into: id(layer) -> [(weak reference to a LayerTaps, layer
# index)]. Weak: a draft's taps go with its engine (the drafter holds them), not with the model.
_TAPS: dict[int, list] = {}
_TAPPED_CLASSES: dict[type, type] = {}


class LayerTaps:
    """The inputs of some of a model's decoder layers at its latest forward (lazy arrays)."""

    def __init__(self, model, layer_ids: list[int]):
        lm = getattr(model, "language_model", model)
        layers = lm.model.layers
        self.ids = list(layer_ids)
        self.seen: dict[int, mx.array] = {}
        for i in sorted(set(self.ids)):
            _tap(layers[i], self, i)

    def take(self) -> mx.array:
        """The inputs recorded by the latest forward, concatenated in layer order: (B, L, len(ids) * D)."""
        missing = [i for i in self.ids if i not in self.seen]
        if missing:
            raise MacinferError(f"the target's layer {missing[0]} did not run in its forward: "
                                "an EAGLE-3 draft cannot read it")
        out = mx.concatenate([self.seen[i] for i in self.ids], axis=-1)
        self.seen = {}
        return out


def _tap(layer: nn.Module, taps: LayerTaps, index: int) -> None:
    """Record `layer`'s input into `taps` at every call, by retyping the instance to a subclass."""
    cls = type(layer)
    if cls not in _TAPPED_CLASSES.values():
        sub = _TAPPED_CLASSES.get(cls)
        if sub is None:
            def __call__(self, x, *args, _base=cls, **kwargs):
                for ref, i in _TAPS.get(id(self), ()):
                    t = ref()
                    if t is not None:
                        t.seen[i] = x
                return _base.__call__(self, x, *args, **kwargs)

            sub = _TAPPED_CLASSES[cls] = type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__})
        layer.__class__ = sub
    found = _TAPS.setdefault(id(layer), [])
    found[:] = [(ref, i) for ref, i in found if ref() is not None] + [(weakref.ref(taps), index)]


def tapped(model) -> bool:
    """Whether a live LayerTaps records some of the model's layers (a forward through them cannot be
    traced by mx.compile: the taps would keep the trace's placeholders)."""
    lm = getattr(model, "language_model", model)
    layers = getattr(getattr(lm, "model", None), "layers", None) or []
    return any(ref() is not None for layer in layers for ref, _ in _TAPS.get(id(layer), ()))


def default_layer_ids(num_layers: int) -> list[int]:
    """vLLM's and the EAGLE-3 authors' choice: the inputs of layers 2, L // 2 and L - 3."""
    return [2, num_layers // 2, num_layers - 3]


class Eagle3Layer(nn.Module):
    """A llama decoder layer; the first one's attention reads [embedding, feature] (2D wide)."""

    def __init__(self, args, first: bool, norm_before_residual: bool):
        super().__init__()
        from mlx_lm.models import llama

        self.first, self.norm_before_residual = first, norm_before_residual
        self.self_attn = llama.Attention(args)
        if first:
            a, D = self.self_attn, args.hidden_size
            bias = args.attention_bias
            a.q_proj = nn.Linear(2 * D, a.n_heads * a.head_dim, bias=bias)
            a.k_proj = nn.Linear(2 * D, a.n_kv_heads * a.head_dim, bias=bias)
            a.v_proj = nn.Linear(2 * D, a.n_kv_heads * a.head_dim, bias=bias)
            self.hidden_norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.mlp = llama.MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, e: mx.array, h: mx.array, mask=None, cache=None) -> mx.array:
        if self.first:
            if self.norm_before_residual:
                h = residual = self.hidden_norm(h)
            else:
                residual, h = h, self.hidden_norm(h)
            x = mx.concatenate([self.input_layernorm(e), h], axis=-1)  # (B, L, 2D)
        else:
            residual, x = h, self.input_layernorm(h)
        h = residual + self.self_attn(x, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Body(nn.Module):
    """The paged part of an EAGLE-3 draft: its layers over (token embedding, feature) rows.

    Called with token ids alone (the paged runner's probe) the features are zeros.
    """

    def __init__(self, args, norm_before_residual: bool, embed_tokens):
        super().__init__()
        self.layers = [Eagle3Layer(args, i == 0, norm_before_residual) for i in range(args.num_hidden_layers)]
        self.embed_tokens = embed_tokens
        self.dim = args.hidden_size

    def __call__(self, inputs: mx.array, cache=None, feats: mx.array | None = None) -> mx.array:
        from mlx_lm.models.base import create_attention_mask

        e = self.embed_tokens(inputs)
        h = feats.astype(e.dtype) if feats is not None else mx.zeros((*inputs.shape, self.dim), e.dtype)
        cache = cache if cache is not None else [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(e, h, mask, c)
        return h  # before the final norm: what the next round feeds back


class Eagle3Draft(nn.Module):
    """An EAGLE-3 draft (module docstring) with the feature-draft interface of
    macinfer.spec_decode.feature_draft.FeatureDrafter."""

    def __init__(self, args, target_dim: int, draft_vocab: int, norm_before_residual: bool, embed_tokens,
                 fc_bias: bool, num_taps: int, vocab: SubsetHead | None = None):
        super().__init__()
        self.model = Eagle3Body(args, norm_before_residual, embed_tokens)
        self.fc = nn.Linear(num_taps * target_dim, args.hidden_size, bias=fc_bias)
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, draft_vocab, bias=False)
        self.taps: LayerTaps | None = None  # set by load_eagle3 once the weights are in (`features` reads them)
        self._vocab = vocab  # the draft vocabulary's target ids (SubsetHead.mapping), or None: the same

    body = property(lambda self: self.model)
    vocab = property(lambda self: self._vocab)

    def features(self, hidden: mx.array) -> mx.array:
        """The fused auxiliary states of the target's latest forward (its final `hidden` is not used)."""
        return self.fc(self.taps.take().astype(self.fc.weight.dtype))

    def __call__(self, tokens: mx.array, feats: mx.array, cache=None) -> mx.array:
        return self.model(tokens, cache, feats=feats)

    def logits(self, fhat: mx.array) -> mx.array:
        return self.lm_head(self.norm(fhat))  # (B, draft vocabulary)


def is_eagle3(path: Path) -> bool:
    """Whether a directory holds an EAGLE-3 draft in either published layout."""
    cfg = read_config(path)
    if cfg is None:
        return False
    archs = cfg.get("architectures") or []
    return cfg.get("speculators_model_type") == "eagle3" or any("eagle3" in str(a).lower() for a in archs)


def _layout(cfg: dict) -> tuple[dict, int, int | None, bool, list | None]:
    """(layer config, draft vocabulary, target hidden size or None, norm_before_residual, aux layer ids)."""
    layer = cfg.get("transformer_layer_config") if cfg.get("speculators_model_type") else cfg
    layer = dict(layer or {})
    vocab = int(layer.get("vocab_size") or 0)
    eagle = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    ids = (cfg.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
           or layer.get("eagle_aux_hidden_state_layer_ids"))
    return (layer, int(cfg.get("draft_vocab_size") or vocab), cfg.get("target_hidden_size"),
            bool(cfg.get("norm_before_residual", False)), ids)


def _tensors(path: Path, name: str) -> dict[str, mx.array]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        bins = sorted(Path(path).glob("*.bin"))
        raise MacinferError(f"draft {name} has no .safetensors weights" + (
            " (only PyTorch .bin files: convert them to safetensors)" if bins else ""))
    out = {}
    try:
        for f in files:
            out.update(mx.load(str(f)))
    except (ValueError, RuntimeError, OSError) as e:
        raise MacinferError(f"could not load draft {name} ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    renamed = {}  # -> Eagle3Draft's names: model.layers.*, fc, norm, lm_head (and embed_tokens, d2t, t2d)
    for k, v in out.items():
        k = k[len("model."):] if k.startswith("model.") else k
        k = "layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k
        renamed["model." + k if k.startswith("layers.") else k] = v
    return renamed


# A draft for this target carries a copy of its embedding: rows that agree this well (cosine,
# averaged over sampled rows; a 4-bit target against a bf16 copy gives ~0.99) say it is.
SAME_EMBEDDING = 0.9


def _same_embedding(mine: mx.array, embed, rows: int) -> bool:
    idx = mx.array(list(range(7, rows, max(1, rows // 64)))[:64], dtype=mx.int32)
    a = mine[idx].astype(mx.float32)
    b = embed(idx).astype(mx.float32)
    cos = (a * b).sum(-1) / (mx.linalg.norm(a, axis=-1) * mx.linalg.norm(b, axis=-1) + 1e-6)
    return float(cos.mean().item()) >= SAME_EMBEDDING


def _vocab_map(d2t: mx.array | None, draft_vocab: int, rows: int, name: str) -> SubsetHead | None:
    """The draft vocabulary's target ids (d + d2t[d]), or None where the two vocabularies are one."""
    if draft_vocab == rows and (d2t is None or not bool(mx.any(d2t != 0).item())):
        return None
    if d2t is None or d2t.shape[0] != draft_vocab:
        raise MacinferError(f"draft {name} has a {draft_vocab}-token draft vocabulary but no d2t map to the "
                            f"target's {rows} tokens")
    target_ids = (mx.arange(draft_vocab) + d2t.astype(mx.int64)).astype(mx.int32)
    if int(target_ids.min().item()) < 0 or int(target_ids.max().item()) >= rows:
        raise MacinferError(f"draft {name}: its d2t map points outside the target's {rows} tokens")
    return SubsetHead.mapping(target_ids, rows)


def load_eagle3(path: Path, target_model, name: str | None = None) -> Eagle3Draft:
    """Load an EAGLE-3 draft directory for `target_model`, checked to be made for it.

    Raises:
        MacinferError: one line: not an EAGLE-3 draft, made for another model (vocabulary, hidden
            size, layers, or its copy of the embedding differ), incomplete weights.
    """
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    path = Path(path)
    name = name or path.name
    cfg = read_config(path)
    if cfg is None or not is_eagle3(path):
        raise MacinferError(f"{name} is not an EAGLE-3 draft (its config.json names no eagle3 architecture)")
    layer_cfg, draft_vocab, target_dim, nbr, ids = _layout(cfg)
    if layer_cfg.get("model_type", "llama") not in ("llama", "qwen2", "qwen3", "mistral"):
        raise MacinferError(f"draft {name}: its layer is a {layer_cfg.get('model_type')} layer; "
                            "EAGLE-3 drafts with llama layers are supported")
    embed, _ = embedding_and_head(target_model)
    rows, dim = embedding_rows_and_dim(embed)
    lm = getattr(target_model, "language_model", target_model)
    n_layers = len(lm.model.layers)
    vocab = int(layer_cfg.get("vocab_size") or 0)
    target_dim = int(target_dim or layer_cfg.get("hidden_size") or 0)
    if vocab != rows or target_dim != dim:
        raise MacinferError(f"draft {name} is an EAGLE-3 draft for a {vocab}-token, {target_dim}-wide model, "
                            f"but the target is {rows} x {dim}: use the draft made for this model")
    ids = sorted(int(i) for i in (ids or default_layer_ids(n_layers)))
    if len(set(ids)) != len(ids) or not all(0 <= i < n_layers for i in ids):
        raise MacinferError(f"draft {name} reads the target's layers {ids}, which a {n_layers}-layer target does "
                            "not have: use the draft made for this model")
    w = _tensors(path, name)
    layer_cfg.update(model_type="llama", vocab_size=vocab)
    layer_cfg.setdefault("num_hidden_layers", 1)
    args = llama.ModelArgs.from_dict({k: v for k, v in layer_cfg.items() if v is not None})
    own_embed = w.pop("embed_tokens.weight", None)
    if own_embed is not None and own_embed.shape == (rows, dim) and not _same_embedding(own_embed, embed, rows):
        raise MacinferError(f"draft {name} was made for another model (its copy of the embedding differs from "
                            "the target's): use the draft made for this model")
    if args.hidden_size != dim and own_embed is None:
        raise MacinferError(f"draft {name} is {args.hidden_size} wide and brings no embedding of its own")
    if args.hidden_size == dim:
        table = embed  # the target's, shared
    else:
        table = nn.Embedding(own_embed.shape[0], own_embed.shape[1])
        table.weight = own_embed
    d2t, t2d = w.pop("d2t", None), w.pop("t2d", None)
    del t2d  # the inverse map: d2t alone says where each draft token goes
    vocab_map = _vocab_map(d2t, draft_vocab, rows, name)
    draft = Eagle3Draft(args, dim, draft_vocab, nbr, table, "fc.bias" in w, len(ids), vocab_map)
    want = {k for k, _ in tree_flatten(draft.parameters()) if "embed_tokens" not in k}
    missing, extra = sorted(want - w.keys()), sorted(w.keys() - want)
    if missing:
        raise MacinferError(f"draft {name} is incomplete ({missing[0]} missing): download it again")
    if extra:  # e.g. q_norm: a layer kind other than llama's, which would be dropped silently
        raise MacinferError(f"draft {name} has weights a llama-style EAGLE-3 layer does not ({extra[0]}): "
                            "this kind of EAGLE-3 draft is not supported")
    try:
        draft.load_weights([(k, v) for k, v in w.items() if k in want], strict=False)
    except ValueError as e:
        raise MacinferError(f"draft {name}: its weights do not fit its config ({' '.join(str(e).split())[:160]})") from None
    fit_for_cpu(draft)
    mx.eval(draft.parameters())
    # Last: tapping retypes the target's layers for good, so only a draft that loaded may do it.
    draft.taps = LayerTaps(target_model, ids)
    return draft
