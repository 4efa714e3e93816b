"""How a model writes a tool call: its syntax, how one call's text streams, and how it is parsed.

    ToolSyntax        kind "native" (the model's own format, mlx-lm's tool parser for it: JSON in
                      `<tool_call>` tags as Hermes / Qwen, Mistral's `[TOOL_CALLS]`, Qwen3-Coder's
                      XML, pythonic, ...), "harmony" (gpt-oss: a commentary-channel message to
                      `functions.NAME`), or "generic" (a template without tool calling, as
                      llama.cpp's generic handler: the tools described in a system message, the
                      reply one JSON object, `{"tool_call": {"name", "arguments"}}` or
                      `{"response": ...}`, that a grammar holds to the schemas)
    CallText          one call's text as it streams: the function name once its head is read, the
                      arguments as they grow (the closing braces held back), parsed whole at its end
    GenericReply      the generic format's reply as it streams: a response's text, or its calls

mlx-lm's parsers (mlx_lm/tool_parsers/) stay the reference for a native call's text: a call whose
head this module does not recognise is handed to the parser whole when it ends.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Callable

# Layouts whose arguments can be streamed: a head ending where the arguments' JSON starts, and
# how many closing braces follow it. Grammars (macinfer.chat.constraints) write exactly these.
JSON_TOOLS_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
MISTRAL_HEAD = re.compile(r"\s*([\w.-]+)\s*\[ARGS\]\s*")
GENERIC_CALL_HEAD = re.compile(r'\s*\{\s*"tool_call"\s*:' + JSON_TOOLS_HEAD.pattern)
GENERIC_RESPONSE_HEAD = re.compile(r'\s*\{\s*"response"\s*:\s*')
GENERIC_CALLS_HEAD = re.compile(r'\s*\{\s*"tool_calls"\s*:')

GENERIC_INSTRUCTIONS = (
    "You can call these tools (JSON schemas of their arguments):\n{tools}\n\n"
    "Respond in JSON format, either with `tool_call` (a request to call a tool: "
    '{{"tool_call": {{"name": ..., "arguments": {{...}}}}}}) or with `response` (your reply to the user: '
    '{{"response": "..."}}).'
)


@dataclass(frozen=True)
class ToolSyntax:
    """How one model writes tool calls.

    Args:
        kind: "native", "harmony" or "generic" (module docstring).
        parser: mlx-lm's parser module name for a native syntax ("json_tools", "mistral", ...).
        start, end: a native call's markers (end "" when the format has none: Mistral).
        parse: mlx-lm's parse_tool_call(text, tools) for a native syntax.
    """

    kind: str
    parser: str | None = None
    start: str | None = None
    end: str | None = None
    parse: Callable | None = None


def tool_syntax(tokenizer, thinking) -> ToolSyntax:
    """The syntax this model calls tools in (its template's, else the generic JSON format)."""
    if thinking is not None and thinking.family == "harmony":
        return ToolSyntax("harmony")
    if getattr(tokenizer, "has_tool_calling", False):
        parse = tokenizer.tool_parser
        return ToolSyntax("native", parse.__module__.rsplit(".", 1)[-1], tokenizer.tool_call_start,
                          tokenizer.tool_call_end or "", parse)
    return ToolSyntax("generic")


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def generic_system_prompt(tools: list[dict]) -> str:
    """The system message that teaches the generic format: each tool's name, description and schema."""
    lines = [json.dumps({"name": t["function"]["name"], "description": t["function"].get("description", ""),
                         "parameters": t["function"].get("parameters", {})}, ensure_ascii=False) for t in tools]
    return GENERIC_INSTRUCTIONS.format(tools="\n".join(lines))


class CallText:
    """One tool call's text as it streams.

    Args:
        head: the layout's head pattern (group 1: the function name, a JSON string or a bare
            word); None: nothing streams, the call is parsed whole at its end.
        closers: closing braces after the arguments (1 for `{"name", "arguments"}`, 2 in the
            generic wrapper, 0 for Mistral's `name[ARGS]{...}`).
    """

    def __init__(self, head: re.Pattern | None, closers: int):
        self.head, self.closers = head, closers
        self.text = ""
        self.name: str | None = None
        self.sent = 0  # characters of the arguments streamed so far
        self._args_at: int | None = None  # where the arguments start in self.text

    def feed(self, text: str) -> tuple[str | None, str]:
        """More of the call's text -> (its name if it became known now, new argument text)."""
        self.text += text
        named = None
        if self._args_at is None and self.head is not None:
            m = self.head.match(self.text)
            if m is not None and m.end() < len(self.text):  # the head is whole: a character follows it
                self.name = named = _name(m.group(1))
                self._args_at = m.end()
        if self._args_at is None:
            return named, ""
        args = self.text[self._args_at:]
        safe = len(args) - len(re.search(r"[\s}]*$", args).group())  # the closers may be in the tail
        delta = args[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return named, delta

    def arguments(self) -> str | None:
        """The whole arguments' JSON text once the call ended (None: the layout was not recognised)."""
        if self._args_at is None:
            return None
        args = self.text[self._args_at:].rstrip()
        for _ in range(self.closers):
            if not args.endswith("}"):
                return None
            args = args[:-1].rstrip()
        return args


def _name(token: str) -> str:
    return json.loads(token) if token.startswith('"') else token


def parse_whole(syntax: ToolSyntax, text: str, tools: list[dict] | None) -> list[tuple[str, str]]:
    """A native call's whole text -> [(name, arguments JSON)] by mlx-lm's parser ([] if it cannot)."""
    try:
        parsed = syntax.parse(text, tools)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):  # json.JSONDecodeError is a ValueError
        return []
    calls = []
    for c in parsed if isinstance(parsed, list) else [parsed]:
        if isinstance(c, dict) and isinstance(c.get("name"), str):
            args = c.get("arguments", {})
            calls.append((c["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    return calls


def native_head(syntax: ToolSyntax) -> tuple[re.Pattern | None, int]:
    """The streamable layout of a native syntax's call (None: parsed whole at its end)."""
    if syntax.parser == "json_tools":
        return JSON_TOOLS_HEAD, 1
    if syntax.parser == "mistral":
        return MISTRAL_HEAD, 0
    return None, 0


class JSONStringText:
    """A JSON string's decoded text as its characters arrive (the opening quote already read)."""

    def __init__(self):
        self.raw = ""
        self.sent = 0  # raw characters decoded and sent
        self.closed = False

    def feed(self, text: str) -> str:
        if self.closed:
            return ""
        self.raw += text
        i, out = self.sent, []
        while i < len(self.raw):
            c = self.raw[i]
            if c == '"':
                self.closed = True
                break
            if c == "\\":
                n = 6 if self.raw[i + 1:i + 2] == "u" else 2
                if i + n > len(self.raw):
                    break  # an escape not whole yet
                try:
                    out.append(json.loads('"' + self.raw[i:i + n] + '"'))
                except json.JSONDecodeError:
                    out.append(self.raw[i:i + n])
                i += n
                continue
            out.append(c)
            i += 1
        self.sent = i
        return "".join(out)


class GenericReply:
    """The generic format's reply as it streams: content (a response) or tool calls.

    `feed` returns ("content", text), ("call", CallText-event tuple) items; `finish` the calls
    parsed whole (the parallel form, `{"tool_calls": [...]}`).
    """

    def __init__(self):
        self.text = ""
        self.kind: str | None = None  # "response" | "call" | "calls" | "text" (not JSON: passed through)
        self.string: JSONStringText | None = None
        self.raw_sent = 0
        self.call: CallText | None = None

    def feed(self, text: str) -> list[tuple]:
        self.text += text
        if self.kind is None:
            self.kind = self._kind()
            if self.kind is None:
                return []
            text = self.text
        if self.kind == "text":
            return [("content", text)]
        if self.kind == "call":
            if self.call is None:
                self.call = CallText(GENERIC_CALL_HEAD, 2)
            name, delta = self.call.feed(text)
            return ([("start", name)] if name is not None else []) + ([("args", delta)] if delta else [])
        if self.kind == "response":
            return self._response()
        return []  # "calls": parsed at the end

    def _kind(self) -> str | None:
        t = self.text.lstrip()
        if t and not t.startswith("{"):
            return "text"
        for kind, head in (("call", GENERIC_CALL_HEAD), ("response", GENERIC_RESPONSE_HEAD),
                           ("calls", GENERIC_CALLS_HEAD)):
            m = head.match(self.text)
            if m is not None and m.end() < len(self.text):
                return kind
        if len(t) > 16 and not any(k in t for k in ('"tool_call', '"response')):
            return "text"
        return None

    def _response(self) -> list[tuple]:
        body = self.text[GENERIC_RESPONSE_HEAD.match(self.text).end():]
        if body.startswith('"'):
            if self.string is None:
                self.string = JSONStringText()
                piece = self.string.feed(body[1:])
            else:
                piece = self.string.feed(body[1 + len(self.string.raw):])
            return [("content", piece)] if piece else []
        safe = len(body) - len(re.search(r"[\s}]*$", body).group())  # a schema'd response: its raw JSON
        piece = body[self.raw_sent:safe] if safe > self.raw_sent else ""
        self.raw_sent = max(self.raw_sent, safe)
        return [("content", piece)] if piece else []

    def finish(self) -> list[tuple]:
        """The reply ended: what is left (the closing of a raw response, a parallel form's calls)."""
        if self.kind is None and self.text.strip():
            return [("content", self.text)]
        if self.kind == "response" and self.string is None:
            body = self.text[GENERIC_RESPONSE_HEAD.match(self.text).end():].rstrip()
            body = body[:-1].rstrip() if body.endswith("}") else body
            return [("content", body[self.raw_sent:])] if len(body) > self.raw_sent else []
        if self.kind == "calls":
            try:
                calls = json.loads(self.text)["tool_calls"]
                return [("whole", c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]
            except (ValueError, KeyError, TypeError):
                return []
        return []
