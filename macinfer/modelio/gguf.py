"""GGUF import: turn a llama-architecture GGUF file into an mlx-lm model directory.

The output is what `mlx_lm.load` expects: `config.json` (Hugging Face names, plus
mlx-lm's `quantization` section), `model.safetensors` (or shards + index) with
HF weight names, and a `tokenizer.json` / `tokenizer_config.json` rebuilt from the
GGUF metadata. Design choices:

- Weights are never dequantised. `mx.load` already returns Q4_0 / Q4_1 / Q8_0
  tensors as MLX affine triplets (packed uint32 weight, scales, biases; group 32),
  so a GGUF q4 model stays a q4 MLX model. F32 / F16 stay float. Dtypes are kept as
  stored (scales are often float16); the loader decides what to cast.
- `mx.load` silently dequantises other types (K-quants, BF16 ...) to float16, so
  the header is parsed first (`read_header`, macinfer.modelio.gguf_header) to see
  each tensor's real type and to refuse what is not supported, by name, before any
  work is done.
- llama.cpp permutes the rows of attn_q / attn_k for its RoPE layout; we apply the
  inverse to weight, scales and biases alike (quant groups run along columns, so a
  row permutation is exact).
- Llama 3.x rope scaling, which GGUF keeps only as a `rope_freqs` tensor, is
  turned back into HF's `rope_scaling` (rope_type llama3).
- Tokenizers: GPT-2 style byte-level BPE ('gpt2': tokens + merges, with the
  pre-tokenizers in PRE_TOKENIZERS) and SentencePiece BPE ('llama': merges derived
  from the scores, byte fallback), rebuilt in macinfer.modelio.gguf_tokenizer. Anything else
  is refused by name.
- The output is built in a staging directory next to `out` (macinfer.staging) and renamed into
  place: a crash leaves no half model behind.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from macinfer.errors import MacinferError
from macinfer.modelio.gguf_header import BLOCK_LAYOUT, GGUFHeader, read_header
from macinfer.modelio.gguf_metadata import check_metadata
from macinfer.modelio.gguf_tokenizer import check_tokenizer, write_tokenizer
from macinfer.staging import remove_stale_partials, staging_dir

Progress = Callable[[int, int, str], None]

QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+ rope scaling, stored as per-frequency factors
GROUP_SIZE = 32  # every GGUF type we accept quantises blocks of 32 along a row
MAX_SHARD_BYTES = 5 << 30  # mlx-lm's shard size

# llama.cpp tensor name -> Hugging Face / mlx-lm name (per layer: after "blk.N.").
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def convert_gguf(src: str | Path, out: str | Path, progress: Progress | None = None) -> Path:
    """Convert a llama-architecture GGUF file into an mlx-lm model directory.

    Args:
        src: the .gguf file (Q4_0, Q4_1, Q8_0, F16 and F32 tensors).
        out: the directory to create; it must not exist yet (or be empty).
        progress: called as progress(done, total, what) while converting;
            the last call has done == total.

    Returns:
        `out`, a directory `mlx_lm.load` accepts.

    Raises:
        MacinferError: missing / non-GGUF / truncated file, an architecture other
            than llama, an unsupported tensor type or tokenizer, or `out` exists.

    Example:
        >>> convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-mlx")
        PosixPath('smollm2-mlx')
    """
    src, out = Path(src), Path(out)
    progress = progress or (lambda done, total, what: None)
    header = read_header(src)
    _check_supported(src, header)
    config = _config(src, header)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MacinferError(f"{out} already exists: remove it or choose another output directory")
    gguf_weights = _load_tensors(src, header)
    if ROPE_FREQS in gguf_weights:
        config["rope_scaling"] = _llama3_rope_scaling(src, gguf_weights.pop(ROPE_FREQS), config)
    n_steps = len(gguf_weights) + 2
    weights, quant = _hf_weights(src, header, gguf_weights, config, lambda i, name: progress(i, n_steps, name))
    if quant:
        config["quantization"] = _quantization_section(quant)
        config["quantization_config"] = config["quantization"]
    _write_model(out, header.metadata, config, weights, lambda i, what: progress(n_steps - 2 + i, n_steps, what))
    progress(n_steps, n_steps, "done")
    return out


def _load_tensors(src: Path, header: GGUFHeader) -> dict:
    """Every tensor of the file as mx.load returns it (Q4_0 / Q4_1 / Q8_0 as affine triplets)."""
    import mlx.core as mx

    if header.data_end > src.stat().st_size:
        raise MacinferError(
            f"{src} is truncated ({src.stat().st_size} of {header.data_end} bytes): download or export it again"
        )
    try:
        return mx.load(str(src))
    except (RuntimeError, ValueError) as e:  # mlx raises these for corrupt / short files
        msg = str(e).replace("[load_gguf] ", "").splitlines()[0]
        raise MacinferError(f"{src} is not a readable GGUF file ({msg}): download or export it again") from None


def _hf_weights(src: Path, header: GGUFHeader, gguf_weights: dict, config: dict,
                progress: Callable[[int, str], None]) -> tuple[dict, dict[str, int]]:
    """GGUF tensors under Hugging Face names, q/k rows unpermuted; (weights, bits per quantised module)."""
    weights, quant = {}, {}
    for i, (name, w) in enumerate(sorted(gguf_weights.items())):
        progress(i, name)
        base, _, suffix = name.rpartition(".")  # "blk.0.attn_q", "weight" | "scales" | "biases" | "bias"
        hf = _hf_name(src, base)
        if base.endswith(("attn_q", "attn_k")):
            heads = config["num_attention_heads"] if base.endswith("attn_q") else config["num_key_value_heads"]
            w = _unpermute(w, heads)
        weights[f"{hf}.{suffix}"] = w
        if suffix == "weight" and base + ".scales" in gguf_weights:
            quant[hf] = QUANT_BITS[header.tensor_types[name]]
    return weights, quant


def _write_model(out: Path, md: dict, config: dict, weights: dict, progress: Callable[[int, str], None]) -> None:
    """Tokenizer, config and weights into a hidden sibling of `out`, renamed into place when complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)  # left by a killed conversion
    tmp = staging_dir(out)
    try:
        progress(0, "tokenizer")
        write_tokenizer(md, tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        progress(1, "writing weights")
        _save_weights(weights, tmp)
        if out.exists():
            out.rmdir()  # empty (checked above); os.replace cannot replace a directory otherwise
        os.replace(tmp, out)
    except (OSError, RuntimeError) as e:  # RuntimeError: mlx failing to write (disk full ...)
        shutil.rmtree(tmp, ignore_errors=True)
        if (out / "config.json").exists():  # someone else renamed a finished model into place first
            raise MacinferError(f"{out} already exists: remove it or choose another output directory") from None
        raise MacinferError(f"could not write {out}: {getattr(e, 'strerror', None) or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_supported(src: Path, header: GGUFHeader) -> None:
    md = header.metadata
    arch = md.get("general.architecture")
    if arch != "llama":
        raise MacinferError(
            f"{src}: GGUF architecture '{arch}' is not supported (only 'llama', which covers "
            "Llama, Mistral and SmolLM): use an MLX or Hugging Face model directory instead"
        )
    if md.get("llama.expert_count"):
        raise MacinferError(f"{src}: mixture-of-experts llama GGUF (Mixtral style) is not supported")
    check_metadata(src, md)
    for name, tname in header.tensor_types.items():
        if name != ROPE_FREQS:
            _hf_name(src, name.rpartition(".")[0])  # raises for tensors llama does not have
        if tname not in BLOCK_LAYOUT:
            raise MacinferError(
                f"{src}: tensor '{name}' has type {tname}, which is not supported "
                f"(supported: {', '.join(BLOCK_LAYOUT)}): use a Q4_0/Q4_1/Q8_0/F16 GGUF instead"
            )
    check_tokenizer(src, md)


def _hf_name(src: Path, base: str) -> str:
    if base in _TOP_NAMES:
        return _TOP_NAMES[base]
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise MacinferError(f"{src}: tensor '{base}' is not part of a llama model this converter supports")


def _unpermute(w, n_head: int):
    """Undo llama.cpp's q/k row permutation (works for weight, scales, biases, bias).

    llama.cpp, per head, interleaves the two rotary halves:
        rows (head, half, i) -> (head, i, half), i < head_dim/2
    so the inverse reads rows as (head, i, half) and swaps back.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(src: Path, header: GGUFHeader) -> dict:
    """config.json (Hugging Face LlamaConfig names) from the llama.* metadata."""
    md = header.metadata

    def get(key, default=None):
        return md.get(f"llama.{key}", default)

    # NOTE: types and ranges were checked by check_metadata (_check_supported).
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    # The embedding's rows are the truth; llama.cpp may pad the token list differently.
    rows = header.tensor_shapes.get("token_embd.weight", (0,))[-1]
    vocab = rows or get("vocab_size") or len(md["tokenizer.ggml.tokens"])
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise MacinferError(f"{src}: partial rotary embeddings (rope.dimension_count != head_dim) are not supported")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in header.tensor_types,
        "attention_bias": "blk.0.attn_q.bias" in header.tensor_types,
        "mlp_bias": False,
    }
    if get("rope.scaling.type") == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
    elif get("rope.scaling.type") not in (None, "none"):
        raise MacinferError(f"{src}: rope scaling '{get('rope.scaling.type')}' is not supported")
    eos = [md[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in md]
    if eos:
        config["eos_token_id"] = eos[0] if len(set(eos)) == 1 else sorted(set(eos))
    if "tokenizer.ggml.bos_token_id" in md:
        config["bos_token_id"] = md["tokenizer.ggml.bos_token_id"]
    return config


def _llama3_rope_scaling(src: Path, factors, config: dict) -> dict:
    """Recover HF's `rope_scaling` (rope_type llama3) from llama.cpp's rope_freqs tensor.

    GGUF keeps only the per-frequency divisors; every Llama 3.x uses low/high
    frequency factors 1 and 4 over an original context of 8192, so we rebuild
    those parameters and check they reproduce the stored divisors exactly.
    """
    import mlx.core as mx
    import numpy as np

    factors = np.array(factors.astype(mx.float32), dtype=np.float64)
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


def _f32(x: float) -> float:
    # GGUF stores these as float32: 1e-5 reads back as 9.99999974e-06; print it as 1e-05.
    return float(f"{x:.7g}")


def _quantization_section(bits_by_module: dict[str, int]) -> dict:
    """mlx-lm's `quantization`: the commonest bit width, plus per-module overrides."""
    counts: dict[int, int] = {}
    for b in bits_by_module.values():
        counts[b] = counts.get(b, 0) + 1
    default = max(counts, key=lambda b: (counts[b], -b))
    section: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default, "mode": "affine"}
    for module, b in sorted(bits_by_module.items()):
        if b != default:
            section[module] = {"group_size": GROUP_SIZE, "bits": b, "mode": "affine"}
    return section


def _save_weights(weights: dict, out: Path) -> None:
    import mlx.core as mx

    shards: list[dict] = [{}]
    size = 0
    for k, v in weights.items():
        if shards[-1] and size + v.nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    if len(shards) == 1:
        mx.save_safetensors(str(out / "model.safetensors"), shards[0], metadata={"format": "mlx"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(out / fname), shard, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


