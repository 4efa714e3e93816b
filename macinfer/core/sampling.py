"""The sampler that applies a request's SamplingParams (defined in macinfer.core.sampling_params).

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

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from macinfer.core.sampling_params import MAX_STOP_STRINGS, SamplingParams  # noqa: F401  (re-exported)


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

    def _filters(self, vocab: int) -> list:
        """The filters this request applies, in mlx-lm's order (top-p, min-p, top-k): (logprobs -> logprobs)."""
        p = self.params
        steps = []
        if 0 < p.top_p < 1.0:
            steps.append(lambda x: apply_top_p(x, p.top_p))
        if p.min_p != 0.0:
            steps.append(lambda x: apply_min_p(x, p.min_p))
        if 0 < p.top_k < vocab:
            steps.append(lambda x: apply_top_k(x, p.top_k))
        return steps

    def filter(self, logprobs: mx.array) -> mx.array:
        """Apply top-p, min-p, top-k (mlx-lm's order) to log-probabilities (..., V)."""
        for f in self._filters(logprobs.shape[-1]):
            logprobs = f(logprobs)
        return logprobs

    def probs(self, logits: mx.array) -> mx.array:
        """The exact distribution this sampler draws from: (..., V) probabilities."""
        if self.params.greedy:
            return mx.eye(logits.shape[-1])[mx.argmax(logits, axis=-1)]
        return mx.softmax(self.scaled(logits), axis=-1)

    def scaled(self, logits: mx.array) -> mx.array:
        """(..., V) logits whose softmax is `probs` (sampled requests): the filters applied, divided by the
        temperature. Without filters no log-softmax is taken first: it would not change the softmax, and
        each pass of exp over the vocabulary costs ~0.4 ms a row on MLX's CPU backend (SmolLM2's 49k)."""
        if self._filters(logits.shape[-1]):
            logits = self.filter(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        return logits * (1.0 / self.params.temperature)

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
