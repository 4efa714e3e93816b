"""Per-request sampling parameters and the sampler that applies them.

The filters are mlx-lm's own (`apply_top_p`, `apply_min_p`, `apply_top_k`) in the
same order as `mlx_lm.sample_utils.make_sampler`, so a request samples from
exactly the distribution mlx-lm would. The difference is the random key: each
request owns a key derived from its seed, so rows of a batch sample
independently and a seeded request is reproducible whatever else is running.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


# Every stop string is searched in the text after each token: a bound keeps that cheap.
# (OpenAI takes 4; vLLM does not bound them.)
MAX_STOP_STRINGS = 16


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

    def __post_init__(self):
        # NOTE: the one check the CLI, the server and the Python API share; every message starts
        # with the field's name (the server reports it as the error's `param`).
        self.stop = _stop_strings(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(_is_int(t) and t >= 0
                                                                         for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), got {_show(self.stop_token_ids)}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        _check_real("temperature", self.temperature, lambda x: x >= 0, "must be >= 0")
        _check_real("top_p", self.top_p, lambda x: 0 < x <= 1, "must be in (0, 1]")
        _check_real("min_p", self.min_p, lambda x: 0 <= x <= 1, "must be in [0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {_show(self.top_k)}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {_show(self.max_tokens)}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer from 0 to 2**64 - 1, got {_show(self.seed)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x) -> bool:
    # numpy integers count; True is an int to Python but not a count or a seed.
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _show(x) -> str:
    r = repr(x)
    return r if len(r) <= 60 else r[:57] + "..."


def _check_real(name: str, x, in_range: Callable[[float], bool], rule: str) -> None:
    """Raise "NAME RULE, got X" unless x is a finite real number (not a bool) and in_range(x)."""
    if not (isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and in_range(x)):
        raise ValueError(f"{name} {rule}, got {_show(x)}")


def _stop_strings(stop) -> list[str]:
    """The stop strings as a list: a string is one stop string; None is none; empty strings are dropped.

    An empty stop string would match before every character: it stops nothing.
    """
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop):
        raise ValueError(f"stop must be a string or a list of strings, got {_show(stop)}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    return [x for x in stop if x]


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
