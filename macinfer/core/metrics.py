"""Per-request timing and the figures derived from it.

A request's life, as the engine stamps it:

    arrival ──prefill──> first_token ──decode (n-1 tokens)──> finish
    |<-------- TTFT ------->|<------------ decode time --------->|

Prefill tok/s counts only the prompt tokens actually computed (cached prefix
tokens are free), and is None when the prefix cache held the whole prompt: the
few tokens left are one forward's fixed cost, not a rate. Decode tok/s counts
the tokens after the first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_cached: bool = False  # every full block of the prompt came from the prefix cache
    generation_tokens: int = 0
    # Speculative decoding: tokens proposed by the drafter and accepted by the target.
    draft_tokens: int = 0
    accepted_tokens: int = 0
    spec_steps: int = 0  # decode steps that verified drafts
    lookup_draft_tokens: int = 0  # of draft_tokens, those proposed by n-gram lookup (and accepted)
    lookup_accepted_tokens: int = 0
    # Mean context length (tokens in the KV cache) over decode steps: for bandwidth.
    kv_tokens_sum: int = 0
    decode_steps: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def prefill_tps(self) -> float | None:
        ttft = self.ttft
        computed = self.prompt_tokens - self.cached_tokens
        if not ttft or ttft <= 0 or self.prompt_cached:
            return None
        return computed / ttft

    @property
    def decode_time(self) -> float | None:
        if self.first_token_time is None or self.finish_time is None:
            return None
        return self.finish_time - self.first_token_time

    @property
    def decode_tps(self) -> float | None:
        t = self.decode_time
        if not t or t <= 0 or self.generation_tokens < 2:
            return None
        return (self.generation_tokens - 1) / t

    @property
    def decode_forward_rate(self) -> float | None:
        """Target forward passes per second of decode. Each forward reads the weights once and
        yields one token plus the drafts it accepted, so with speculation this is below decode_tps:
        bandwidth is bytes per forward x forwards per second, not x tokens per second."""
        t = self.decode_time
        n = self.generation_tokens - 1 - self.accepted_tokens
        if not t or t <= 0 or n < 1:
            return None
        return n / t

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def accepted_per_step(self) -> float | None:
        return self.accepted_tokens / self.spec_steps if self.spec_steps else None

    @property
    def mean_kv_tokens(self) -> float:
        return self.kv_tokens_sum / self.decode_steps if self.decode_steps else float(self.prompt_tokens)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(
            ttft=self.ttft,
            prefill_tps=self.prefill_tps,
            decode_tps=self.decode_tps,
            acceptance_rate=self.acceptance_rate,
            accepted_per_step=self.accepted_per_step,
        )
        return d
