"""GGUF architectures -> mlx-lm models: config.json, tensor names and the value layouts that differ.

This is the part of GGUF import that is ours: what llama.cpp's convert_hf_to_gguf.py did to a
Hugging Face checkpoint, undone, so the mlx-lm model of the same family loads it.

- config.json: the `<arch>.*` metadata under the Hugging Face / mlx-lm names (`hf_config`).
- Tensor names: the mlx-lm model is built from that config without weights (lazy arrays,
  never evaluated) and each of its parameters is looked up in the `gguf` package's own
  name table (`gguf.get_tensor_name_map`), which maps Hugging Face names to GGUF ones; its
  inverse is the map we need (`tensor_names`).
- Values: llama.cpp permutes attn_q / attn_k rows of the llama-lineage families (llama,
  mistral as llama, granite) for its RoPE layout; Gemma's norms are stored as 1 + w;
  Llama 3.x and Phi-3 rope scaling live in tensors (rope_freqs, rope_factors_*).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from macinfer.errors import MacinferError
from macinfer.modelio.gguf_file import GGUFFile

ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# A vision tower and projector inside the model file (Ollama's Gemma 3 blobs): the text model is converted alone.
VISION_PREFIXES = ("v.", "mm.")


@dataclass(frozen=True)
class Family:
    """How one GGUF architecture maps onto an mlx-lm model."""

    model_type: str
    extra: Callable[[GGUFFile, dict], dict]  # family keys, from the metadata and the common config
    permute_qk: bool = False  # llama.cpp's LlamaModel.permute on attn_q / attn_k rows
    norm_plus_one: bool = False  # Gemma: every *norm.weight is stored as 1 + w


def _none(f: GGUFFile, c: dict) -> dict:
    return {}


def _llama(f: GGUFFile, c: dict) -> dict:
    return {"attention_bias": "blk.0.attn_q.bias" in f.tensors, "mlp_bias": False, **_rope_scaling(f)}


def _granite(f: GGUFFile, c: dict) -> dict:
    return {**_llama(f, c), "embedding_multiplier": _num(f.arch_key("embedding_scale", 1.0)),
            "residual_multiplier": _num(f.arch_key("residual_scale", 1.0)),
            "attention_multiplier": _num(f.arch_key("attention.scale", c["head_dim"] ** -0.5)),
            "logits_scaling": _num(f.arch_key("logit_scale", 1.0))}


def _moe(f: GGUFFile, c: dict) -> dict:
    return {"num_experts": int(f.arch_key("expert_count")), "num_experts_per_tok": int(f.arch_key("expert_used_count")),
            "moe_intermediate_size": int(f.arch_key("expert_feed_forward_length", c["intermediate_size"]))}


def _qwen2moe(f: GGUFFile, c: dict) -> dict:
    shared = f.arch_key("expert_shared_feed_forward_length")
    if shared is None and "blk.0.ffn_up_shexp.weight" in f.tensors:
        shared = f.tensors["blk.0.ffn_up_shexp.weight"].shape[0]
    return {**_moe(f, c), "shared_expert_intermediate_size": int(shared or 0), **_rope_scaling(f)}


def _qwen3moe(f: GGUFFile, c: dict) -> dict:
    return {**_moe(f, c), "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, **_rope_scaling(f)}


def _gemma_scalar(f: GGUFFile, c: dict, big_layers: int) -> int:
    # llama.cpp scales queries by 1/sqrt(n_embd / n_head) for the 27B models, 1/sqrt(head_dim) otherwise.
    return int(c["hidden_size"] // c["num_attention_heads"] if c["num_hidden_layers"] == big_layers else c["head_dim"])


def _gemma2(f: GGUFFile, c: dict) -> dict:
    return {"attn_logit_softcapping": _num(f.arch_key("attn_logit_softcapping", 50.0)),
            "final_logit_softcapping": _num(f.arch_key("final_logit_softcapping", 30.0)),
            "query_pre_attn_scalar": _gemma_scalar(f, c, 46)}


def _gemma3(f: GGUFFile, c: dict) -> dict:
    out = {"sliding_window": int(f.arch_key("attention.sliding_window", 512)), "sliding_window_pattern": 6,
           "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": _gemma_scalar(f, c, 62)}
    if f.arch_key("rope.scaling.type") == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": _num(f.arch_key("rope.scaling.factor", 1.0))}
    return out


def _phi3(f: GGUFFile, c: dict) -> dict:
    out = {"partial_rotary_factor": int(f.arch_key("rope.dimension_count", c["head_dim"])) / c["head_dim"],
           "original_max_position_embeddings": int(f.arch_key("rope.scaling.original_context_length",
                                                              c["max_position_embeddings"]))}
    if "rope_factors_long.weight" in f.tensors:
        out["rope_scaling"] = {"type": "longrope",
                               "long_factor": _floats(f.tensors["rope_factors_long.weight"]),
                               "short_factor": _floats(f.tensors["rope_factors_short.weight"])}
    return out


def _starcoder2(f: GGUFFile, c: dict) -> dict:
    return {"norm_epsilon": _num(f.arch_key("attention.layer_norm_epsilon", 1e-5))}


def _gpt_oss(f: GGUFFile, c: dict) -> dict:
    n = c["num_hidden_layers"]
    out = {"num_local_experts": int(f.arch_key("expert_count")),
           "num_experts_per_tok": int(f.arch_key("expert_used_count")),
           "intermediate_size": int(f.arch_key("expert_feed_forward_length", c["intermediate_size"])),
           "sliding_window": int(f.arch_key("attention.sliding_window", 128)),
           "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]}
    if f.arch_key("rope.scaling.type") == "yarn":
        original = int(f.arch_key("rope.scaling.original_context_length", 4096))
        out["rope_scaling"] = {"rope_type": "yarn", "factor": _num(f.arch_key("rope.scaling.factor", 1.0)),
                               "original_max_position_embeddings": original, "beta_fast": 32.0, "beta_slow": 1.0}
    return out


FAMILIES = {
    "llama": Family("llama", _llama, permute_qk=True),
    "granite": Family("granite", _granite, permute_qk=True),
    "qwen2": Family("qwen2", lambda f, c: _rope_scaling(f)),
    "qwen2moe": Family("qwen2_moe", _qwen2moe),
    "qwen3": Family("qwen3", lambda f, c: _rope_scaling(f)),
    "qwen3moe": Family("qwen3_moe", _qwen3moe),
    "gemma": Family("gemma", _none, norm_plus_one=True),
    "gemma2": Family("gemma2", _gemma2, norm_plus_one=True),
    "gemma3": Family("gemma3_text", _gemma3, norm_plus_one=True),
    "phi3": Family("phi3", _phi3),
    "olmo2": Family("olmo2", lambda f, c: _rope_scaling(f)),
    "starcoder2": Family("starcoder2", _starcoder2),
    "gpt-oss": Family("gpt_oss", _gpt_oss),
}


def family(f: GGUFFile) -> Family:
    """The Family of the file's general.architecture, or a one-line refusal naming it."""
    arch = f.architecture
    if arch not in FAMILIES:
        raise MacinferError(f"{f.path}: GGUF architecture '{arch}' is not supported (supported: "
                            f"{', '.join(FAMILIES)}): use an MLX or Hugging Face model directory instead")
    return FAMILIES[arch]


def hf_config(f: GGUFFile) -> dict:
    """config.json for the mlx-lm model of the file's family (metadata checked by check_metadata)."""
    fam = family(f)
    heads = int(f.arch_key("attention.head_count"))
    hidden = int(f.arch_key("embedding_length"))
    embed = f.tensors.get("token_embd.weight")
    vocab = embed.shape[0] if embed is not None else len(f.metadata.get("tokenizer.ggml.tokens", []))
    config = {
        "model_type": fam.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(f.arch_key("block_count")),
        "intermediate_size": int(f.arch_key("feed_forward_length", 0) or f.arch_key("expert_feed_forward_length", 0)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(f.arch_key("attention.head_count_kv", heads)),
        "head_dim": int(f.arch_key("attention.key_length", hidden // heads)),
        "rms_norm_eps": _num(f.arch_key("attention.layer_norm_rms_epsilon",
                                        f.arch_key("attention.layer_norm_epsilon", 1e-5))),
        "rope_theta": _num(f.arch_key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(f.arch_key("context_length", 4096)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in f.tensors,
    }
    config.update(fam.extra(f, config))
    md = f.metadata
    eos = [md[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in md]
    if eos:
        config["eos_token_id"] = eos[0] if len(set(eos)) == 1 else sorted(set(eos))
    if "tokenizer.ggml.bos_token_id" in md:
        config["bos_token_id"] = md["tokenizer.ggml.bos_token_id"]
    return config


def _rope_scaling(f: GGUFFile) -> dict:
    """Linear or YaRN rope scaling from the metadata; Llama 3's lives in rope_freqs (see llama3_rope_scaling)."""
    kind = f.arch_key("rope.scaling.type")
    if kind in (None, "none"):
        return {}
    factor = _num(f.arch_key("rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_scaling": {"rope_type": "linear", "factor": factor}}
    if kind == "yarn":
        return {"rope_scaling": {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings":
                                 int(f.arch_key("rope.scaling.original_context_length", 4096))}}
    raise MacinferError(f"{f.path}: rope scaling '{kind}' is not supported")


def llama3_rope_scaling(src: Path, factors: np.ndarray, config: dict) -> dict:
    """Recover HF's `rope_scaling` (rope_type llama3) from llama.cpp's rope_freqs tensor.

    GGUF keeps only the per-frequency divisors; every Llama 3.x uses low/high
    frequency factors 1 and 4 over an original context of 8192, so we rebuild
    those parameters and check they reproduce the stored divisors.
    """
    factors = np.asarray(factors, dtype=np.float64)
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    dims = config["head_dim"]
    # llama.cpp's convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors:
    freqs = 1.0 / config["rope_theta"] ** (np.arange(0, dims, 2) / dims)
    wavelen = 2 * np.pi / freqs
    old, low, high, factor = 8192, 1.0, 4.0, scaling["factor"]
    smooth = (old / wavelen - low) / (high - low)
    expected = np.where(wavelen < old / high, 1.0,
                        np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-4):
        raise MacinferError(f"{src}: its rope_freqs are not Llama 3 rope scaling: unsupported rope variant")
    return scaling


def tensor_names(f: GGUFFile, config: dict) -> dict[str, str]:
    """GGUF tensor name -> mlx-lm parameter name, for every tensor the file holds.

    Raises:
        MacinferError: a tensor the family's mlx-lm model has no place for, or a parameter
            of that model the file lacks (both named).
    """
    import gguf

    params = _model_parameters(config)
    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[f.architecture]
    table = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    names = {}
    for p in params:
        base, _, suffix = p.rpartition(".")
        lookup = base.replace(".switch_mlp.", ".experts.")
        found = table.get_name(lookup)
        if found is None and base.endswith("self_attn") and suffix == "sinks":
            found, suffix = table.get_name(base + ".o_proj").replace("attn_output", "attn_sinks"), "weight"
        if found is not None:
            names[f"{found}.{suffix}"] = p
    for name in f.tensors:
        if name not in names and name not in ROPE_TENSORS and not name.startswith(VISION_PREFIXES):
            raise MacinferError(f"{f.path}: tensor '{name}' has no place in mlx-lm's {config['model_type']} model: "
                                "the file is not a standard export of its architecture")
    mapped = {names[n] for n in f.tensors if n in names}
    tied = config["tie_word_embeddings"]
    missing = sorted(p for p in params if p not in mapped and not (tied and p.startswith("lm_head.")))
    if missing:
        raise MacinferError(f"{f.path}: its {config['model_type']} model lacks {len(missing)} tensors "
                            f"(e.g. {missing[0]}): the file is incomplete or not a standard export")
    return {n: names[n] for n in f.tensors if n in names}


def _model_parameters(config: dict) -> list[str]:
    """The parameter names of mlx-lm's model for `config`, built lazily (nothing is computed)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    with mx.stream(mx.cpu):
        model = model_cls(args_cls.from_dict(config))
    return [k for k, _ in tree_flatten(model.parameters())]


def transform(fam: Family, gguf_name: str, arrays: dict, config: dict) -> dict:
    """Undo llama.cpp's value changes on one tensor's MLX arrays (same keys back)."""
    import mlx.core as mx

    base = gguf_name.rpartition(".")[0]
    if fam.permute_qk and base.endswith(("attn_q", "attn_k")):
        heads = config["num_attention_heads"] if base.endswith("attn_q") else config["num_key_value_heads"]
        arrays = {k: _unpermute(v, heads) for k, v in arrays.items()}
    if fam.norm_plus_one and base.endswith("norm") and gguf_name.endswith(".weight"):
        arrays = {k: (v.astype(mx.float32) - 1).astype(v.dtype) for k, v in arrays.items()}
    return arrays


def _unpermute(w, n_head: int):
    """Undo llama.cpp's q/k row permutation (weight, scales, biases, bias alike).

    llama.cpp, per head, interleaves the two rotary halves:
        rows (head, half, i) -> (head, i, half), i < head_dim/2
    so the inverse reads rows as (head, i, half) and swaps back.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _num(x) -> float:
    # GGUF stores these as float32: 1e-5 reads back as 9.99999974e-06; write it as 1e-05.
    return float(f"{float(x):.7g}")


def _floats(t) -> list[float]:
    return [_num(v) for v in np.asarray(t.data, dtype=np.float32).ravel()]
