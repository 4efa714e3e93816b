"""Per-request sampling parameters and the sampler that applies them.

The filters are mlx-lm's own (`apply_top_p`, `apply_min_p`, `apply_top_k`) in the
same order as `mlx_lm.sample_utils.make_sampler`, so a request samples from
exactly the distribution mlx-lm would. The difference is the random key: each
request owns a key derived from its seed, so rows of a batch sample
independently and a seeded request is reproducible whatever else is running.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from macinfer.core.grammar import StructuredOutput


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    Args:
        temperature: 0 means greedy (argmax).
        top_p: nucleus sampling, in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        min_p: drop tokens below min_p * p(top token); 0 disables it.
        seed: makes sampling reproducible; None draws a fresh seed.
        max_tokens: generated tokens at most.
        stop: strings that end generation (not included in the text).
        stop_token_ids: extra token ids that end generation (besides EOS).
        ignore_eos: keep generating past EOS (benchmarks).
        structured: the shape the output must have (a JSON schema, a regex, ...), enforced
            while sampling (macinfer.core.grammar); None: free text.

    Example:
        >>> SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64, seed=1)
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    structured: StructuredOutput | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # An empty stop string would match before every character: it stops nothing.
        self.stop = [x for x in self.stop if x]
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer from 0 to 2**64 - 1, got {self.seed}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Turns one request's logits into tokens, with the request's own RNG key."""

    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed is not None else int.from_bytes(__import__("os").urandom(4), "little")
        self.key = mx.random.key(seed)

    def filter(self, logprobs: mx.array) -> mx.array:
        """Apply top-p, min-p, top-k (mlx-lm's order) to log-probabilities (..., V)."""
        p = self.params
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p != 0.0:
            logprobs = apply_min_p(logprobs, p.min_p)
        if 0 < p.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, p.top_k)
        return logprobs

    def probs(self, logits: mx.array) -> mx.array:
        """The exact distribution this sampler draws from: (..., V) probabilities."""
        if self.params.greedy:
            return mx.eye(logits.shape[-1])[mx.argmax(logits, axis=-1)]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.softmax(self.filter(logprobs) / self.params.temperature, axis=-1)

    def next_key(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub

    def __call__(self, logits: mx.array) -> mx.array:
        """Sample token ids from logits (..., V) -> (...)."""
        if self.params.greedy:
            return mx.argmax(logits, axis=-1)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        logprobs = self.filter(logprobs)
        return mx.random.categorical(logprobs * (1.0 / self.params.temperature), key=self.next_key())
