"""What a chat reply says as it streams, split by kind: the events an OutputParser emits.

Any protocol renders them its own way (OpenAI's chat deltas, a terminal, a TUI block):

    ThinkingDelta       more of the thought (vLLM's `reasoning_content`)
    ContentDelta        more of the answer
    ToolCallStart       a call begins: its index in the reply, id and function name
    ToolCallDelta       more of that call's arguments (JSON text; the deltas join into `arguments`)
    ToolCallEnd         the call is whole: its arguments as one JSON text
    Finish              the reply ended: why, and the token counts

NOTE: for each call, Start comes before its Deltas and End; the Deltas of a call concatenate
to a prefix of its End's `arguments` (a call whose arguments could not be streamed has none,
and End carries them all).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ThinkingDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    arguments: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Usage:
    """Token counts of one reply (prompt_tokens: its prompt; reasoning_tokens: those of the thought)."""

    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class Finish:
    """finish_reason: "stop", "length", "abort", or "tool_calls" (stopped by itself after a call)."""

    reason: str
    usage: Usage
    tool_calls: list = field(default_factory=list)  # every ToolCallEnd of the reply, in order


Event = ThinkingDelta | ContentDelta | ToolCallStart | ToolCallDelta | ToolCallEnd | Finish
