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
  the header is parsed here first (`read_header`) to see each tensor's real type
  and to refuse what is not supported, by name, before any work is done.
- llama.cpp permutes the rows of attn_q / attn_k for its RoPE layout; we apply the
  inverse to weight, scales and biases alike (quant groups run along columns, so a
  row permutation is exact).
- Llama 3.x rope scaling, which GGUF keeps only as a `rope_freqs` tensor, is
  turned back into HF's `rope_scaling` (rope_type llama3).
- Tokenizers: GPT-2 style byte-level BPE ('gpt2': tokens + merges, with the
  pre-tokenizers in PRE_TOKENIZERS) and SentencePiece BPE ('llama': merges derived
  from the scores, byte fallback). Anything else is refused by name.
- The output is built in a temporary directory next to `out` and renamed into
  place: a crash leaves no half model behind.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from macinfer.errors import MacinferError

Progress = Callable[[int, int, str], None]

GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
    22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}
# Supported type -> (bytes per block, elements per block); used to check file size.
BLOCK_LAYOUT = {"F32": (4, 1), "F16": (2, 1), "Q4_0": (18, 32), "Q4_1": (20, 32), "Q8_0": (34, 32)}
QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+ rope scaling, stored as per-frequency factors
GROUP_SIZE = 32  # every GGUF type we accept quantises blocks of 32 along a row
MAX_SHARD_BYTES = 5 << 30  # mlx-lm's shard size

# GGUF metadata value types -> struct format (8 = string, 9 = array).
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

# llama.cpp tensor name -> Hugging Face / mlx-lm name (per layer: after "blk.N.").
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


@dataclass
class GGUFHeader:
    """What a GGUF file declares before its tensor data."""

    version: int
    metadata: dict[str, Any]
    tensor_types: dict[str, str]  # tensor name -> GGML type name ("Q4_1", "F32", "type 99")
    tensor_shapes: dict[str, tuple[int, ...]]  # GGUF order: ne0 (columns) first
    data_end: int  # byte offset where the last tensor's data ends (supported types only)


class _Reader:
    """Little-endian cursor over the mapped file; running off the end means truncated."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        if self.pos + n > len(self.buf):
            raise struct.error("string past end of file")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            atype, n = self.scalar("I"), self.scalar("Q")
            if atype in _SCALAR:
                size = struct.calcsize(_SCALAR[atype])
                if self.pos + n * size > len(self.buf):
                    raise struct.error("array past end of file")
                values = list(struct.unpack_from(f"<{n}{_SCALAR[atype]}", self.buf, self.pos))
                self.pos += n * size
                return values
            if n > len(self.buf):  # each element takes at least a byte: corrupt count
                raise struct.error("array length larger than the file")
            return [self.value(atype) for _ in range(n)]
        raise ValueError(f"unknown metadata value type {vtype}")


def read_header(path: str | Path) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table (no tensor data is read).

    Raises:
        MacinferError: the file is missing, not GGUF, or its header is truncated.
    """
    path = Path(path)
    if path.is_dir():
        raise MacinferError(f"{path} is a directory, not a GGUF file")
    if not path.is_file():
        raise MacinferError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise MacinferError(f"{path} is empty, not a GGUF file: download or export it again")
        if os.fstat(f.fileno()).st_size < 24 or f.read(4) != b"GGUF":
            raise MacinferError(f"{path} is not a GGUF file (bad magic bytes): pass a .gguf model file")
        f.seek(0)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _parse(_Reader(buf), len(buf))
            except (struct.error, ValueError, OverflowError, MemoryError, RecursionError) as e:
                raise MacinferError(
                    f"{path} is a truncated or corrupt GGUF file ({e}): download or export it again"
                ) from None


def _parse(r: _Reader, file_size: int) -> GGUFHeader:
    r.pos = 4
    version = r.scalar("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}; only versions 2 and 3 are supported")
    n_tensors, n_kv = r.scalar("Q"), r.scalar("Q")
    if n_tensors > file_size or n_kv > file_size:
        raise ValueError("implausible tensor or metadata count")
    metadata = {}
    for _ in range(n_kv):
        key = r.string()
        metadata[key] = r.value(r.scalar("I"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.scalar("I")
        if n_dims > 8:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        shape = tuple(r.scalar("Q") for _ in range(n_dims))
        infos.append((name, shape, r.scalar("I"), r.scalar("Q")))
    alignment = int(metadata.get("general.alignment", 32)) or 32
    data_start = -(-r.pos // alignment) * alignment
    types, shapes, data_end = {}, {}, data_start
    for name, shape, ggml_type, offset in infos:
        tname = GGML_TYPES.get(ggml_type, f"type {ggml_type}")
        types[name], shapes[name] = tname, shape
        if tname in BLOCK_LAYOUT:
            block_bytes, block_elems = BLOCK_LAYOUT[tname]
            n = 1
            for d in shape:
                n *= d
            data_end = max(data_end, data_start + offset + n // block_elems * block_bytes)
    return GGUFHeader(version, metadata, types, shapes, data_end)


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
    md = header.metadata
    _check_supported(src, header)
    config = _config(src, header)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MacinferError(f"{out} already exists: remove it or choose another output directory")

    import mlx.core as mx

    if header.data_end > src.stat().st_size:
        raise MacinferError(
            f"{src} is truncated ({src.stat().st_size} of {header.data_end} bytes): download or export it again"
        )
    try:
        gguf_weights = mx.load(str(src))
    except (RuntimeError, ValueError) as e:  # mlx raises these for corrupt / short files
        msg = str(e).replace("[load_gguf] ", "").splitlines()[0]
        raise MacinferError(f"{src} is not a readable GGUF file ({msg}): download or export it again") from None

    if ROPE_FREQS in gguf_weights:
        config["rope_scaling"] = _llama3_rope_scaling(src, gguf_weights.pop(ROPE_FREQS), config)
    n_steps = len(gguf_weights) + 2
    weights, quant = {}, {}
    for i, (name, w) in enumerate(sorted(gguf_weights.items())):
        progress(i, n_steps, name)
        base, _, suffix = name.rpartition(".")  # "blk.0.attn_q", "weight" | "scales" | "biases" | "bias"
        hf = _hf_name(src, base)
        if base.endswith(("attn_q", "attn_k")):
            heads = config["num_attention_heads"] if base.endswith("attn_q") else config["num_key_value_heads"]
            w = _unpermute(w, heads)
        weights[f"{hf}.{suffix}"] = w
        if suffix == "weight" and base + ".scales" in gguf_weights:
            quant[hf] = QUANT_BITS[header.tensor_types[name]]
    if quant:
        config["quantization"] = _quantization_section(quant)
        config["quantization_config"] = config["quantization"]

    out.parent.mkdir(parents=True, exist_ok=True)
    # Hidden, unique sibling of `out` (same filesystem, so the final rename is atomic).
    tmp = out.parent / f".{out.name}.{os.getpid()}-{secrets.token_hex(4)}.partial"
    tmp.mkdir()
    try:
        progress(n_steps - 2, n_steps, "tokenizer")
        write_tokenizer(md, tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        progress(n_steps - 1, n_steps, "writing weights")
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
    progress(n_steps, n_steps, "done")
    return out


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
    for name, tname in header.tensor_types.items():
        if name != ROPE_FREQS:
            _hf_name(src, name.rpartition(".")[0])  # raises for tensors llama does not have
        if tname not in BLOCK_LAYOUT:
            raise MacinferError(
                f"{src}: tensor '{name}' has type {tname}, which is not supported "
                f"(supported: {', '.join(BLOCK_LAYOUT)}): use a Q4_0/Q4_1/Q8_0/F16 GGUF instead"
            )
    kind = md.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in md:
        raise MacinferError(f"{src} has no tokenizer in its metadata (tokenizer.ggml.*), which conversion needs")
    if kind not in ("gpt2", "llama"):
        raise MacinferError(f"{src}: GGUF tokenizer model '{kind}' is not supported (only 'gpt2' and 'llama')")
    if kind == "gpt2" and md.get("tokenizer.ggml.pre", "default") not in PRE_TOKENIZERS:
        raise MacinferError(
            f"{src}: GGUF pre-tokenizer '{md['tokenizer.ggml.pre']}' is not supported "
            f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )


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

    required = ("embedding_length", "block_count", "feed_forward_length", "attention.head_count")
    if missing := [f"llama.{k}" for k in required if not isinstance(get(k), int)]:
        raise MacinferError(f"{src} lacks required metadata {', '.join(missing)}: it is not a complete llama GGUF")
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


# ---------------------------------------------------------------------------------------
# Tokenizer: rebuilt from tokenizer.ggml.* as a Hugging Face fast tokenizer.

_GPT2_BYTELEVEL = "gpt2"
_DIGITS_BYTELEVEL = "digits"
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> how text is split before BPE (names as llama.cpp writes them).
PRE_TOKENIZERS = {
    "default": _GPT2_BYTELEVEL, "gpt2": _GPT2_BYTELEVEL, "gpt-2": _GPT2_BYTELEVEL,
    "smollm": _DIGITS_BYTELEVEL, "starcoder": _DIGITS_BYTELEVEL, "refact": _DIGITS_BYTELEVEL,
    "llama-bpe": _LLAMA3_RE, "llama3": _LLAMA3_RE, "qwen2": _QWEN2_RE,
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def write_tokenizer(md: dict, out: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json to `out`."""
    from tokenizers import AddedToken, Tokenizer, processors

    tokens: list[str] = md["tokenizer.ggml.tokens"]
    types: list[int] = md.get("tokenizer.ggml.token_type", [1] * len(tokens))
    tok: Tokenizer = _bpe_tokenizer(md) if md["tokenizer.ggml.model"] == "gpt2" else _spm_tokenizer(md)
    # Control tokens (<|im_end|> ...) must never be split by BPE; user-defined ones either.
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])

    def token(key):
        i = md.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos, unk, pad = token("bos"), token("eos"), token("unknown"), token("padding")
    # llama.cpp's defaults when the flag is absent: SentencePiece vocabularies add BOS, GPT-2 ones do not.
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", md["tokenizer.ggml.model"] == "llama"))
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, md["tokenizer.ggml.bos_token_id"])],
        )
    tok.save(str(out / "tokenizer.json"))

    special = {k: v for k, v in {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad}.items() if v}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(md.get("llama.context_length", 2048)),
    }
    if "tokenizer.chat_template" in md:
        config["chat_template"] = md["tokenizer.chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False))


def _bpe_tokenizer(md: dict):
    """GPT-2 style byte-level BPE (tokens and merges are stored in the GGUF)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = md["tokenizer.ggml.tokens"]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # NOTE: a few GGUFs repeat a token; the first id wins, as in llama.cpp
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    split = PRE_TOKENIZERS[md.get("tokenizer.ggml.pre", "default")]
    # Llama 3 style vocabularies ignore merges when a whole word is already a token.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=split == _LLAMA3_RE))
    if split == _GPT2_BYTELEVEL:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == _DIGITS_BYTELEVEL:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_tokenizer(md: dict):
    """SentencePiece-style ('llama') BPE: merges are derived from the token scores.

    As in transformers' SentencePiece converter: every split of a token into two
    tokens is a merge, ranked by the merged token's score (higher merges first).
    """
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens = md["tokenizer.ggml.tokens"]
    scores = md.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = md.get("tokenizer.ggml.token_type", [1] * len(tokens))
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = []
    for piece, pid in vocab.items():
        if types[pid] != 1:  # only normal pieces are built by merging
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                merges.append((-scores[pid], vocab[left], vocab[right], left, right))
    merges.sort()
    unk_id = md.get("tokenizer.ggml.unknown_token_id", 0)
    tok = Tokenizer(models.BPE(
        vocab=vocab, merges=[(m[3], m[4]) for m in merges], unk_token=tokens[unk_id],
        fuse_unk=True, byte_fallback=True,
    ))
    prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("\u2581")] if prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return tok
