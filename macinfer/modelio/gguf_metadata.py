"""The GGUF metadata the converter reads, type-checked before any of it is used.

A GGUF's metadata is whatever its writer put there: a head count of 0, token ids stored
as strings, tokens stored as numbers, merges that are not pairs of tokens. Used as is,
each of these ends in a traceback deep inside the converter or the tokenizers library;
`check_metadata` names every such key in one line instead. It checks types and ranges
only; what is supported (architecture, tensor types, tokenizer kind) is
macinfer.modelio.gguf's and macinfer.modelio.gguf_tokenizer's to refuse.
"""

from __future__ import annotations

import numbers
from pathlib import Path

from macinfer.errors import MacinferError

# <arch>.* keys -> required? (all counts: integers >= 1)
_COUNTS = {"embedding_length": True, "block_count": True, "feed_forward_length": False, "attention.head_count": True,
           "attention.head_count_kv": False, "attention.key_length": False, "rope.dimension_count": False,
           "context_length": False}
_POSITIVE_REALS = ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "rope.freq_base",
                   "rope.scaling.factor")
_TOKEN_IDS = ("bos", "eos", "eot", "unknown", "padding")
_FLAGS = ("add_bos_token", "add_space_prefix")


def check_metadata(src: Path, md: dict) -> None:
    """Refuse metadata of the wrong type or out of range, naming every bad key.

    Args:
        src: the GGUF file, for the error.
        md: its metadata (macinfer.modelio.gguf_file.GGUFFile.metadata).

    Raises:
        MacinferError: one line, "<src>: bad GGUF metadata: <key> ...; <key> ...".
    """
    arch = md.get("general.architecture")
    problems = _model_problems(md, arch if isinstance(arch, str) else "llama") + _tokenizer_problems(md)
    if problems:
        raise MacinferError(f"{src}: bad GGUF metadata: {'; '.join(problems)}: the file is corrupt or "
                            "was written by a broken converter")


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _show(x) -> str:
    r = repr(x)
    return r if len(r) <= 40 else r[:37] + "..."


def _model_problems(md: dict, arch: str) -> list[str]:
    problems = []
    for key, required in _COUNTS.items():
        value = md.get(f"{arch}.{key}")
        if value is None:
            if required:
                problems.append(f"{arch}.{key} is missing")
        elif not _is_int(value) or value < 1:
            problems.append(f"{arch}.{key} is {_show(value)}, not an integer >= 1")
    for key in _POSITIVE_REALS:
        value = md.get(f"{arch}.{key}")
        if value is not None and not (isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0):
            problems.append(f"{arch}.{key} is {_show(value)}, not a number > 0")
    heads, kv = md.get(f"{arch}.attention.head_count"), md.get(f"{arch}.attention.head_count_kv")
    hidden = md.get(f"{arch}.embedding_length")
    if _is_int(heads) and _is_int(kv) and heads >= 1 and kv >= 1 and heads % kv:
        problems.append(f"{arch}.attention.head_count_kv {kv} does not divide {arch}.attention.head_count {heads}")
    if (_is_int(heads) and _is_int(hidden) and heads >= 1 and f"{arch}.attention.key_length" not in md
            and hidden % heads):
        problems.append(f"{arch}.attention.head_count {heads} does not divide {arch}.embedding_length {hidden}")
    return problems


def _tokenizer_problems(md: dict) -> list[str]:
    problems = []
    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is not None and (not isinstance(tokens, list) or not tokens
                               or not all(isinstance(t, str) for t in tokens)):
        problems.append(f"tokenizer.ggml.tokens is not a list of strings (got {_show(tokens)})")
        tokens = None
    n = len(tokens) if tokens is not None else None
    for key, ok, what in (("token_type", _is_int, "integers"), ("scores", _is_real, "numbers")):
        values = md.get(f"tokenizer.ggml.{key}")
        if values is not None and (not isinstance(values, list) or not all(ok(v) for v in values)
                                   or (n is not None and len(values) != n)):
            problems.append(f"tokenizer.ggml.{key} is not a list of {what}, one per token")
    for name in _TOKEN_IDS:
        key, value = f"tokenizer.ggml.{name}_token_id", md.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None and (not _is_int(value) or value < 0 or (n is not None and value >= n)):
            problems.append(f"{key} is {_show(value)}, not a token id (0 to {n - 1 if n else '?'})")
    for name in _FLAGS:
        value = md.get(f"tokenizer.ggml.{name}")
        if value is not None and not isinstance(value, bool):
            problems.append(f"tokenizer.ggml.{name} is {_show(value)}, not true or false")
    template = md.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        problems.append(f"tokenizer.chat_template is {_show(template)}, not a string")
    if (merge := _bad_merge(md.get("tokenizer.ggml.merges"), tokens)) is not None:
        problems.append(merge)
    return problems


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _bad_merge(merges, tokens: list[str] | None) -> str | None:
    """The first merge that is not "LEFT RIGHT" with LEFT, RIGHT and LEFTRIGHT all tokens, described."""
    if merges is None:
        return None
    if not isinstance(merges, list):
        return f"tokenizer.ggml.merges is {_show(merges)}, not a list of strings"
    vocab = set(tokens) if tokens is not None else None
    for i, m in enumerate(merges):
        parts = m.split(" ") if isinstance(m, str) else []
        if len(parts) != 2 or not all(parts):
            return f"tokenizer.ggml.merges[{i}] is {_show(m)}, not two tokens separated by one space"
        if vocab is not None and not (parts[0] in vocab and parts[1] in vocab and parts[0] + parts[1] in vocab):
            return f"tokenizer.ggml.merges[{i}] {_show(m)} merges strings that are not tokens"
    return None
