"""MTP drafts: the multi-token-prediction layers a checkpoint carries, run as a feature draft.

Qwen3-Next, Qwen3.5, DeepSeek-V3, GLM-4.5 and others are trained with extra layers that predict
the token after next from the main model's final hidden state; mlx-lm drops them when it loads
(`"mtp." not in k` in qwen3_next.py / qwen3_5.py; `model.layers.{num_hidden_layers}` in
deepseek_v3.py, glm4_moe.py). Read back from the weight files here, they draft exactly like the
feature draft (macinfer.spec_decode.feature_draft: the target's ModelRunner hands them its hidden
states, one draft round per token, rolled back on rejection). Two layouts, as vLLM's
qwen3_next_mtp.py and deepseek_mtp.py load them:

    Qwen3-Next / Qwen3.5   mtp.fc (2D -> D), mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden,
                           mtp.layers.0.* (a full-attention decoder layer), mtp.norm
        x = fc([pre_fc_norm_embedding(embed(t+1)), pre_fc_norm_hidden(h_t)])
        f^ = norm(layer(x))                 logits = lm_head(f^)      (the target's head)

    DeepSeek-V3 / GLM-4.5  model.layers.{N}.eh_proj, .enorm, .hnorm, .shared_head.{norm,head},
                           the decoder layer's own weights under the same prefix (N = num_hidden_layers)
        x = eh_proj([enorm(embed(t+1)), hnorm(h_t)])
        f^ = layer(x)                       logits = shared_head.head(shared_head.norm(f^))

h_t is the target's final hidden state (after its final norm, what its lm_head reads); the next
round feeds f^ in its place. A checkpoint with several MTP layers drafts every token with the
first (as vLLM does with one). The decoder layer is the target's own class, built at an index
whose kind (full attention, MoE or dense) matches the weights found.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from macinfer.core.lm_head import embedding_and_head
from macinfer.errors import MacinferError
from macinfer.modelio.loader import fit_for_cpu
from macinfer.modelio.model_files import safetensors_header, weight_files

QWEN = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
DEEPSEEK = ("deepseek_v3", "glm4_moe", "glm4_moe_lite")
# Config keys that say how many MTP layers a checkpoint has (in text_config for the VLM wrappers).
COUNT_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
DECODER_PARTS = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")


class MissingMTP(MacinferError):
    """A config promises MTP layers that the weight files do not hold."""


def _text(config: dict) -> dict:
    t = config.get("text_config")
    return {**config, **t} if isinstance(t, dict) else config


def promised_layers(config: dict) -> int:
    """How many MTP layers the config says the checkpoint has (0: none, or a family not supported)."""
    text = _text(config)
    if text.get("model_type") not in QWEN + DEEPSEEK and config.get("model_type") not in QWEN + DEEPSEEK:
        return 0
    return max([int(text.get(k) or 0) for k in COUNT_KEYS if isinstance(text.get(k), (int, float))] + [0])


def _prefix(config: dict) -> str:
    text = _text(config)
    kind = config.get("model_type")
    return "mtp." if kind in QWEN else f"model.layers.{int(text['num_hidden_layers'])}."


def mtp_keys(path: Path, config: dict) -> dict[str, Path]:
    """{tensor name: weight file} of the checkpoint's MTP tensors, from the files' headers only."""
    if config.get("model_type") not in QWEN + DEEPSEEK:
        return {}
    prefix = _prefix(config)
    try:  # a sharded checkpoint's index names every tensor's file
        names = json.loads((Path(path) / "model.safetensors.index.json").read_text())["weight_map"]
        return {k: Path(path) / f for k, f in names.items() if k.startswith(prefix)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    found: dict[str, Path] = {}
    for f in weight_files(path):
        try:
            found.update({k: f for k in safetensors_header(f) if k.startswith(prefix)})
        except (OSError, ValueError):
            continue
    return found


def _hf_norms(path: Path) -> bool:
    """Whether the checkpoint stores Qwen3-Next-style norms as an offset from 1 (the Hugging Face
    layout, which mlx-lm's sanitize shifts by +1): its conv1d weights are (C, 1, K), not mlx's (C, K, 1)."""
    for f in weight_files(path):
        try:
            for k, v in safetensors_header(f).items():
                if "conv1d.weight" in k:
                    return v["shape"][-1] != 1
        except (OSError, ValueError, KeyError):
            continue
    return True


def _load_tensors(keys: dict[str, Path]) -> dict[str, mx.array]:
    out = {}
    for f in sorted(set(keys.values())):
        tensors = mx.load(str(f))
        out.update({k: v for k, v in tensors.items() if k in keys})
    return out


def _stack_experts(w: dict[str, mx.array]) -> dict[str, mx.array]:
    """Hugging Face expert weights (one per expert, or gate_up fused) -> mlx-lm's switch_mlp stacks."""
    out = {k: v for k, v in w.items() if ".experts." not in k}
    if "mlp.experts.gate_up_proj" in w:  # Qwen3.5-MoE: (E, 2I, D) fused
        gate_up = w["mlp.experts.gate_up_proj"]
        mid = gate_up.shape[-2] // 2
        out["mlp.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        out["mlp.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        out["mlp.switch_mlp.down_proj.weight"] = w["mlp.experts.down_proj"]
        return out
    n = len({k.split(".")[2] for k in w if k.startswith("mlp.experts.")})
    for part in ("gate_proj", "up_proj", "down_proj"):
        for kind in ("weight", "scales", "biases"):
            if f"mlp.experts.0.{part}.{kind}" in w:
                out[f"mlp.switch_mlp.{part}.{kind}"] = mx.stack([w[f"mlp.experts.{e}.{part}.{kind}"] for e in range(n)])
    return out


class MTPBody(nn.Module):
    """The paged part of an MTP draft: its decoder layer(s), fed the fused input x.

    Called with token ids alone (the paged runner's probe) it embeds them with the target's table.
    """

    def __init__(self, layers: list, embed_tokens):
        super().__init__()
        self.layers = layers
        self.embed_tokens = embed_tokens  # the target's, shared

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None) -> mx.array:
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        cache = cache if cache is not None else [None] * len(self.layers)
        mask = self._mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return h

    def _mask(self, h: mx.array, cache):
        """The mask the layer's own model body would build: its module's create_attention_mask (which
        macinfer.kv.attention_variants may have routed to the paged cache), with an array where its
        attention asks for one (MLA)."""
        from mlx_lm.models import base

        fn = getattr(sys.modules.get(type(self.layers[0]).__module__), "create_attention_mask",
                     base.create_attention_mask)
        arrays = getattr(getattr(self.layers[0], "self_attn", None), "mask_arrays", False)
        return fn(h, cache, return_array=arrays) if arrays else fn(h, cache)


class MTPDraft(nn.Module):
    """One MTP layer with its input fusion and head (module docstring); the feature-draft interface
    of macinfer.spec_decode.feature_draft.FeatureDrafter."""

    def __init__(self, style: str, layer, embed_tokens, head: nn.Module | None, dim: int, eps: float):
        super().__init__()
        self.style = style  # "qwen" or "deepseek"
        self.model = MTPBody([layer], embed_tokens)
        self.fc = nn.Linear(2 * dim, dim, bias=False)  # mtp.fc / eh_proj
        self.norm_embedding = nn.RMSNorm(dim, eps=eps)  # pre_fc_norm_embedding / enorm
        self.norm_hidden = nn.RMSNorm(dim, eps=eps)  # pre_fc_norm_hidden / hnorm
        self.norm = nn.RMSNorm(dim, eps=eps)  # mtp.norm / shared_head.norm
        # (D) -> (V): DeepSeek's shared_head.head, the target's untied lm_head, or None: its tied embedding.
        if head is not None:
            self.lm_head = head

    body = property(lambda self: self.model)
    vocab = None  # the whole vocabulary

    def features(self, hidden: mx.array) -> mx.array:
        return hidden

    def __call__(self, tokens: mx.array, feats: mx.array, cache=None) -> mx.array:
        e = self.model.embed_tokens(tokens)
        x = self.fc(mx.concatenate([self.norm_embedding(e), self.norm_hidden(feats.astype(e.dtype))], axis=-1))
        h = self.model(tokens, cache, input_embeddings=x)
        return self.norm(h) if self.style == "qwen" else h

    def logits(self, fhat: mx.array) -> mx.array:
        x = fhat if self.style == "qwen" else self.norm(fhat)
        return self.lm_head(x) if "lm_head" in self else self.model.embed_tokens.as_linear(x)


# Where each MTP-level tensor goes, per layout: checkpoint suffix -> MTPDraft parameter.
_TOP = {
    "qwen": {"fc.weight": "fc.weight", "pre_fc_norm_embedding.weight": "norm_embedding.weight",
             "pre_fc_norm_hidden.weight": "norm_hidden.weight", "norm.weight": "norm.weight"},
    "deepseek": {"eh_proj.weight": "fc.weight", "enorm.weight": "norm_embedding.weight",
                 "hnorm.weight": "norm_hidden.weight", "shared_head.norm.weight": "norm.weight"},
}
_QWEN_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")


def _split(style: str, raw: dict[str, mx.array], prefix: str) -> tuple[dict, dict, mx.array | None]:
    """(MTPDraft top-level weights, the decoder layer's weights, DeepSeek's shared head or None)."""
    strip = {k[len(prefix):]: v for k, v in raw.items()}
    if style == "qwen":
        layer = {k[len("layers.0."):]: v for k, v in strip.items() if k.startswith("layers.0.")}
    else:
        layer = {k: v for k, v in strip.items() if k.startswith(DECODER_PARTS)}
    top = {dst: strip[src] for src, dst in _TOP[style].items() if src in strip}
    return top, layer, strip.get("shared_head.head.weight")


def _sanitize_deepseek(target, layer: dict[str, mx.array]) -> dict[str, mx.array]:
    """The target's own sanitize on the layer renamed to index 0 (expert stacking, fp8 and MLA splits)."""
    named = {f"model.layers.0.{k}": v for k, v in layer.items()}
    sanitize = getattr(target, "sanitize", None)
    out = sanitize(named) if sanitize is not None else named
    return {k[len("model.layers.0."):]: v for k, v in out.items() if k.startswith("model.layers.0.")}


def _build_layer(target, weights: dict[str, mx.array], first: int, model_type: str):
    """The target's decoder layer class at the first index whose parameters are exactly `weights`' names."""
    from mlx.utils import tree_flatten

    lm = getattr(target, "language_model", target)
    layers = lm.model.layers
    args = lm.args
    cls = type(layers[0])
    n = len(layers)
    want = set(weights)
    for idx in [first] + list(range(n + 8)):
        try:
            layer = cls(args, idx)
        except Exception:  # noqa: BLE001 - an index this class cannot build
            continue
        if getattr(layer, "is_linear", False):
            continue
        if {k for k, _ in tree_flatten(layer.parameters())} == want:
            return layer
    raise MacinferError(f"{model_type}: its MTP weights do not fit any {cls.__name__} "
                        f"({len(want)} tensors, e.g. {sorted(want)[0] if want else 'none'})")


def load_mtp(target, path: Path, config: dict, name: str = "model") -> MTPDraft:
    """The MTP draft of a loaded target from its checkpoint directory.

    Args:
        target: the loaded mlx-lm model (its embedding, head, decoder class and sanitize are used).
        path: the checkpoint directory it was loaded from.
        config: its config.json.
        name: the model's name, for messages.

    Raises:
        MissingMTP: the config promises MTP layers the weight files do not hold.
        MacinferError: the family has no MTP layout here, or the weights do not fit it (one line).
    """
    model_type = config.get("model_type", "?")
    if model_type not in QWEN + DEEPSEEK:
        raise MacinferError(f"{name}: {model_type} has no MTP layers macinfer can run "
                            f"(supported: {', '.join(QWEN + DEEPSEEK)})")
    keys = mtp_keys(path, config)
    if not keys:
        raise MissingMTP(f"{name}: its config promises {promised_layers(config)} MTP layer(s) but the weight "
                         "files hold none (a conversion that dropped them?): use the original checkpoint")
    style = "qwen" if model_type in QWEN else "deepseek"
    prefix = _prefix(config)
    try:
        raw = _load_tensors(keys)
    except (OSError, ValueError, RuntimeError) as e:
        raise MacinferError(f"{name}: could not read its MTP weights ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    top, layer_w, shared_head = _split(style, raw, prefix)
    missing = [k for k in _TOP[style].values() if k not in top]
    if missing or not layer_w:
        raise MissingMTP(f"{name}: its MTP weights are incomplete ({missing[0] if missing else 'no decoder layer'} "
                         "missing): use the original checkpoint")
    if style == "qwen":
        layer_w = _stack_experts(layer_w)
        if _hf_norms(path):  # zero-centred norms, as mlx-lm's sanitize shifts the target's
            layer_w = {k: v + 1.0 if k.endswith(_QWEN_NORMS) and v.ndim == 1 else v for k, v in layer_w.items()}
            top = {k: v + 1.0 if k.startswith("norm") else v for k, v in top.items()}
    else:
        layer_w = _sanitize_deepseek(target, layer_w)
    text = _text(config)
    layer = _build_layer(target, layer_w, int(text["num_hidden_layers"]), model_type)
    embed, head = embedding_and_head(target)
    if shared_head is not None:
        head = nn.Linear(shared_head.shape[1], shared_head.shape[0], bias=False)
        head.weight = shared_head
    dim = int(text["hidden_size"])
    draft = MTPDraft(style, layer, embed, head, dim, float(text.get("rms_norm_eps") or 1e-6))
    try:
        layer.load_weights(list(layer_w.items()), strict=True)
        draft.load_weights([(k, v) for k, v in top.items()], strict=False)
    except ValueError as e:
        raise MacinferError(f"{name}: its MTP weights do not fit ({' '.join(str(e).split())[:160]})") from None
    fit_for_cpu(draft)
    mx.eval(draft.parameters())
    return draft
