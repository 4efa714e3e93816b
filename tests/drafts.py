"""Tiny checkpoints with drafts in them, in the layouts the drafts are published in (nothing downloads).

- `mtp_checkpoint`: a Qwen3-Next or Qwen3.5 target written as its Hugging Face checkpoint is (experts
  one by one, conv1d (C, 1, K), norms stored as an offset from 1) with `mtp.*` tensors, or a GLM-4.7-Flash
  target (DeepSeek-V3's MLA attention and MTP layout: `model.layers.{N}.{enorm,hnorm,eh_proj,
  shared_head.*}` and the layer's own tensors, `kv_b_proj` unsplit, experts one by one). Key names
  and the config keys (`num_nextn_predict_layers`) as in vLLM's qwen3_next_mtp.py / deepseek_mtp.py
  and the published config.json files.
- `eagle3_draft`: an EAGLE-3 draft for a llama target, in vLLM speculators' layout
  (`transformer_layer_config`, `layers.0.*`, `embed_tokens`) or the EAGLE-3 authors' (`midlayer.*`),
  optionally with a smaller draft vocabulary (`d2t`, `t2d`).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from tiny import build_from_config, build_tiny_model

QWEN_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
              "language_model.norm.weight", ".q_norm.weight", ".k_norm.weight")


def _random(module, seed: int, scale: float = 3.0) -> dict[str, mx.array]:
    """Varied float32 weights for a module: matrices N(0, scale^2 / fan_in), vectors near 1."""
    mx.random.seed(seed)
    out = {}
    for k, v in tree_flatten(module.parameters()):
        if v.ndim >= 2:
            fan_in = 1
            for s in v.shape[1:]:
                fan_in *= s
            v = mx.random.normal(v.shape) * (scale / fan_in ** 0.5)
        elif k.endswith("weight"):
            v = 1.0 + 0.1 * mx.random.normal(v.shape)
        out[k] = v.astype(mx.float32)
    return out


def _unstack_experts(w: dict[str, mx.array]) -> dict[str, mx.array]:
    out = {}
    for k, v in w.items():
        if ".switch_mlp." in k:
            pre, post = k.split(".switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{pre}.experts.{e}.{post}"] = v[e]
        else:
            out[k] = v
    return out


def _qwen_hf(w: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm qwen3_next weights -> the Hugging Face checkpoint's (the inverse of its sanitize)."""
    out = {}
    for k, v in _unstack_experts(w).items():
        if "conv1d.weight" in k:
            v = v.moveaxis(1, 2)  # (C, K, 1) -> (C, 1, K)
        if k.endswith(QWEN_NORMS) and v.ndim == 1:
            v = v - 1.0
        out[k] = v
    return out


def _mla_hf(w: dict[str, mx.array], cfg: dict) -> dict[str, mx.array]:
    """embed_q / unembed_out -> the kv_b_proj the checkpoint stores (the inverse of sanitize's split)."""
    out = {}
    for k, v in w.items():
        if k.endswith("self_attn.embed_q.weight"):
            wk, wv = v, w[k.replace("embed_q", "unembed_out")]  # (H, r, nope), (H, v_dim, r)
            kv = mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1)
            out[k.replace("embed_q.weight", "kv_b_proj.weight")] = kv.reshape(-1, kv.shape[-1])
        elif not k.endswith("self_attn.unembed_out.weight"):
            out[k] = v
    return out


def mtp_checkpoint(out: Path, family: str, config: dict, seed: int = 0, with_mtp: bool = True) -> Path:
    """A target of `family` ("qwen3_next", "qwen3_5" or "glm4_moe_lite") with one MTP layer, as published.

    with_mtp=False writes the config's promise (num_nextn_predict_layers / mtp_num_hidden_layers: 1)
    without the tensors.
    """
    from mlx_lm.utils import _get_classes

    out = Path(out)
    if family == "qwen3_5":  # Qwen3.5 keeps its text model's settings, the MTP count among them, in text_config
        config = {**config, "text_config": {**config["text_config"], "mtp_num_hidden_layers": 1}}
    else:
        config = {**config, "num_nextn_predict_layers": 1}
    if family.startswith("qwen"):
        build_tiny_model(out, "llama", seed=seed, **config)
    else:
        build_from_config(out, config, seed=seed)
    config = json.loads((out / "config.json").read_text())
    w = dict(mx.load(str(out / "model.safetensors")))
    text = config.get("text_config", config)
    model_cls, args_cls = _get_classes(config)
    args = args_cls.from_dict(config)
    n = int(text["num_hidden_layers"])
    H = int(text["hidden_size"])
    if family.startswith("qwen"):
        if family == "qwen3_next":
            from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer as Layer
        else:  # mlx-lm's language_model.model.* is the checkpoint's model.language_model.*
            from mlx_lm.models.qwen3_5 import DecoderLayer as Layer, TextModelArgs

            args = TextModelArgs.from_dict(text)
            w = {k.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head", "lm_head"): v
                 for k, v in w.items()}
        w = _qwen_hf(w)
        layer = _random(Layer(args, text["full_attention_interval"] - 1), seed + 1)
        mtp = _qwen_hf({f"mtp.layers.0.{k}": v for k, v in layer.items()})
        mx.random.seed(seed + 2)
        mtp["mtp.fc.weight"] = mx.random.normal((H, 2 * H)) * (3 / (2 * H) ** 0.5)
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            mtp[f"mtp.{name}.weight"] = 0.1 * mx.random.normal((H,))  # stored as an offset from 1
    else:
        from mlx_lm.models.glm4_moe_lite import Glm4MoeLiteDecoderLayer

        layer = _random(Glm4MoeLiteDecoderLayer(args, n), seed + 1)
        layer = _mla_hf(_unstack_experts(layer), config)
        p = f"model.layers.{n}."
        mtp = {p + k: v for k, v in layer.items()}
        mx.random.seed(seed + 2)
        V = int(config["vocab_size"])
        mtp[p + "eh_proj.weight"] = mx.random.normal((H, 2 * H)) * (3 / (2 * H) ** 0.5)
        mtp[p + "shared_head.head.weight"] = mx.random.normal((V, H)) * (3 / H ** 0.5)
        mtp[p + "embed_tokens.weight"] = w["model.embed_tokens.weight"]
        for name in ("enorm", "hnorm", "shared_head.norm"):
            mtp[p + f"{name}.weight"] = 1.0 + 0.1 * mx.random.normal((H,))
    if with_mtp:
        w.update({k: v.astype(mx.float32) for k, v in mtp.items()})
    mx.save_safetensors(str(out / "model.safetensors"), w, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def eagle3_draft(out: Path, target: Path, layout: str = "speculators", draft_vocab: int | None = None,
                 layer_ids: list[int] | None = None, seed: int = 0) -> Path:
    """An EAGLE-3 draft for the llama target at `target` (module docstring)."""
    from mlx_lm.models import llama

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tcfg = json.loads((target / "config.json").read_text())
    V, H = tcfg["vocab_size"], tcfg["hidden_size"]
    layer_cfg = {"model_type": "llama", "hidden_size": H, "intermediate_size": 2 * H, "num_hidden_layers": 1,
                 "num_attention_heads": tcfg["num_attention_heads"], "num_key_value_heads": tcfg["num_key_value_heads"],
                 "rms_norm_eps": 1e-5, "vocab_size": V, "rope_theta": tcfg.get("rope_theta", 10000.0),
                 "max_position_embeddings": tcfg["max_position_embeddings"], "tie_word_embeddings": False}
    args = llama.ModelArgs.from_dict(layer_cfg)
    attn, mlp = llama.Attention(args), llama.MLP(args)
    w = {f"self_attn.{k}": v for k, v in _random(attn, seed).items()}
    w.update({f"mlp.{k}": v for k, v in _random(mlp, seed + 1).items()})
    mx.random.seed(seed + 2)
    for proj in ("q_proj", "k_proj", "v_proj"):  # the first layer's attention reads [embedding, feature]
        rows = w[f"self_attn.{proj}.weight"].shape[0]
        w[f"self_attn.{proj}.weight"] = mx.random.normal((rows, 2 * H)) * (3 / (2 * H) ** 0.5)
    for norm in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
        w[f"{norm}.weight"] = 1.0 + 0.1 * mx.random.normal((H,))
    Nd = draft_vocab or V
    ids = sorted(mx.random.permutation(V)[:Nd].tolist()) if Nd < V else list(range(V))
    top = {"fc.weight": mx.random.normal((H, 3 * H)) * (3 / (3 * H) ** 0.5),
           "norm.weight": 1.0 + 0.1 * mx.random.normal((H,)),
           "lm_head.weight": mx.random.normal((Nd, H)) * (3 / H ** 0.5),
           "d2t": mx.array(ids, dtype=mx.int64) - mx.arange(Nd, dtype=mx.int64),
           "t2d": mx.array([i in set(ids) for i in range(V)])}
    prefix = "layers.0." if layout == "speculators" else "midlayer."
    tensors = {prefix + k: v for k, v in w.items()} | top
    if layout == "speculators":
        tensors["embed_tokens.weight"] = mx.load(str(target / "model.safetensors"))["model.embed_tokens.weight"]
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "transformer_layer_config": layer_cfg, "draft_vocab_size": Nd, "norm_before_residual": False,
                  "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": str(target)}}}
    else:
        config = {**layer_cfg, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": Nd}
    if layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = layer_ids
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out
