"""One chat reply's stream of engine deltas turned into events: thought, answer, tool calls, finish.

    parser = prepared.new_parser()          # macinfer.chat.request.prepare
    for delta in engine_stream:             # StreamDelta: text + token ids (the last one: .output)
        for event in parser.feed(delta):    # macinfer.chat.events
            ...

How the text is split, by family:
- `<think>` families and native tool calls: mlx-lm's TextStateMachine, built as its server
  builds it (mlx_lm.generate.make_text_state_machine): markers matched on the text, held back
  while a partial marker could still match, stripped from what is emitted; the reply starts in
  the thought when the prompt opened it. At the end the held-back tail is flushed on "length"
  and dropped on "stop" (mlx-lm's rule), so the split is mlx-lm's server's for the same tokens.
- harmony (gpt-oss): openai-harmony's parser (macinfer.chat.reasoning.HarmonyReader): analysis
  is the thought, final the answer, a commentary message to `functions.NAME` a call.
- the generic format: the answer text is JSON (macinfer.chat.tool_calls.GenericReply).

Tool-call arguments stream as they are written when the call's layout is known (the JSON in
`<tool_call>` tags, Mistral's, harmony's, the generic format); any other call is parsed whole by
mlx-lm's parser when its end marker comes.
"""

from __future__ import annotations

from macinfer.chat.events import (ContentDelta, Finish, ThinkingDelta, ToolCallDelta, ToolCallEnd, ToolCallStart,
                                  Usage)
from macinfer.chat.reasoning import HarmonyReader, Thinking
from macinfer.chat.tool_calls import CallText, GenericReply, ToolSyntax, call_id, native_head, parse_whole


class OutputParser:
    """Splits one reply.

    Args:
        tokenizer: the model's tokenizer (mlx-lm's wrapper).
        thinking: the model's thinking family (None: it does not think).
        thought_open: the prompt opened a thought (the reply starts inside it).
        syntax: the tool-call syntax to parse, or None (no tools offered: calls are plain text).
        tools: the tools offered (mlx-lm's parsers read their schemas).
        prompt_tokens: the prompt's length, for the usage.
    """

    def __init__(self, tokenizer, thinking: Thinking | None, thought_open: bool, syntax: ToolSyntax | None,
                 tools: list[dict] | None, prompt_tokens: int = 0):
        self.thinking, self.syntax, self.tools = thinking, syntax, tools
        self.prompt_tokens = prompt_tokens
        self.calls: list[ToolCallEnd] = []
        self.completion_tokens = self.reasoning_tokens = 0
        self._call: CallText | None = None
        self._call_start: ToolCallStart | None = None
        self._in_thought = thought_open
        self.harmony = HarmonyReader(tokenizer) if thinking is not None and thinking.family == "harmony" else None
        self.generic = GenericReply() if syntax is not None and syntax.kind == "generic" else None
        if self.harmony is None:
            from mlx_lm.generate import TextStateMachine

            self._machine = TextStateMachine
            self._state = _state_machine(thinking, syntax).make_state("reasoning" if thought_open else "normal")
            self._where = "reasoning" if thought_open else "normal"

    # -- the stream ------------------------------------------------------------------------
    def feed(self, delta) -> list:
        """Events for one engine delta (the last one, with finish_reason, also ends the reply)."""
        self._count(delta.token_ids)
        if self.harmony is not None:
            events = self._harmony(self.harmony.feed(delta.token_ids, delta.text))
        else:
            self._state, segments = self._machine.split(self._state, delta.text)
            events = self._segments(segments)
        if delta.finish_reason is not None:
            events += self.finish(delta.finish_reason, delta.output)
        return events

    def finish(self, reason: str, output=None) -> list:
        """The reply ended: the held-back tail, any open call, and Finish."""
        if self.harmony is not None:
            events = self._harmony(self.harmony.finish())
        else:
            if reason == "length":
                self._state, tail, state = self._machine.flush(self._state)
            else:
                self._state, state = self._machine.discard(self._state)
                tail = ""
            events = self._segments([(state, tail)])
            events += self._end_call()
            if self.generic is not None:
                events += self._generic(self.generic.finish())
        if reason == "stop" and self.calls:
            reason = "tool_calls"
        cached = output.metrics.cached_tokens if output is not None else 0
        usage = Usage(self.prompt_tokens, self.completion_tokens, self.reasoning_tokens, cached)
        return events + [Finish(reason, usage, list(self.calls))]

    def _count(self, token_ids: list[int]) -> None:
        """Thought tokens: those read inside a thought, its end marker included."""
        self.completion_tokens += len(token_ids)
        t = self.thinking
        if t is None:
            return
        if t.family == "harmony":
            self.reasoning_tokens += len(token_ids) if self.harmony.in_thought else 0
            return
        for tok in token_ids:
            if self._in_thought:
                self.reasoning_tokens += 1
                self._in_thought = tok != t.end_id
            elif tok == t.start_id:
                self.reasoning_tokens += 1
                self._in_thought = True

    # -- <think> families and native calls ------------------------------------------------------
    def _segments(self, segments: list[tuple[str, str]]) -> list:
        events = []
        for state, text in segments:
            if state != "tool" and self._where == "tool":
                events += self._end_call()
            self._where = state
            if not text:
                continue
            if state == "reasoning":
                events.append(ThinkingDelta(text))
            elif state == "tool":
                events += self._call_text(text)
            elif self.generic is not None:
                events += self._generic(self.generic.feed(text))
            else:
                events.append(ContentDelta(text))
        return events

    def _call_text(self, text: str) -> list:
        if self._call is None:
            self._call = CallText(*native_head(self.syntax))
        name, args = self._call.feed(text)
        events = []
        if name is not None:
            self._call_start = ToolCallStart(len(self.calls), call_id(), name)
            events.append(self._call_start)
        if args:
            events.append(ToolCallDelta(self._call_start.index, args))
        return events

    def _end_call(self) -> list:
        """The call in progress ended (its end marker, or the reply's end)."""
        call, start = self._call, self._call_start
        self._call = self._call_start = None
        if call is None:
            return []
        args = call.arguments()
        if start is not None and args is not None:
            events = [ToolCallDelta(start.index, args[call.sent:])] if len(args) > call.sent else []
            return events + self._ended(start, args)
        events = []  # a layout not streamed: mlx-lm's parser reads the whole text
        for name, args in parse_whole(self.syntax, call.text, self.tools):
            start = ToolCallStart(len(self.calls), call_id(), name)
            events += [start, ToolCallDelta(start.index, args)] + self._ended(start, args)
        return events

    def _ended(self, start: ToolCallStart, args: str) -> list:
        end = ToolCallEnd(start.index, start.id, start.name, args)
        self.calls.append(end)
        return [end]

    # -- the generic format --------------------------------------------------------------------
    def _generic(self, items: list[tuple]) -> list:
        events = []
        for item in items:
            if item[0] == "content":
                events.append(ContentDelta(item[1]))
            elif item[0] == "start":
                self._call_start = ToolCallStart(len(self.calls), call_id(), item[1])
                self._call = self.generic.call
                events.append(self._call_start)
            elif item[0] == "args":
                events.append(ToolCallDelta(self._call_start.index, item[1]))
            elif item[0] == "whole":
                start = ToolCallStart(len(self.calls), call_id(), item[1])
                events += [start, ToolCallDelta(start.index, item[2])] + self._ended(start, item[2])
        return events

    # -- harmony --------------------------------------------------------------------------------
    def _harmony(self, pieces: list[tuple]) -> list:
        events = []
        for kind, channel, recipient, text in pieces:
            call = channel == "commentary" and (recipient or "").startswith("functions.") and self.syntax is not None
            if kind == "end":
                if call and self._call_start is not None:
                    events += self._ended(self._call_start, self._harmony_args)
                    self._call_start = None
                continue
            if channel == "analysis":
                events.append(ThinkingDelta(text))
            elif call:
                if self._call_start is None:
                    self._call_start = ToolCallStart(len(self.calls), call_id(), recipient[len("functions."):])
                    self._harmony_args = ""
                    events.append(self._call_start)
                self._harmony_args += text
                events.append(ToolCallDelta(self._call_start.index, text))
            else:
                events.append(ContentDelta(text))
        return events


def _state_machine(thinking: Thinking | None, syntax: ToolSyntax | None):
    """mlx-lm's TextStateMachine with the transitions its server builds (make_text_state_machine):
    the thought's markers, and a native syntax's call markers when tools are offered."""
    from mlx_lm.generate import TextStateMachine

    transitions: dict[str, list] = {}
    if thinking is not None:
        transitions["normal"] = [(thinking.start, "reasoning")]
        transitions["reasoning"] = [(thinking.end, "normal")]
    if syntax is not None and syntax.kind == "native":
        transitions.setdefault("normal", []).append((syntax.start, "tool"))
        if thinking is not None:
            transitions["reasoning"].append((syntax.start, "tool"))
        transitions["tool"] = [(syntax.end, "normal")] if syntax.end else []
    return TextStateMachine(transitions or None)
