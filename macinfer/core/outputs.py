"""What the engine hands back: finished outputs and streamed deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

from macinfer.core.metrics import RequestMetrics


@dataclass
class RequestOutput:
    """A request's result.

    finish_reason is "stop" (EOS, stop token or stop string), "length"
    (max_tokens or the context limit) or "abort".
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    logprobs: list | None = None  # a TokenLogprob per token_ids entry, if asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StreamDelta:
    """One streamed piece: new text and tokens since the last delta.

    The last delta of a request has finish_reason set and `output` holding the
    whole RequestOutput with its metrics.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    output: RequestOutput | None = None
    logprobs: list | None = None  # a TokenLogprob per token_ids entry, if asked for
