"""Tool calls: `tools` go to the model's chat template; calls are parsed from the output.

Both halves are mlx-lm's, as its server uses them (reused, not copied): the tokenizer
wrapper knows the model's tool parser (`tokenizer.tool_parser`, `tool_call_start` /
`tool_call_end`, inferred from the chat template, mlx_lm/tool_parsers/); the text is
split into content and tool-call text by mlx-lm's `TextStateMachine` (markers matched on
text, held back while a partial marker could still match); each call's text is parsed and
shaped as OpenAI's `tool_calls` by `mlx_lm.server.ToolCallFormatter`.

Design choices:
- `tool_choice` "auto" (the default) and "none" (tools not rendered, nothing parsed).
  "required" and a named function would need the output constrained: refused (400).
- A call is streamed whole, in one `tool_calls` delta, once its end marker is seen
  (as mlx-lm's server does; OpenAI's SDK accumulates deltas either way).
- `finish_reason` is "tool_calls" when a call was made and the model stopped by itself.
"""

from __future__ import annotations

from typing import Any

from macinfer.serve.schemas import APIError


def request_tools(tools: list[dict] | None, tool_choice: Any, tokenizer) -> list[dict] | None:
    """The tools to render and parse for a chat request, or None.

    Raises:
        APIError: 400 for a tool_choice we cannot honour, or tools for a model without tool calling.
    """
    if not tools or tool_choice == "none":
        return None
    if tool_choice not in (None, "auto"):
        raise APIError(400, "tool_choice must be 'auto' or 'none' here ('required' and a named function "
                            "would need constrained decoding)", "tool_choice", "unsupported_parameter")
    if not getattr(tokenizer, "has_tool_calling", False):
        raise APIError(400, "this model's chat template has no tool calling (mlx-lm finds no tool parser "
                            "for it): send the request without tools", "tools", "unsupported_parameter")
    return tools


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: tool call arguments as objects, not JSON text.

    Raises:
        APIError: 400 if a tool call's arguments are not valid JSON.
    """
    from mlx_lm.server import process_message_content

    try:
        process_message_content(messages)
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise APIError(400, f"a message's tool_calls arguments are not valid JSON: {e}", "messages") from None
    return messages


class ToolCallText:
    """One choice's output split into content and tool calls, as it streams.

    Args:
        tokenizer: mlx-lm's TokenizerWrapper (has_tool_calling).
        tools: the request's tools (handed to the parser).
        streaming: tool calls get an `index` (OpenAI's streamed shape).
    """

    def __init__(self, tokenizer, tools: list[dict], streaming: bool):
        from mlx_lm.generate import TextStateMachine
        from mlx_lm.server import ToolCallFormatter

        start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
        sm = TextStateMachine({"normal": [(start, "tool")], "tool": [(end, "normal")] if end else []})
        self._machine = TextStateMachine
        self._state = sm.make_state("normal")
        self._format = ToolCallFormatter(tokenizer.tool_parser, tools, streaming)
        self._tool_text = ""
        self.made_call = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """New text -> (content to emit, finished tool calls in OpenAI's shape)."""
        self._state, segments = self._machine.split(self._state, text)
        return self._take(segments)

    def finish(self, finish_reason: str | None) -> tuple[str, list[dict]]:
        """The end: a held-back tail is content on "length", dropped on "stop" (mlx-lm's rule)."""
        if finish_reason == "length":
            self._state, tail, state = self._machine.flush(self._state)
            segments = [(state, tail)]
        else:
            self._state, state = self._machine.discard(self._state)
            segments = [(state, "")]
        content, calls = self._take(segments)
        if self._tool_text:  # the output ended inside a call (no end marker, or a stop string)
            calls += self._format([self._tool_text])
            self._tool_text = ""
        self.made_call |= bool(calls)
        return content, calls

    def _take(self, segments: list[tuple[str, str]]) -> tuple[str, list[dict]]:
        content, texts = [], []
        for state, text in segments:
            if state == "tool":
                self._tool_text += text
            else:
                if self._tool_text:
                    texts.append(self._tool_text)
                    self._tool_text = ""
                content.append(text)
        calls = self._format(texts)
        self.made_call |= bool(calls)
        return "".join(content), calls


def finish_reason(reason: str | None, made_call: bool) -> str | None:
    return "tool_calls" if reason == "stop" and made_call else reason
