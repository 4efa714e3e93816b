"""One choice of an OpenAI response, built from its request's stream of deltas.

A response holds one choice per sample (`n`); each choice follows one engine request.
`Choice.add(delta)` turns a StreamDelta into OpenAI's shapes: the streamed choice
object of a chunk, and the pieces the non-streamed choice is assembled from. Text goes
through the tool-call splitter when the request has tools (macinfer.serve.tools), and
token logprobs are shaped as the endpoint wants them:

    chat         "logprobs": {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}
    completions  "logprobs": {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}

A token's string is its own decoded text (a byte-level piece of a character decodes to
U+FFFD, as in other servers); `bytes` are that string's UTF-8 bytes.
"""

from __future__ import annotations

from macinfer.serve.tools import ToolCallText, finish_reason


class Choice:
    """Args:
        index: the choice's index in the response.
        chat: chat.completion shapes (else text_completion).
        tokenizer: mlx-lm's TokenizerWrapper (token strings, tool parsing).
        logprobs: include logprobs (the engine request asked for them).
        token_ids: include `token_ids` (vLLM's return_token_ids).
        tools: the request's tools (chat), or None.
        streaming: tool calls get their streamed `index`.
    """

    def __init__(self, index: int, chat: bool, tokenizer, logprobs: bool = False, token_ids: bool = False,
                 tools: list[dict] | None = None, streaming: bool = False):
        self.index, self.chat, self.tokenizer = index, chat, tokenizer
        self.want_logprobs, self.want_ids = logprobs, token_ids
        self.tools = ToolCallText(tokenizer, tools, streaming) if tools else None
        self.text: list[str] = []
        self.tool_calls: list[dict] = []
        self.output = None  # the RequestOutput, once finished
        self._offset = 0  # completions' text_offset

    # -- streamed --------------------------------------------------------------------------
    def add(self, delta) -> dict | None:
        """Take one delta; return the streamed choice object for it (None: nothing to send)."""
        text, calls = delta.text, []
        if self.tools is not None:
            text, calls = self.tools.feed(delta.text)
        finish = None
        if delta.finish_reason is not None:
            self.output = delta.output
            finish = delta.finish_reason
            if self.tools is not None:
                tail, more = self.tools.finish(finish)
                text, calls = text + tail, calls + more
                finish = finish_reason(finish, self.tools.made_call)
        self.text.append(text)
        self.tool_calls += calls
        lp = self._logprobs(delta.logprobs or []) if self.want_logprobs else None
        if not (text or calls or finish or (self.want_ids and delta.token_ids) or (lp and self._has_items(lp))):
            return None
        if self.chat:
            body = {"index": self.index, "delta": ({"content": text} if text else {})
                    | ({"tool_calls": calls} if calls else {}), "logprobs": lp, "finish_reason": finish}
        else:
            body = {"index": self.index, "text": text, "logprobs": lp, "finish_reason": finish}
        if self.want_ids:
            body["token_ids"] = list(delta.token_ids)
        return body

    def first_chunk(self) -> dict:
        """Chat streams open each choice with the assistant's role."""
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    # -- whole -----------------------------------------------------------------------------
    def final(self) -> dict:
        """The non-streamed choice, after every delta went through `add`."""
        out = self.output
        finish = out.finish_reason if self.tools is None else finish_reason(out.finish_reason, self.tools.made_call)
        text = "".join(self.text)
        lp = self._logprobs(out.logprobs or [], offset=0) if self.want_logprobs else None
        choice = {"index": self.index, "finish_reason": finish, "logprobs": lp}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text if text or not self.tool_calls else None}
            if self.tool_calls:
                choice["message"]["tool_calls"] = self.tool_calls
        else:
            choice["text"] = text
        if self.want_ids:
            choice["token_ids"] = list(out.token_ids)
        return choice

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
