"""Structured output: a grammar every sampled token must follow, enforced by masking the logits.

The grammar engine is llguidance (as vLLM, SGLang and llama.cpp use it), chosen over xgrammar
(scripts/bench/grammar_engines.py): xgrammar imports torch (on Linux the PyPI torch brings the
CUDA libraries, gigabytes), compiles a new JSON schema ~30x slower (hundreds of ms on a Qwen-size
vocabulary, on the engine's thread), and rejects escapes in strings with maxLength; its masks cost
less CPU per step, but both cost ~1 ms at batch 16, a small part of a decode step. A matcher
computes a token bitmask (one bit per logits column) with the GIL dropped, so the runner
computes a step's masks while MLX evaluates the forward (macinfer.core.model_runner).

    StructuredOutput     what a request asks for: a JSON schema, any JSON object, a regex,
                         one of a few strings, or a Lark grammar (llguidance's dialect)
    GrammarCompiler      one per engine: the tokenizer in llguidance's form (built on the first
                         request that needs it) and a compiled matcher per grammar, copied
                         for each request
    fill_masks / apply_masks   a forward's bitmasks, and the logits with them applied

NOTE: a request's matcher has consumed exactly its generated tokens (and the EOS that ended
it). The scheduler advances it as it appends a token (macinfer.core.stop_checker), never
speculatively: requests with a grammar get no drafts (macinfer.spec_decode.decoder), and a pipelined
step samples their rows only once the step before is read back (macinfer.engine.pipeline,
ModelRunner.launch_held). Preemption keeps the generated tokens, so it keeps the matcher's
state too; chunked prefill samples nothing, so it never touches it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

# JSON whitespace as llama.cpp's schema grammars allow it: one space, or a line break or two and
# some indentation. Unbounded whitespace (llguidance's default) lets a model loop on newlines
# until max_tokens while the object never closes; with this, a schema whose strings, arrays and
# numbers are bounded has a bounded number of tokens.
JSON_WHITESPACE = r"[ ]?|\n{1,2}[ \t]{0,20}"


@dataclass(frozen=True)
class StructuredOutput:
    """The shape a request's output must have: exactly one of the fields.

    Args:
        json_schema: a JSON schema (a dict or its JSON text); the output is a JSON value valid under it.
        json_object: the output is a JSON object (any keys and values).
        regex: the output matches this regular expression (whole).
        choice: the output is one of these strings.
        grammar: a Lark grammar in llguidance's dialect (https://github.com/guidance-ai/llguidance).

    Example:
        >>> StructuredOutput(json_schema={"type": "object", "properties": {"ok": {"type": "boolean"}}})
    """

    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [n for n in ("json_schema", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] * bool(self.json_object)
        if len(given) != 1:
            raise ValueError(f"structured output takes exactly one of json_schema, json_object, regex, choice, "
                             f"grammar; got {', '.join(given) or 'none'}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json_schema, str):
            try:
                object.__setattr__(self, "json_schema", json.loads(self.json_schema))
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, bool)):
            raise ValueError("json_schema must be a JSON object (a schema)")

    def lark(self) -> str:
        """This grammar in llguidance's form (a Lark grammar, or its JSON grammar wrapper), checked.

        Raises:
            ValueError: one line saying what is wrong with the schema, regex or grammar.
        """
        from llguidance import LLMatcher

        if self.json_schema is not None or self.json_object:
            schema = {"type": "object"} if self.json_object else self.json_schema
            if isinstance(schema, dict) and "x-guidance" not in schema:
                schema = {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
            text = LLMatcher.grammar_from_json_schema(json.dumps(schema))
        elif self.regex is not None:
            text = LLMatcher.grammar_from_regex(self.regex)
        elif self.choice is not None:
            text = "start: " + " | ".join(json.dumps(c) for c in self.choice)
        else:
            text = self.grammar
        bad, messages = LLMatcher.validate_grammar_with_warnings(text)
        if bad:
            raise ValueError(f"{self.kind}: {' '.join(messages[0].split())}")
        return text

    @property
    def kind(self) -> str:
        """The field that is set: json_schema, json_object, regex, choice or grammar."""
        return "json_object" if self.json_object else next(
            n for n in ("json_schema", "regex", "choice", "grammar") if getattr(self, n) is not None)


class GrammarCompiler:
    """Makes the matchers of one engine's requests.

    Args:
        hf_tokenizer: the model's Hugging Face fast tokenizer.
        vocab_size: the width of the model's logits (it may exceed the tokenizer's vocabulary:
            those extra columns are never allowed).
        eos_token_ids: the tokens that end a request; allowed once the grammar is complete.
    """

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.hf_tokenizer, self.vocab_size, self.eos_token_ids = hf_tokenizer, vocab_size, sorted(eos_token_ids)
        self._tokenizer = None  # llguidance's: ~1 s of CPU for 49k tokens, built by prepare()
        self._compiled: dict[str, object] = {}  # grammar text -> a fresh matcher to copy (LRU by insertion)

    def prepare(self) -> None:
        """Build llguidance's view of the tokenizer now if not yet (the first matcher does otherwise).

        It takes ~1 s of CPU for SmolLM2's 49k tokens with the GIL held throughout (LLTokenizer's
        constructor does not release it), so no thread can hide it: built on the first request with
        a grammar, it stalls every stream. A server calls this as it starts and as it loads a model.
        """
        import llguidance.hf

        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=self.eos_token_ids or None)

    def matcher(self, structured: StructuredOutput):
        """A fresh llguidance LLMatcher for one request.

        Raises:
            ValueError: the grammar is invalid (one line).
        """
        import llguidance

        self.prepare()
        text = structured.lark()
        template = self._compiled.pop(text, None)
        if template is None:
            template = llguidance.LLMatcher(self._tokenizer, text, log_level=0)
            self._check_admits_a_reply(template, structured)
        self._compiled[text] = template
        while len(self._compiled) > 64:
            self._compiled.pop(next(iter(self._compiled)))
        return template.deep_copy()

    def _check_admits_a_reply(self, template, structured: StructuredOutput) -> None:
        """Refuse a grammar that cannot be used, or that admits nothing but an empty reply.

        Some are only found when the first mask is computed (a schema that refers to itself and
        nothing else, {"$ref": "#"}, loops there); without this check such a request "succeeds"
        with an empty reply.

        Raises:
            ValueError: one line naming the kind of grammar.
        """
        mask = self.fill_masks([template])[0]
        if template.is_error():  # llguidance's state dump: its first word is the reason (e.g. NoExtensionBias)
            why = template.get_error().split()[0] if template.get_error() else "no reason given"
            raise ValueError(f"{structured.kind}: it admits no reply (llguidance stops at the start: {why})")
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.vocab_size])
        if set(allowed.tolist()) <= set(self.eos_token_ids):
            raise ValueError(f"{structured.kind}: it admits no value but an empty reply")

    def fill_masks(self, matchers: list) -> np.ndarray:
        """The next-token bitmasks of a forward's rows: int32 (B, ceil(V / 32)); a None row allows all.

        llguidance computes each mask with the GIL dropped, so MLX's evaluation of the forward
        (queued with mx.async_eval before this is called) runs meanwhile. One row after the other
        in this thread: llguidance's thread pool (LLExecutor) took 6x the wall time of the same
        CPU time at batch 16 on a busy 2-core host (scripts/bench/grammar_engines.py).
        """
        words = (self.vocab_size + 31) // 32
        mask = np.full((len(matchers), words), -1, dtype=np.int32)  # C-contiguous rows
        for i, m in enumerate(matchers):
            if m is not None:
                m.unsafe_compute_mask_ptr(mask[i].ctypes.data, 4 * words)
        return mask


def advance(matcher, token: int) -> bool:
    """Feed a sampled token to a request's matcher; True if the output is complete.

    Complete: the token ended the grammar (EOS), or nothing but EOS may follow it, so the
    request can stop now instead of spending a step on the EOS. A token the mask did not allow
    (impossible while the NOTE in the module docstring holds) also ends it.
    """
    if not matcher.consume_token(token):
        return True
    return matcher.is_stopped()


def apply_masks(logits: mx.array, mask: np.ndarray) -> mx.array:
    """Logits (B, V) with the tokens each row's bitmask forbids set to -inf.

    The bits are unpacked by numpy into an additive bias (0 or -inf) and added: on MLX's CPU
    backend that is ~2x cheaper than shifting the words and mx.where (16 x 49,152 logits).

    Args:
        logits: (B, V) or (B, L, V); for (B, L, V) the masks apply at position 0 only (a
            forward verifying drafts: rows with a grammar have no drafts, so position 0 is
            where they sample).
        mask: int32 (B, W) bitmasks, bit t % 32 of word t // 32 for token t.
    """
    V = logits.shape[-1]
    words = np.ascontiguousarray(mask, dtype="<i4")  # little-endian words: byte j holds tokens 8j..8j+7
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")  # (B, 32 W): 1 = allowed
    if bits.shape[1] < V:
        bits = np.pad(bits, [(0, 0), (0, V - bits.shape[1])])  # columns past the mask: never allowed
    bias = mx.array(_BIAS[bits[:, :V]])  # (B, V)
    if bias.dtype != logits.dtype:
        bias = bias.astype(logits.dtype)  # half-precision logits stay so (-inf is representable)
    if logits.ndim == 2:
        return logits + bias
    return mx.concatenate([(logits[:, 0] + bias)[:, None], logits[:, 1:]], axis=1)


_BIAS = np.array([-np.inf, 0.0], dtype=np.float32)  # a bit's additive bias: forbidden, allowed
