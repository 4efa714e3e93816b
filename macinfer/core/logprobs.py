"""Log-probabilities of the sampled tokens and their most likely alternatives (OpenAI's
`logprobs` / `top_logprobs`).

What is reported is mlx-lm's `logprobs`: log_softmax of the logits after the request's
logits processors (penalties, logit_bias) and before temperature and top-p / top-k / min-p,
the distribution `generate_step` hands its sampler. They are computed on the device with
the step (only for requests that ask), and read back with the sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx


@dataclass
class TokenLogprob:
    """One generated token's log-probability and the `top` most likely tokens at its position.

    `top` is sorted most likely first: [(token id, logprob), ...].
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def top_k_logprobs(logprobs: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k largest entries of logprobs (N, V), unsorted: (ids (N, k), values (N, k))."""
    k = min(k, logprobs.shape[-1])
    ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    return ids, mx.take_along_axis(logprobs, ids, axis=-1)


def entry(token: int, chosen: float, top_ids: list[int], top_vals: list[float]) -> TokenLogprob:
    top = sorted(zip(top_ids, top_vals), key=lambda t: -t[1])
    return TokenLogprob(token, chosen, top)


def from_vector(logprobs: mx.array, token: int, k: int) -> TokenLogprob:
    """The entry of `token` from a (V,) logprobs vector (mlx-lm's BatchGenerator responses)."""
    if not k:
        return TokenLogprob(token, logprobs[token].item())
    ids, vals = top_k_logprobs(logprobs[None], k)
    return entry(token, logprobs[token].item(), ids[0].tolist(), vals[0].tolist())


class LogprobRows:
    """The logprobs of one step's sampled tokens, built lazily with the step.

    `add` records a row's arrays; `arrays()` go into the step's mx.eval (or async_eval);
    `deliver()` reads them back and sets each sequence's `pending_logprob`, which the
    scheduler appends with the token (macinfer.core.stop_checker.StopChecker.append).
    """

    def __init__(self):
        self._rows: list[tuple] = []  # (sequence, token, chosen logprob, top ids or None, top values or None)

    def __bool__(self) -> bool:
        return bool(self._rows)

    def add(self, seq, logprobs: mx.array, token: mx.array) -> None:
        """Row of seq: its logprobs (1, V) and its sampled token (1,), both lazy."""
        chosen = mx.take_along_axis(logprobs, token.reshape(1, 1).astype(mx.int32), axis=-1).reshape(1)
        k = seq.params.logprobs or 0
        ids, vals = top_k_logprobs(logprobs, k) if k else (None, None)
        self._rows.append((seq, token, chosen, ids, vals))

    def arrays(self) -> list[mx.array]:
        return [a for row in self._rows for a in row[1:] if a is not None]

    def deliver(self) -> None:
        for seq, token, chosen, ids, vals in self._rows:
            seq.pending_logprob = entry(token.item(), chosen.item(),
                                        [] if ids is None else ids[0].tolist(), [] if vals is None else vals[0].tolist())
        self._rows = []
