"""How a model thinks before it answers: the family of its thought markers, and where a thought is open.

Families (`thinking_of`):

    think     `<think>` ... `</think>` and its kin (Qwen3, DeepSeek-R1 and its distills, SmolLM3,
              GLM, Kimi, MiniMax, LongCat, ...): mlx-lm's TokenizerWrapper infers the markers
              from the vocabulary (`has_thinking`, `think_start` / `think_end` and their ids).
              A template may open the thought in the prompt (DeepSeek-R1-Distill ends its
              generation prompt with `<think>\\n`): `thought_open` reads it from the prompt ids,
              as mlx-lm's server does (the last start marker after the last end marker).
    harmony   gpt-oss: a reply is a run of messages on channels: `analysis` (the thought),
              `commentary` (tool calls, preambles) and `final` (the answer). `HarmonyReader`
              follows them with openai-harmony's StreamableParser.

The text split itself (thought / answer / tool call) is macinfer.chat.output's; this module says
what the markers are.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from macinfer.errors import MacinferError

HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
HARMONY_MARKERS = HARMONY_TOKENS + ("<|constrain|>", "<|return|>", "<|call|>")


@dataclass(frozen=True)
class Thinking:
    """A model's thought markers.

    Args:
        family: "think" (start/end markers) or "harmony" (gpt-oss's channels).
        start, end: the markers' text ("<think>", "</think>"); None for harmony.
        start_id, end_id: the markers' token ids when each is one token (else None).
    """

    family: str
    start: str | None = None
    end: str | None = None
    start_id: int | None = None
    end_id: int | None = None


def thinking_of(tokenizer) -> Thinking | None:
    """The model's thinking family, or None for a model that does not think."""
    vocab = tokenizer.get_vocab()
    if all(t in vocab for t in HARMONY_TOKENS):
        return Thinking("harmony")
    if not getattr(tokenizer, "has_thinking", False):
        return None
    starts, ends = tokenizer.think_start_tokens, tokenizer.think_end_tokens
    return Thinking("think", tokenizer.think_start, tokenizer.think_end,
                    starts[0] if len(starts) == 1 else None, ends[0] if len(ends) == 1 else None)


def thought_open(tokenizer, thinking: Thinking | None, prompt_ids: list[int]) -> bool:
    """True when the prompt leaves a thought open: the reply starts inside it (mlx-lm's server's rule)."""
    if thinking is None or thinking.family != "think":
        return False
    return tokenizer.rfind_think_start(prompt_ids) > tokenizer.rfind_think_end(prompt_ids)


# -- harmony ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def harmony_encoding():
    """openai-harmony's gpt-oss encoding (o200k_harmony), loaded once.

    NOTE: openai-harmony reads its BPE file from $TIKTOKEN_ENCODINGS_BASE (checked against its
    SHA-256) or downloads it once into its cache; offline, point the variable at a directory
    holding `o200k_base.tiktoken`.

    Raises:
        MacinferError: the encoding cannot be loaded (one line: what to do).
    """
    from openai_harmony import HarmonyEncodingName, HarmonyError, load_harmony_encoding

    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except HarmonyError as e:
        where = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
        raise MacinferError(f"gpt-oss's harmony format needs openai-harmony's o200k vocabulary, which could not be "
                            f"loaded ({e}): " + (f"check {where}/o200k_base.tiktoken" if where else
                                                 "connect once, or set TIKTOKEN_ENCODINGS_BASE to a directory "
                                                 "holding o200k_base.tiktoken")) from None


class HarmonyReader:
    """One reply's harmony messages as its tokens arrive.

    `feed` returns, per message piece: ("delta", channel, recipient, text) for new content and
    ("end", channel, recipient, "") when a message closes. A model whose token ids are harmony's
    own (gpt-oss) is read by id; any other tokenizer carrying harmony's markers (a test model)
    by its text, re-encoded with harmony's encoding.

    Args:
        tokenizer: the model's tokenizer (mlx-lm's wrapper).
    """

    def __init__(self, tokenizer):
        from openai_harmony import Role, StreamableParser

        self.encoding = harmony_encoding()
        self.parser = StreamableParser(self.encoding, Role.ASSISTANT)
        self.by_id = all(tokenizer.convert_tokens_to_ids(t) == self.encoding.encode(t, allowed_special="all")[0]
                         for t in HARMONY_TOKENS)
        self.broken = False  # the parser refused a token: the rest is plain content
        self._pending = ""  # text ending inside a marker ("<|chan"): held until it is whole or is not one

    def feed(self, token_ids: list[int], text: str) -> list[tuple[str, str | None, str | None, str]]:
        if self.broken:
            return [("delta", "final", None, text)] if text else []
        if self.by_id:
            return self._process(token_ids)
        # NOTE: a delta's text may end inside a marker (the engine holds back a stop string's
        # length): re-encoded in two pieces it would be plain text, not the special token.
        text = self._pending + text
        held = _partial_marker(text)
        text, self._pending = text[:len(text) - held], text[len(text) - held:]
        return self._process(self.encoding.encode(text, allowed_special="all"))

    def _process(self, ids: list[int]) -> list[tuple[str, str | None, str | None, str]]:
        from openai_harmony import HarmonyError

        out = []
        for i, t in enumerate(ids):
            p = self.parser
            done = len(p.messages)
            try:
                p.process(t)
            except HarmonyError:
                self.broken = True
                rest = self.encoding.decode(ids[i:])
                return out + ([("delta", "final", None, rest)] if rest else [])
            if p.last_content_delta:
                out.append(("delta", p.current_channel, p.current_recipient, p.last_content_delta))
            for m in p.messages[done:]:
                out.append(("end", m.channel, m.recipient, ""))
        return out

    @property
    def in_thought(self) -> bool:
        """The message being read is on the analysis channel (the thought)."""
        return not self.broken and self.parser.current_channel == "analysis"

    def finish(self) -> list[tuple[str, str | None, str | None, str]]:
        """The reply ended (its stop token, <|return|> or <|call|>, is not in the stream): close the last message."""
        from openai_harmony import HarmonyError

        pending, self._pending = self._pending, ""
        out = self._process(self.encoding.encode(pending, allowed_special="all")) if pending else []
        if self.broken:
            return out
        p = self.parser
        done = len(p.messages)
        try:
            p.process_eos()
        except HarmonyError:
            return out
        return out + [("end", m.channel, m.recipient, "") for m in p.messages[done:]]


def _partial_marker(text: str) -> int:
    """The length of the longest end of `text` that could still grow into a harmony marker (0: none)."""
    for n in range(min(len(text), max(map(len, HARMONY_MARKERS)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) and m != text[-n:] for m in HARMONY_MARKERS):
            return n
    return 0
