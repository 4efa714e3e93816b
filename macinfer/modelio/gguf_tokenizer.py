"""The tokenizer of a GGUF file, rebuilt from its tokenizer.ggml.* metadata as a Hugging Face fast tokenizer.

Two kinds, as llama.cpp names them: GPT-2 style byte-level BPE ('gpt2': tokens and
merges, split before BPE by the pre-tokenizer PRE_TOKENIZERS names) and SentencePiece
BPE ('llama': merges derived from the scores, byte fallback). Anything else is refused
by name (check_tokenizer), before the converter does any work.
"""

from __future__ import annotations

import json
from pathlib import Path

from macinfer.errors import MacinferError

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


def check_tokenizer(src: Path, md: dict) -> None:
    """Refuse, by name, a tokenizer write_tokenizer cannot rebuild.

    Args:
        src: the GGUF file, for the error.
        md: its metadata.

    Raises:
        MacinferError: no tokenizer metadata, or a tokenizer model / pre-tokenizer not supported.
    """
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


def write_tokenizer(md: dict, out: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json to `out`.

    Args:
        md: the GGUF metadata (tokenizer.ggml.*, checked by check_tokenizer).
        out: the model directory being written.
    """
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
