"""The tokenizer of a GGUF file, rebuilt as a Hugging Face fast tokenizer by transformers' GGUF converter.

transformers (`integrations.gguf.gguf_tokenizer_mapping.convert_gguf_tokenizer`) turns the
`tokenizer.ggml.*` metadata into the tokenizer class of the family (SentencePiece BPE for
'llama' vocabularies, Gemma's and Phi-3's variants; byte-level BPE for 'gpt2' ones, with the
split regex of the pre-tokenizers it knows), and adds the control and user-defined tokens
whole. What is ours:

- the pre-tokenizers llama.cpp names that transformers' table lacks (SmolLM's and
  StarCoder's "digits, then byte-level"; GPT-2's plain byte-level); any other name is
  refused, since splitting text differently from the vocabulary's training changes ids;
- SentencePiece spaces as llama.cpp splits them (`_spm_spaces`);
- Llama 3 style vocabularies ignore merges for a word that is already a token (as its
  tokenizer.json says); BOS added or not exactly as `tokenizer.ggml.add_bos_token` says
  (llama.cpp's default: SentencePiece vocabularies add it, byte-level ones do not);
- tokenizer_config.json: special tokens, the chat template from the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from macinfer.errors import MacinferError

_DIGITS_BYTELEVEL = "digits"
_BYTELEVEL = "bytelevel"
# llama.cpp pre-tokenizer names transformers' GGUF table does not have.
OWN_PRE_TOKENIZERS = {"default": _BYTELEVEL, "gpt2": _BYTELEVEL, "gpt-2": _BYTELEVEL, "olmo": _BYTELEVEL,
                      "smollm": _DIGITS_BYTELEVEL, "starcoder": _DIGITS_BYTELEVEL, "refact": _DIGITS_BYTELEVEL}
_IGNORE_MERGES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe", "tekken", "gpt-4o")
_KINDS = ("gpt2", "llama")


def _known_splits() -> dict:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    return GGUF_PRE_TOKENIZER_SPLITS


def check_tokenizer(src: Path, md: dict) -> None:
    """Refuse, by name, a tokenizer write_tokenizer cannot rebuild.

    Raises:
        MacinferError: no tokenizer metadata, or a tokenizer model / pre-tokenizer not supported.
    """
    kind = md.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in md:
        raise MacinferError(f"{src} has no tokenizer in its metadata (tokenizer.ggml.*), which conversion needs")
    if kind not in _KINDS:
        raise MacinferError(f"{src}: GGUF tokenizer model '{kind}' is not supported (only {' and '.join(_KINDS)})")
    pre = md.get("tokenizer.ggml.pre", "default")
    if kind == "gpt2" and pre not in OWN_PRE_TOKENIZERS and pre not in _known_splits():
        names = sorted(set(OWN_PRE_TOKENIZERS) | set(_known_splits()))
        raise MacinferError(f"{src}: GGUF pre-tokenizer '{pre}' is not supported (supported: {', '.join(names)})")


def write_tokenizer(md: dict, out: Path, arch: str | None = None) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json to `out`.

    Args:
        md: the GGUF metadata (tokenizer.ggml.*, checked by check_tokenizer).
        out: the model directory being written.
        arch: general.architecture (Gemma and Phi-3 SentencePiece vocabularies differ).
    """
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    arch = arch or md.get("general.architecture", "llama")
    groups = {group: {name: md[f"tokenizer.{key}"] for key, name in keys.items() if f"tokenizer.{key}" in md}
              for group, keys in GGUF_TOKENIZER_MAPPING.items()}
    tok = convert_gguf_tokenizer(arch, groups["tokenizer"])[0]
    kind, pre = md["tokenizer.ggml.model"], md.get("tokenizer.ggml.pre", "default")
    if kind == "gpt2":
        _pre_tokenize(tok, pre)
    else:
        _spm_spaces(tok, bool(md.get("tokenizer.ggml.add_space_prefix", True)))
    tokens: list[str] = md["tokenizer.ggml.tokens"]

    def token(key):
        i = md.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos, unk, pad = token("bos"), token("eos"), token("unknown"), token("padding")
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    _post_process(tok, bos if add_bos else None, md.get("tokenizer.ggml.bos_token_id"))
    tok.save(str(out / "tokenizer.json"))

    special = {k: v for k, v in {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad}.items() if v}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": add_bos,
              "add_eos_token": bool(md.get("tokenizer.ggml.add_eos_token", False)),
              "clean_up_tokenization_spaces": False,
              "model_max_length": int(md.get(f"{arch}.context_length", 2048))}
    if isinstance(md.get("tokenizer.chat_template"), str):
        config["chat_template"] = md["tokenizer.chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False))


def _pre_tokenize(tok, pre: str) -> None:
    """Split text as llama.cpp's pre-tokenizer `pre` does (transformers set those in its table)."""
    from tokenizers import pre_tokenizers

    own = OWN_PRE_TOKENIZERS.get(pre)
    if own == _DIGITS_BYTELEVEL:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif own == _BYTELEVEL:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _IGNORE_MERGES:
        tok.model.ignore_merges = True


def _spm_spaces(tok, prefix: bool) -> None:
    """SentencePiece's spaces as llama.cpp (and sentencepiece) treat them: every space one U+2581,
    one more in front when add_space_prefix. transformers' Metaspace pre-tokenizer folds a run of
    leading spaces differently ("  hi": two U+2581 instead of three), so it is replaced here as
    transformers' own Phi-3 builder does."""
    from tokenizers import decoders, normalizers

    tok.normalizer = normalizers.Sequence(([normalizers.Prepend("\u2581")] if prefix else [])
                                          + [normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = None
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))


def _post_process(tok, bos: str | None, bos_id: int | None) -> None:
    from tokenizers import processors

    if bos is None:
        tok.post_processor = processors.ByteLevel(trim_offsets=False) if _byte_level(tok) else None
        return
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)])


def _byte_level(tok) -> bool:
    return "ByteLevel" in json.dumps(json.loads(tok.to_str()).get("decoder") or {})
