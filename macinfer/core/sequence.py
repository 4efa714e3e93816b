"""One request as the engine tracks it: tokens, KV progress, blocks, status.

There is no prefill or decode *phase*. A sequence has `token_ids` (prompt +
generated) and `num_computed_tokens`, the prefix whose K/V is in the cache. Each
step the scheduler picks how many of the remaining tokens to compute:

    token_ids            [p0 p1 p2 p3 p4 p5 | g0 g1]      num_tokens = 8
    KV cache             [p0 p1 p2 p3 p4 p5   g0]         num_computed_tokens = 7
                                                  ^ 1 token left: a "decode"

A fresh prompt has all of them left (chunked prefill eats them a budget at a
time); a preempted sequence drops back to num_computed_tokens = 0 and recomputes
prompt and output alike. Whenever a step makes num_computed_tokens reach
num_tokens, the last position's logits give the next token.
"""

from __future__ import annotations

import enum
import itertools
from typing import Any

from macinfer.core.metrics import RequestMetrics
from macinfer.core.sampling import Sampler, SamplingParams
from macinfer.modelio.multimodal import MultiModalInputs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


class Sequence:
    """A request in flight.

    Args:
        request_id: unique id chosen by the caller (or the engine).
        prompt_token_ids: the prompt, already tokenized (non-empty).
        params: sampling parameters; a per-request Sampler is built from them.
        max_tokens: the effective limit (params.max_tokens capped by the context).
        detokenizer: an mlx-lm streaming detokenizer for this request, or None.
        arrival_time: perf_counter() stamp for its metrics.
        grammar: its structured output's llguidance matcher (macinfer.core.grammar), or None.
        fork_of: n > 1: the sequence whose prompt blocks this one shares (macinfer.core.scheduler: forks).
        mm: the prompt's images (macinfer.modelio.multimodal), or None for text only.
    """

    _counter = itertools.count()

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int | None = None,
        detokenizer: Any = None,
        arrival_time: float = 0.0,
        grammar: Any = None,
        fork_of: "Sequence | None" = None,
        mm: MultiModalInputs | None = None,
    ):
        self.request_id = request_id
        self.seq_no = next(Sequence._counter)  # admission order tie-breaker
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # Speculative decoding (macinfer.spec_decode.decoder): drafted tokens to verify this step, and
        # the (k, V) draft distributions they were drawn from (None: a deterministic drafter).
        self.spec_token_ids: list[int] = []
        self.spec_probs = None
        self.status = SequenceStatus.WAITING
        self.params = params
        self.sampler = Sampler(params)
        # Structured output: an llguidance matcher that has consumed exactly the generated tokens
        # (macinfer.core.grammar); None: free text.
        self.grammar = grammar
        self.max_tokens = params.max_tokens if max_tokens is None else max_tokens
        self.num_preemptions = 0
        self.fork_of = fork_of
        self.mm = mm
        self.metrics = RequestMetrics(arrival_time=arrival_time, prompt_tokens=len(prompt_token_ids))
        # Text: `text` is everything decoded so far; `num_emitted_chars` how much of
        # it has been streamed (stop strings hold some back until they are ruled out).
        self.detokenizer = detokenizer
        self.text = ""
        self.num_emitted_chars = 0
        self.num_emitted_tokens = 0
        # Logprobs (params.logprobs set): one TokenLogprob per output token, and the one the
        # runner computed for the token the engine is about to append (macinfer.core.logprobs).
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.pending_logprob = None

    # -- sizes ------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None

    # -- updates ----------------------------------------------------------------------
    def append_token(self, token_id: int, logprob=None) -> None:
        """Add a generated token (and its TokenLogprob, if asked for) and extend the decoded text."""
        self.token_ids.append(token_id)
        if self.logprobs is not None:
            assert logprob is not None and logprob.token_id == token_id, (token_id, logprob)
            self.logprobs.append(logprob)
        self.metrics.generation_tokens = self.num_output_tokens
        if self.detokenizer is not None:
            self.detokenizer.add_token(token_id)
            self.text = self.detokenizer.text

    def finalize_text(self) -> None:
        """Flush the detokenizer (bytes of a split character) at the end."""
        if self.detokenizer is not None:
            self.detokenizer.finalize()
            self.text = self.detokenizer.text

    def reset_for_recompute(self) -> None:
        """Preemption: the KV is gone, so everything is to be computed again."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.spec_token_ids, self.spec_probs = [], None
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.value})")
