"""The engines' output side: the requests in flight, and what each step streams back for them.

    output = OutputProcessor()
    output.add(seq)                              # when a request is queued
    deltas = output.deltas(moved)                 # after a step: moved = what the scheduler updated

A StreamDelta carries a request's new text, token ids and logprobs since its last delta; a
finished request's last delta also carries its RequestOutput (text, tokens, metrics). Text that
may still become a stop string is held back (macinfer.core.stop_checker.held_back), so nothing
streamed is ever taken back. Both engines (the paged LLMEngine and the mlx-lm fallback
DenseEngine) hand their steps' sequences here, so they stream and finish identically (vLLM's
OutputProcessor, mlx-lm server's text state machine).
"""

from __future__ import annotations

import time

from macinfer.core.metrics import RequestMetrics
from macinfer.core.outputs import RequestOutput, StreamDelta
from macinfer.core.sequence import Sequence
from macinfer.core.stop_checker import held_back


class OutputProcessor:
    """The requests an engine has in flight, and their streamed deltas."""

    def __init__(self):
        self.requests: dict[str, Sequence] = {}
        self._pending: list[StreamDelta] = []  # final deltas of aborted requests, for the next step

    def add(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq

    def get(self, request_id: str) -> Sequence | None:
        return self.requests.get(request_id)

    def metrics(self, request_id: str) -> RequestMetrics | None:
        """A request's live metrics (None once it has finished)."""
        seq = self.requests.get(request_id)
        return seq.metrics if seq is not None else None

    def aborted(self, seq: Sequence) -> None:
        """seq was aborted: its final delta goes out with the next step."""
        self._pending.append(self.finish(seq))

    def take_pending(self) -> list[StreamDelta]:
        out, self._pending = self._pending, []
        return out

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def deltas(self, seqs: list[Sequence]) -> list[StreamDelta]:
        """A StreamDelta for each sequence that moved this step and has something to stream (in order).

        A sequence that finished gets its final delta (with `output`) and leaves the request table.
        """
        out = []
        for seq in seqs:
            if seq.request_id not in self.requests:
                continue  # its final delta went out already
            end = max(seq.num_emitted_chars, len(seq.text) - held_back(seq))
            delta = self.finish(seq) if seq.is_finished else self._delta(seq, end)
            if delta is not None:
                out.append(delta)
        return out

    def _delta(self, seq: Sequence, end: int) -> StreamDelta | None:
        text = seq.text[seq.num_emitted_chars: end]
        new_ids = seq.token_ids[seq.num_prompt_tokens + seq.num_emitted_tokens:]  # not output_token_ids[...]: two copies
        if not text and not new_ids:
            return None
        logprobs = None if seq.logprobs is None else seq.logprobs[seq.num_emitted_tokens:]
        seq.num_emitted_chars = max(seq.num_emitted_chars, end)
        seq.num_emitted_tokens = seq.num_output_tokens
        return StreamDelta(seq.request_id, text, new_ids, logprobs=logprobs)

    def finish(self, seq: Sequence) -> StreamDelta:
        """The final delta of a finished sequence, with its RequestOutput; seq leaves the request table."""
        seq.finalize_text()
        seq.metrics.finish_time = time.perf_counter()
        seq.metrics.generation_tokens = seq.num_output_tokens
        last = self._delta(seq, len(seq.text)) or StreamDelta(seq.request_id, "", [])
        output = RequestOutput(request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
                               token_ids=seq.output_token_ids, text=seq.text, finish_reason=seq.finish_reason,
                               metrics=seq.metrics, logprobs=seq.logprobs)
        delta = StreamDelta(seq.request_id, last.text, last.token_ids, seq.finish_reason, output, last.logprobs)
        self.requests.pop(seq.request_id, None)
        seq.grammar = None  # its matcher's memory goes now, not when the last reference to seq does
        return delta


class RequestTable:
    """The request-table part of the Engine protocol, for an engine whose `output` is an OutputProcessor."""

    output: OutputProcessor

    @property
    def requests(self) -> dict[str, Sequence]:
        """The requests in flight by id."""
        return self.output.requests

    def request_ids(self) -> list[str]:
        return list(self.output.requests)

    def request_metrics(self, request_id: str) -> RequestMetrics | None:
        return self.output.metrics(request_id)
