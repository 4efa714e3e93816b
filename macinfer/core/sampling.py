"""The sampler that applies a request's SamplingParams (defined in macinfer.core.sampling_params).

The filters are mlx-lm's own (`apply_top_p`, `apply_min_p`, `apply_top_k`) in the
same order as `mlx_lm.sample_utils.make_sampler`, so a request samples from
exactly the distribution mlx-lm would. The difference is the random key: each
request owns a key derived from its seed, so rows of a batch sample
independently and a seeded request is reproducible whatever else is running.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from macinfer.core.sampling_params import SamplingParams  # noqa: F401  (re-exported: its home for most callers)


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
