"""Per-request sampling parameters and the sampler that applies them.

The filters are mlx-lm's own (`apply_top_p`, `apply_min_p`, `apply_top_k`) in the
same order as `mlx_lm.sample_utils.make_sampler`, so a request samples from
exactly the distribution mlx-lm would. The difference is the random key: each
request owns a key derived from its seed, so rows of a batch sample
independently and a seeded request is reproducible whatever else is running.

Penalties and logit_bias are mlx-lm's logits processors (`make_logits_processors`),
applied as `generate_step` applies them: to the row's logits, given every token of the
sequence so far (prompt and output; each penalty looks at the last
`repetition_context_size` of them), before the log-softmax the sampler draws from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from macinfer.core.logprobs import MAX_TOP_LOGPROBS


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
        logprobs: None, or report each token's logprob and the `logprobs` most likely
            alternatives (0 to 20; macinfer.core.logprobs).
        presence_penalty: subtracted from the logit of each token present in the context
            window (OpenAI's range, -2 to 2).
        frequency_penalty: subtracted once per occurrence in the context window (-2 to 2).
        repetition_penalty: a multiplicative penalty (> 0; 1 disables it), as in mlx-lm.
        repetition_context_size: the last tokens the three penalties look at (mlx-lm's 20).
        logit_bias: token id -> a bias (-100 to 100) added to its logit.

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
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    logit_bias: dict[int, float] = field(default_factory=dict)

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
        self._check_logits_options()

    def _check_logits_options(self) -> None:
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS} (top alternatives), "
                             f"got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number from -2 to 2, got {v}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a number > 0 (1 disables it), got {self.repetition_penalty}")
        if not _is_int(self.repetition_context_size) or self.repetition_context_size < 1:
            raise ValueError(f"repetition_context_size must be an integer >= 1, got {self.repetition_context_size}")
        for tok, bias in dict(self.logit_bias).items():
            if not _is_int(tok) or tok < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}")
            if not _is_number(bias) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be numbers from -100 to 100, got {bias!r} for token {tok}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class Sampler:
    """Turns one request's logits into tokens, with the request's own RNG key.

    NOTE: `per_row` requests (logits processors, or logprobs asked for) are sampled from
    their own logits row with `logprobs(logits, history)` then `pick`, never in a batched
    argmax, and never draft (speculation would need the penalties at every drafted position).
    """

    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed is not None else int.from_bytes(__import__("os").urandom(4), "little")
        self.key = mx.random.key(seed)
        p, ctx = params, params.repetition_context_size
        self.processors = make_logits_processors(
            {int(k): float(v) for k, v in p.logit_bias.items()} or None,
            p.repetition_penalty if p.repetition_penalty != 1 else None, ctx,
            p.presence_penalty or None, ctx, p.frequency_penalty or None, ctx)
        self.per_row = bool(self.processors) or p.logprobs is not None

    def logprobs(self, logits: mx.array, history: mx.array | None = None) -> mx.array:
        """(1, V) logits -> (1, V) log-probabilities after the logits processors.

        history: every token id of the sequence so far (1-D), what the processors look at.
        """
        for proc in self.processors:
            logits = proc(history, logits)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def pick(self, logprobs: mx.array) -> mx.array:
        """A token id per row from log-probabilities (..., V): argmax, or a filtered draw."""
        if self.params.greedy:
            return mx.argmax(logprobs, axis=-1)
        return mx.random.categorical(self.filter(logprobs) * (1.0 / self.params.temperature), key=self.next_key())

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
        """Sample token ids from logits (..., V) -> (...), without logits processors.

        mlx-lm's BatchGenerator calls it with processed log-probabilities (DenseEngine).
        """
        if self.params.greedy:
            return mx.argmax(logits, axis=-1)
        return self.pick(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
