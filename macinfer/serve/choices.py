"""One choice of an OpenAI response, built from its request's stream of deltas.

A response holds one choice per sample (`n`); each choice follows one engine request.
`Choice.add(delta)` turns a StreamDelta into OpenAI's shapes: the streamed choice object of a
chunk, and the pieces the non-streamed choice is assembled from. A chat choice reads its deltas
through the request's OutputParser (macinfer.chat.output), whose events it renders:

    ThinkingDelta      "reasoning_content" (vLLM's and DeepSeek's name) and "reasoning" (mlx-lm's)
    ContentDelta       "content"
    ToolCallStart      a "tool_calls" item: index, id, type, function name, arguments ""
    ToolCallDelta      a "tool_calls" item: index, function.arguments (more of them), as OpenAI streams
    Finish             "finish_reason" ("tool_calls" when a call was made and the model stopped)

Token logprobs are shaped as the endpoint wants them:

    chat         "logprobs": {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}
    completions  "logprobs": {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}

A token's string is its own decoded text (a byte-level piece of a character decodes to
U+FFFD, as in other servers); `bytes` are that string's UTF-8 bytes.
"""

from __future__ import annotations

from macinfer.chat.events import ContentDelta, Finish, ThinkingDelta, ToolCallDelta, ToolCallEnd, ToolCallStart


class Choice:
    """Args:
        index: the choice's index in the response.
        chat: chat.completion shapes (else text_completion).
        tokenizer: mlx-lm's TokenizerWrapper (token strings).
        logprobs: include logprobs (the engine request asked for them).
        token_ids: include `token_ids` (vLLM's return_token_ids).
        parser: the chat reply's OutputParser (chat only).
    """

    def __init__(self, index: int, chat: bool, tokenizer, logprobs: bool = False, token_ids: bool = False,
                 parser=None):
        self.index, self.chat, self.tokenizer = index, chat, tokenizer
        self.want_logprobs, self.want_ids = logprobs, token_ids
        self.parser = parser
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[ToolCallEnd] = []
        self.finish: Finish | None = None
        self.output = None  # the RequestOutput, once finished
        self._offset = 0  # completions' text_offset

    # -- streamed --------------------------------------------------------------------------
    def add(self, delta) -> dict | None:
        """Take one delta; return the streamed choice object for it (None: nothing to send)."""
        if delta.finish_reason is not None:
            self.output = delta.output
        lp = self._logprobs(delta.logprobs or []) if self.want_logprobs else None
        if not self.chat:
            self.text.append(delta.text)
            finish = delta.finish_reason
            if not (delta.text or finish or (self.want_ids and delta.token_ids) or (lp and self._has_items(lp))):
                return None
            body = {"index": self.index, "text": delta.text, "logprobs": lp, "finish_reason": finish}
        else:
            message = self._render(self.parser.feed(delta))
            finish = self.finish.reason if self.finish is not None else None
            if not (message or finish or (self.want_ids and delta.token_ids) or (lp and self._has_items(lp))):
                return None
            body = {"index": self.index, "delta": message, "logprobs": lp, "finish_reason": finish}
        if self.want_ids:
            body["token_ids"] = list(delta.token_ids)
        return body

    def _render(self, events: list) -> dict:
        """One chunk's delta for a delta's events (several calls' pieces in one `tool_calls` list)."""
        content, thought, calls = [], [], []
        for e in events:
            if isinstance(e, ContentDelta):
                content.append(e.text)
            elif isinstance(e, ThinkingDelta):
                thought.append(e.text)
            elif isinstance(e, ToolCallStart):
                calls.append({"index": e.index, "id": e.id, "type": "function",
                              "function": {"name": e.name, "arguments": ""}})
            elif isinstance(e, ToolCallDelta):
                if calls and calls[-1]["index"] == e.index:
                    calls[-1]["function"]["arguments"] += e.arguments
                else:
                    calls.append({"index": e.index, "function": {"arguments": e.arguments}})
            elif isinstance(e, ToolCallEnd):
                self.tool_calls.append(e)
            elif isinstance(e, Finish):
                self.finish = e
        message = {}
        if thought:
            text = "".join(thought)
            self.reasoning.append(text)
            message |= {"reasoning_content": text, "reasoning": text}
        if content:
            text = "".join(content)
            self.text.append(text)
            message["content"] = text
        if calls:
            message["tool_calls"] = calls
        return message

    def first_chunk(self) -> dict:
        """Chat streams open each choice with the assistant's role."""
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    # -- whole -----------------------------------------------------------------------------
    def final(self) -> dict:
        """The non-streamed choice, after every delta went through `add`."""
        out = self.output
        lp = self._logprobs(out.logprobs or [], offset=0) if self.want_logprobs else None
        text = "".join(self.text)
        if not self.chat:
            choice = {"index": self.index, "finish_reason": out.finish_reason, "logprobs": lp, "text": text}
        else:
            message = {"role": "assistant", "content": text if text or not self.tool_calls else None}
            if self.reasoning:
                thought = "".join(self.reasoning)
                message |= {"reasoning_content": thought, "reasoning": thought}
            if self.tool_calls:
                message["tool_calls"] = [{"id": c.id, "type": "function",
                                          "function": {"name": c.name, "arguments": c.arguments}}
                                         for c in self.tool_calls]
            choice = {"index": self.index, "finish_reason": self.finish.reason, "logprobs": lp, "message": message}
        if self.want_ids:
            choice["token_ids"] = list(out.token_ids)
        return choice

    @property
    def reasoning_tokens(self) -> int:
        return self.finish.usage.reasoning_tokens if self.finish is not None else 0

    # -- logprobs ----------------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    @staticmethod
    def _has_items(lp: dict) -> bool:
        return bool(lp.get("content") or lp.get("tokens"))

    def _logprobs(self, items: list, offset: int | None = None) -> dict:
        """OpenAI's logprobs object for TokenLogprobs `items` (offset: completions' first text_offset)."""
        if self.chat:
            def one(t, lp):
                s = self._token(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
            return {"content": [one(e.token_id, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]}
                                for e in items]}
        tokens = [self._token(e.token_id) for e in items]
        pos = self._offset if offset is None else offset
        offsets = []
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        if offset is None:
            self._offset = pos
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in items],
                "top_logprobs": [{self._token(t): lp for t, lp in e.top} for e in items], "text_offset": offsets}
