"""A Responses reply's output items, built from the chat events as they come, with the streaming
events OpenAI's Responses API sends for each change.

    items = OutputItems(summary=True)
    for event in chat_events:                      # macinfer.chat.events
        for e in items.add(event):                 # {"type": "response.output_text.delta", ...}
            send(e)                                # (a stream numbers them: sequence_number)
    items.items                                    # the response's `output`

Events map to items so (an item is opened by the first event of its kind, closed by the next
item or the end):

    ThinkingDelta   a `reasoning` item: its `content` a reasoning_text part, streamed as
                    response.reasoning_text.delta; with a `reasoning.summary` asked for, the
                    same text as its summary too (response.reasoning_summary_text.delta)
    ContentDelta    a `message` item with one output_text part (response.output_text.delta)
    ToolCallStart   a `function_call` item (its call_id the call's id), its arguments streamed as
    ToolCallDelta   response.function_call_arguments.delta, whole at
    ToolCallEnd     response.function_call_arguments.done
    Finish          closes the open item (`incomplete` when the reply ran out of tokens)

Every item is opened with response.output_item.added and closed with response.output_item.done;
parts with response.content_part.added / .done, as OpenAI's server sends them.
"""

from __future__ import annotations

import uuid

from macinfer.chat.events import ContentDelta, Finish, ThinkingDelta, ToolCallDelta, ToolCallEnd, ToolCallStart


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """Args:
        summary: give reasoning items a summary (the thought's text), as `reasoning.summary` asks.
    """

    def __init__(self, summary: bool = False):
        self.summary = summary
        self.items: list[dict] = []
        self.finish: Finish | None = None
        self._open: dict | None = None

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def add(self, event) -> list[dict]:
        """The streaming events for one chat event (the items are updated too)."""
        if isinstance(event, ThinkingDelta):
            return self._reasoning(event.text)
        if isinstance(event, ContentDelta):
            return self._text(event.text)
        if isinstance(event, ToolCallStart):
            out = self._close()
            item = {"type": "function_call", "id": item_id("fc"), "call_id": event.id, "name": event.name,
                    "arguments": "", "status": "in_progress"}
            return out + self._opened(item)
        if isinstance(event, ToolCallDelta):
            item = self._open
            item["arguments"] += event.arguments
            return [{"type": "response.function_call_arguments.delta", "item_id": item["id"],
                     "output_index": self._index, "delta": event.arguments}]
        if isinstance(event, ToolCallEnd):
            item = self._open
            item["arguments"] = event.arguments  # NOTE: the deltas are a prefix of it; this is the whole
            return [{"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": self._index,
                     "name": item["name"], "arguments": event.arguments}] + self._close()
        if isinstance(event, Finish):
            self.finish = event
            return self._close("incomplete" if event.reason == "length" else "completed")
        return []

    # -- items -------------------------------------------------------------------------------
    def _opened(self, item: dict) -> list[dict]:
        self.items.append(item)
        self._open = item
        return [{"type": "response.output_item.added", "output_index": self._index, "item": _copy(item)}]

    def _reasoning(self, text: str) -> list[dict]:
        out = []
        if self._open is None or self._open["type"] != "reasoning":
            out += self._close()
            item = {"type": "reasoning", "id": item_id("rs"), "summary": [], "content": [], "status": "in_progress"}
            out += self._opened(item)
            item["content"].append({"type": "reasoning_text", "text": ""})
            out.append(self._part("response.content_part.added", 0, item["content"][0]))
            if self.summary:
                item["summary"].append({"type": "summary_text", "text": ""})
                out.append({"type": "response.reasoning_summary_part.added", "item_id": item["id"],
                            "output_index": self._index, "summary_index": 0, "part": dict(item["summary"][0])})
        item = self._open
        item["content"][0]["text"] += text
        out.append({"type": "response.reasoning_text.delta", "item_id": item["id"], "output_index": self._index,
                    "content_index": 0, "delta": text})
        if self.summary:
            item["summary"][0]["text"] += text
            out.append({"type": "response.reasoning_summary_text.delta", "item_id": item["id"],
                        "output_index": self._index, "summary_index": 0, "delta": text})
        return out

    def _text(self, text: str) -> list[dict]:
        out = []
        if self._open is None or self._open["type"] != "message":
            out += self._close()
            item = {"type": "message", "id": item_id("msg"), "role": "assistant", "status": "in_progress",
                    "content": []}
            out += self._opened(item)
            item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            out.append(self._part("response.content_part.added", 0, item["content"][0]))
        item = self._open
        item["content"][0]["text"] += text
        return out + [{"type": "response.output_text.delta", "item_id": item["id"], "output_index": self._index,
                       "content_index": 0, "delta": text, "logprobs": []}]

    def _part(self, kind: str, index: int, part: dict) -> dict:
        return {"type": kind, "item_id": self._open["id"], "output_index": self._index, "content_index": index,
                "part": dict(part)}

    def _close(self, status: str = "completed") -> list[dict]:
        """Close the open item: its parts' done events, then response.output_item.done."""
        item, self._open = self._open, None
        if item is None:
            return []
        out = []
        ids = {"item_id": item["id"], "output_index": self._index}
        if item["type"] == "message":
            part = item["content"][0]
            out += [{"type": "response.output_text.done", **ids, "content_index": 0, "text": part["text"],
                     "logprobs": []},
                    {"type": "response.content_part.done", **ids, "content_index": 0, "part": dict(part)}]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out += [{"type": "response.reasoning_text.done", **ids, "content_index": 0, "text": part["text"]},
                    {"type": "response.content_part.done", **ids, "content_index": 0, "part": dict(part)}]
            if self.summary:
                s = item["summary"][0]
                out += [{"type": "response.reasoning_summary_text.done", **ids, "summary_index": 0, "text": s["text"]},
                        {"type": "response.reasoning_summary_part.done", **ids, "summary_index": 0, "part": dict(s)}]
        item["status"] = status
        return out + [{"type": "response.output_item.done", "output_index": self._index, "item": _copy(item)}]

    # -- the conversation ----------------------------------------------------------------------
    def as_message(self) -> dict:
        """The reply as one chat message (macinfer.chat's shape), for the stored conversation."""
        text = "".join(p["text"] for i in self.items if i["type"] == "message" for p in i["content"])
        thought = "".join(p["text"] for i in self.items if i["type"] == "reasoning" for p in i["content"])
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        message = {"role": "assistant", "content": text}
        if thought:
            message["reasoning_content"] = thought
        if calls:
            message["tool_calls"] = calls
        return message


def _copy(item: dict) -> dict:
    """An item as it is now (a streamed event must not change when the item grows later)."""
    return {k: ([dict(p) for p in v] if isinstance(v, list) else v) for k, v in item.items()}
