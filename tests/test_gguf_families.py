"""GGUF import, family by family and type by type, against gguf's own reader as the oracle.

Each test writes a tiny GGUF the way llama.cpp's convert_hf_to_gguf.py + llama-quantize
would: a random-weight mlx-lm model of the family, its parameters renamed with the `gguf`
package's tensor-name table, llama.cpp's value changes applied (q/k row permutation for the
llama lineage, Gemma's 1 + w norms), quantised by the reference quantiser in
tests/gguf_quants.py and written with `gguf.GGUFWriter`. The oracle is an HF-layout model
built from `gguf.quants.dequantize` of that same file (for types MLX cannot hold exactly,
the re-quantised weights' own reference: mx.quantize of gguf's dequantisation), loaded by
mlx-lm. The converted model must give:
- exactly the oracle's logits once dequantised (macinfer's CPU loading path),
- the oracle's greedy tokens when run quantised by plain mlx-lm,
- the tokenizer's ids on multilingual, code and special-token text.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from gguf_quants import quantize
from macinfer.modelio.gguf import REPORT, convert_gguf
from macinfer.modelio.gguf_tensors import REQUANT_BITS
from tiny import build_from_config

TEXTS = ["The capital of France is Paris.", "naïve café – 😀 日本語 Ελληνικά",
         "def f(x):\n    return x ** 2  # 12345", "<|im_start|>user\nHi<|im_end|>\n"]
BASE = {"hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-5, "vocab_size": 384,
        "max_position_embeddings": 512, "rope_theta": 10000.0, "tie_word_embeddings": False}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256}
# GGUF architecture -> the mlx-lm config of that family (dims: multiples of 256, K-quant rows).
FAMILIES = {
    "llama": {"model_type": "llama"},
    "granite": {"model_type": "granite", "embedding_multiplier": 6.0, "residual_multiplier": 0.5,
                "attention_multiplier": 0.0625, "logits_scaling": 4.0, "attention_bias": False, "mlp_bias": False},
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True},
    "qwen2moe": {"model_type": "qwen2_moe", **MOE, "shared_expert_intermediate_size": 512},
    "qwen3": {"model_type": "qwen3", "tie_word_embeddings": True},
    "qwen3moe": {"model_type": "qwen3_moe", **MOE, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "norm_topk_prob": True},
    "gemma": {"model_type": "gemma", "tie_word_embeddings": True},
    "gemma2": {"model_type": "gemma2", "tie_word_embeddings": True, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 64},
    "gemma3": {"model_type": "gemma3_text", "tie_word_embeddings": True, "num_hidden_layers": 6,
               "sliding_window": 8, "sliding_window_pattern": 6, "query_pre_attn_scalar": 64,
               "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0},
    "phi3": {"model_type": "phi3", "original_max_position_embeddings": 512},
    "olmo2": {"model_type": "olmo2"},
    "starcoder2": {"model_type": "starcoder2", "norm_epsilon": 1e-5, "tie_word_embeddings": True},
    "gpt-oss": {"model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 256,
                "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"], "rope_theta": 150000.0},
}
# Types cycled over a family's matrices (sorted by GGUF name); vectors and norms stay F32.
MIX = ["Q4_K", "Q6_K", "Q8_0", "F32", "Q5_K"]
EVERY_TYPE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
              "MXFP4", "F16", "BF16", "F32"]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (rows of attn_q / attn_k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_names(arch: str, params: list[str], n_layers: int) -> dict[str, str]:
    """mlx-lm parameter -> GGUF tensor name, as convert_hf_to_gguf.py's map_tensor_name gives it."""
    table = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], n_layers)
    out = {}
    for p in params:
        base, _, suffix = p.rpartition(".")
        if base.endswith("self_attn") and suffix == "sinks":  # gpt-oss: attention sinks, one per head
            out[p] = table.get_name(base + ".o_proj").replace("attn_output", "attn_sinks") + ".weight"
            continue
        name = table.get_name(base.replace(".switch_mlp.", ".experts."))
        assert name is not None, p
        out[p] = f"{name}.{suffix}"
    return out


def write_family_gguf(arch: str, src: Path, out: Path, types, tokenizer_pre: str = "gpt2",
                      extra: dict | None = None) -> dict:
    """The tiny model in src as llama.cpp would export it; returns {gguf name: (mlx name, type)}.

    extra: more tensors to write as they are (F32), e.g. a vision tower.
    """
    config = json.loads((src / "config.json").read_text())
    params = dict(mx.load(str(src / "model.safetensors")))
    names = gguf_names(arch, list(params), config["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), arch)
    _metadata(w, arch, config)
    _tokenizer(w, src, config, tokenizer_pre)
    written, matrices = {}, sorted(n for p, n in names.items() if params[p].ndim >= 2)
    for p, name in sorted(names.items(), key=lambda kv: kv[1]):
        v = np.array(params[p].astype(mx.float32))
        if arch in ("llama", "granite") and name.split(".")[-2] in ("attn_q", "attn_k"):
            v = llama_cpp_permute(v, config["num_attention_heads" if ".attn_q." in name else "num_key_value_heads"])
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            v = v + 1  # GemmaModel.modify_tensors
        t = "F32" if v.ndim < 2 or not name.endswith(".weight") else types(name, matrices.index(name))
        if arch == "gpt-oss" and "_exps.weight" in name:
            t = "MXFP4"  # as gpt-oss ships
        if t == "F32":
            w.add_tensor(name, v)
        elif t == "F16":
            w.add_tensor(name, v.astype(np.float16))
        else:
            w.add_tensor(name, quantize(v, t), raw_dtype=gguf.GGMLQuantizationType[t])
        written[name] = (p, t)
    for name, v in (extra or {}).items():
        w.add_tensor(name, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def _metadata(w, arch: str, c: dict) -> None:
    w.add_name("tiny")
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]))
    w.add_value_length(c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]))
    w.add_rope_dimension_count(c.get("head_dim", 64))
    w.add_rope_freq_base(c["rope_theta"])
    if arch == "starcoder2":
        w.add_layer_norm_eps(c["norm_epsilon"])
    else:
        w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if "num_experts" in c or "num_local_experts" in c:
        w.add_expert_count(c.get("num_experts", c.get("num_local_experts")))
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c.get("moe_intermediate_size", c["intermediate_size"]))
    if "shared_expert_intermediate_size" in c:
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
    if "sliding_window" in c:
        w.add_sliding_window(c["sliding_window"])
    if arch == "granite":
        w.add_embedding_scale(c["embedding_multiplier"])
        w.add_residual_scale(c["residual_multiplier"])
        w.add_attention_scale(c["attention_multiplier"])
        w.add_logit_scale(c["logits_scaling"])


def _tokenizer(w, src: Path, config: dict, pre: str) -> None:
    """The tiny byte-level BPE tokenizer as llama.cpp writes a 'gpt2' vocabulary (padded with [PADn])."""
    tj = json.loads((src / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tj["model"]["vocab"].items()}
    special = {a["id"] for a in tj["added_tokens"] if a["special"]}
    n = config["vocab_size"]
    tc = json.loads((src / "tokenizer_config.json").read_text())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([by_id.get(i, f"[PAD{i}]") for i in range(n)])
    w.add_token_types([3 if i in special else 1 if i in by_id else 5 for i in range(n)])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(tj["model"]["vocab"][tc["bos_token"]])
    w.add_eos_token_id(tj["model"]["vocab"][tc["eos_token"]])
    w.add_chat_template(tc["chat_template"])


def oracle_dir(arch: str, gguf_path: Path, written: dict, src: Path, out: Path) -> Path:
    """An HF-layout model of gguf's dequantisation of the file (re-quantised types: their MLX reference)."""
    config = json.loads((src / "config.json").read_text())
    reader = gguf.GGUFReader(str(gguf_path))
    weights = {}
    for t in reader.tensors:
        param, type_name = written[t.name]
        v = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        if type_name in REQUANT_BITS:  # no exact MLX form: the re-quantised weights are the reference
            q = mx.quantize(mx.array(v), group_size=32, bits=REQUANT_BITS[type_name])
            v = np.array(mx.dequantize(*q, group_size=32, bits=REQUANT_BITS[type_name]))
        if arch in ("llama", "granite") and t.name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = config["num_attention_heads" if ".attn_q." in t.name else "num_key_value_heads"]
            v = v[np.argsort(llama_cpp_permute(np.arange(v.shape[0]), heads))]
        if arch.startswith("gemma") and t.name.endswith("norm.weight"):
            v = v - np.float32(1)
        weights[param] = mx.array(v.astype(np.float32))
    out.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out


def greedy(model, tok, prompt: list[int], n: int = 6) -> list[int]:
    from mlx_lm.generate import generate_step

    return [t for t, _ in zip((int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)), range(n))]


def check_against_oracle(arch: str, src: Path, tmp: Path, types) -> dict:
    import mlx_lm

    from macinfer.modelio.loader import load_model

    path = tmp / f"{arch}.gguf"
    written = write_family_gguf(arch, src, path, types)
    out = convert_gguf(path, tmp / "converted")
    ref, ref_tok = mlx_lm.load(str(oracle_dir(arch, path, written, src, tmp / "oracle")))
    got, got_tok, _ = load_model(str(out), dequantize=True)
    prompt = ref_tok.encode(TEXTS[0] + " " + TEXTS[2])
    assert mx.array_equal(got(mx.array([prompt])), ref(mx.array([prompt]))).item(), arch
    quantised, _ = mlx_lm.load(str(out))
    assert greedy(quantised, got_tok, prompt) == greedy(ref, ref_tok, prompt), arch
    for text in TEXTS:
        assert got_tok.encode(text) == ref_tok.encode(text), text
    return json.loads((out / REPORT).read_text())


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_family_converts_like_gguf_dequantised_oracle(arch, tmp_path):
    src = build_from_config(tmp_path / "src", {**BASE, **FAMILIES[arch]})
    report = check_against_oracle(arch, src, tmp_path, lambda name, i: MIX[i % len(MIX)])
    kinds = {r["type"]: (r["mlx"], r["exact"]) for r in report["tensors"]}
    assert kinds["Q4_K"] == ("4-bit affine g32", True) and kinds["Q5_K"] == ("5-bit affine g32", True)
    assert kinds["Q8_0"] == ("8-bit affine g32", True) and kinds["Q6_K"] == ("8-bit affine g32", False)


def test_a_vision_tower_in_the_file_is_left_out(tmp_path):
    """Ollama's Gemma 3 blobs hold the vision tower too: the text model converts alone."""
    src = build_from_config(tmp_path / "src", {**BASE, **FAMILIES["gemma3"]})
    vision = {"v.blk.0.attn_q.weight": np.ones((64, 64), np.float32), "mm.input_projection.weight": np.ones((256, 64),
                                                                                                          np.float32)}
    write_family_gguf("gemma3", src, tmp_path / "g.gguf", lambda name, i: "Q4_K", extra=vision)
    report = json.loads((convert_gguf(tmp_path / "g.gguf", tmp_path / "out") / REPORT).read_text())
    assert not any(r["tensor"].startswith(("v.", "mm.")) for r in report["tensors"])


def test_every_type_on_llama(tmp_path):
    """One tensor of each supported GGML type in one file: kept exactly unless it has no MLX form."""
    src = build_from_config(tmp_path / "src", {**BASE, **FAMILIES["llama"]})
    report = check_against_oracle("llama", src, tmp_path, lambda name, i: EVERY_TYPE[i % len(EVERY_TYPE)])
    seen = {r["type"]: r for r in report["tensors"]}
    assert set(seen) == set(EVERY_TYPE)
    for t, r in seen.items():
        assert r["exact"] == (t not in REQUANT_BITS), r
        assert (r["max_abs_err"] > 0) == (t in REQUANT_BITS), r
    assert seen["MXFP4"]["mlx"] == "4-bit mxfp4 g32" and seen["BF16"]["mlx"] == "bfloat16"


# -- tokenizers ---------------------------------------------------------------------------------
# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp, MIT), as the vocabularies were trained with them.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TOKENIZER_TEXTS = TEXTS + ["  indented\n\tcode = {'a': [1, 22, 333, 4444]}\n", "Привет, мир! ¿Qué tal? 1234567",
                           "<|im_start|>system\nYou are 42.<|im_end|>\n<|im_start|>assistant\n"]


def _split_pre_tokenizer(kind: str):
    from tokenizers import Regex, pre_tokenizers

    if kind == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(kind), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


@pytest.mark.parametrize("pre, split", [("gpt2", "gpt2"), ("smollm", "digits"), ("starcoder", "digits"),
                                        ("llama-bpe", LLAMA3_SPLIT), ("qwen2", QWEN2_SPLIT), ("gpt-4o", GPT4O_SPLIT)],
                         ids=["gpt2", "smollm", "starcoder", "llama-bpe", "qwen2", "gpt-4o"])
def test_byte_level_tokenizer_gives_the_vocabulary_ids(tmp_path, pre, split):
    """A BPE vocabulary trained with llama.cpp's split for `pre`, stored as GGUF metadata, encodes as it was trained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from macinfer.modelio.gguf_tokenizer import write_tokenizer
    from tiny import CORPUS

    ref = Tokenizer(models.BPE(ignore_merges=pre in ("llama-bpe", "gpt-4o")))
    ref.pre_tokenizer = _split_pre_tokenizer(split)
    ref.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    ref.train_from_iterator([CORPUS * 3, " ".join(TOKENIZER_TEXTS) * 5], trainer=trainer)
    tj = json.loads(ref.to_str())
    by_id = {i: t for t, i in tj["model"]["vocab"].items()}
    md = {"general.architecture": "qwen2", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
          "tokenizer.ggml.tokens": [by_id[i] for i in range(len(by_id))],
          "tokenizer.ggml.token_type": [3 if by_id[i] in special else 1 for i in range(len(by_id))],
          "tokenizer.ggml.merges": [" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]],
          "tokenizer.ggml.eos_token_id": 2}
    write_tokenizer(md, tmp_path)
    got = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in TOKENIZER_TEXTS:
        assert got.encode(text).ids == ref.encode(text).ids, text
        assert got.decode(got.encode(text).ids, skip_special_tokens=False) == text
    im_start = tj["model"]["vocab"]["<|im_start|>"]
    assert got.encode(TOKENIZER_TEXTS[-1]).ids[0] == im_start  # a control token stays whole


def test_gemma_sentencepiece_without_space_prefix_matches_sentencepiece(tmp_path):
    """Gemma's vocabulary ('llama' model, add_space_prefix false, merges from token order) vs sentencepiece."""
    import sentencepiece as spm
    from tokenizers import Tokenizer

    from macinfer.modelio.gguf_tokenizer import write_tokenizer
    from tiny import CORPUS

    (tmp_path / "corpus.txt").write_text((CORPUS.replace("\n", " ") + "\n") * 30 + " ".join(TOKENIZER_TEXTS) * 10)
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=600, hard_vocab_limit=False,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, minloglevel=2, add_dummy_prefix=False,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True, user_defined_symbols=["<start_of_turn>", "<end_of_turn>"])
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else
             4 if sp.id_to_piece(i).startswith("<") and sp.id_to_piece(i).endswith("_turn>") else 1 for i in range(n)]
    md = {"general.architecture": "gemma3", "tokenizer.ggml.model": "llama",
          "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
          "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)], "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id(),
          "tokenizer.ggml.unknown_token_id": sp.unk_id(), "tokenizer.ggml.add_bos_token": True,
          "tokenizer.ggml.add_space_prefix": False}
    write_tokenizer(md, tmp_path)
    got = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in TOKENIZER_TEXTS[:3] + ["<start_of_turn>user\nZebra Ω 2024<end_of_turn>\n"]:
        assert got.encode(text).ids == [sp.bos_id()] + sp.encode(text), text
