"""What a decode step costs: the time model SpecDecoder weighs drafts against.

A step that computes `tokens` tokens (rows x width) takes A + b * tokens seconds. The
decoder (macinfer.spec_decode.decoder) fits A and b on the decode-only steps it sees, and
picks the number of drafts per row that maximises expected tokens per second.
"""

from __future__ import annotations


class StepCost:
    """Decode step time as A + b * tokens: a linear fit with forgetting, plus a prior.

    The prior (cost of a token = `prior_slope` x the first step measured) stands in
    until steps of different sizes have been measured; it is forgotten like any
    observation. It is optimistic on purpose: steps of one size (a batch that never
    drafts) cannot measure the slope, so a pessimistic prior would keep K at 0 and
    never learn otherwise (at 0.1, 8 requests of SmolLM2 with a feature draft never
    drafted); an optimistic one gets drafting tried, and the verify steps it costs
    measure the real slope (float32 + OpenBLAS: 1 -> 8 tokens took 104 -> 160 ms,
    ~0.07 per token at first and flatter after; a quantised model on a CPU: ~1).
    """

    # How fast each kind of step's offset from the fit follows new steps (see `observe`).
    RESIDUAL_DECAY = 0.9

    def __init__(self, decay: float = 0.95, prior_slope: float = 0.03, prior_weight: float = 3.0):
        self.decay, self.prior_slope, self.prior_weight = decay, prior_slope, prior_weight
        self.s = None  # weighted sums: w, x, y, xx, xy
        # Mean offset from the fit of steps run synchronously (they draft) and queued ones.
        self.residual = {True: 0.0, False: 0.0}

    def _add(self, x: float, y: float, w: float) -> None:
        s = self.s
        for i, v in enumerate((w, w * x, w * y, w * x * x, w * x * y)):
            s[i] += v

    def observe(self, tokens: int, seconds: float, sync: bool = False) -> None:
        """Add one measured decode step; older ones (and the prior) weigh `decay` times less.

        Args:
            tokens: the tokens the step computed (rows x width).
            seconds: its wall time, drafting excluded.
            sync: a synchronous step (one that drafts, or was planned to): nothing of the host's
                work per step overlaps a step queued behind it, as it does for queued steps. The
                two kinds' mean offsets from the one fit say what going synchronous costs.
        """
        if self.s is not None:
            r = self.RESIDUAL_DECAY
            self.residual[sync] = r * self.residual[sync] + (1 - r) * (seconds - self(tokens))
        if self.s is None:
            self.s = [0.0] * 5
            # Prior: two points on the line through this one with the prior slope.
            base = seconds / (1 + self.prior_slope * (tokens - 1))
            for x in (1, 1 + 8 * max(1, tokens)):
                self._add(x, base * (1 + self.prior_slope * (x - 1)), self.prior_weight / 2)
        self.s = [v * self.decay for v in self.s]
        self._add(tokens, seconds, 1.0)

    @property
    def ready(self) -> bool:
        return self.s is not None

    def coeffs(self) -> tuple[float, float]:
        """The fit's coefficients (only once `ready`).

        Returns:
            (A, b): fixed cost per step and cost per token, in seconds; b >= 0 and A > 0.
        """
        w, x, y, xx, xy = self.s
        den = w * xx - x * x
        b = (w * xy - x * y) / den if den > 1e-9 * w * w else 0.0
        b = max(b, 0.0)
        a = max((y - b * x) / w, 1e-6)
        return a, b

    def __call__(self, tokens: int, sync: bool | None = None) -> float:
        """A decode step's time for `tokens`; with `sync`, as that kind of step (synchronous or queued)."""
        a, b = self.coeffs()
        return a + b * tokens + (self.residual[sync] if sync is not None else 0.0)

    @property
    def sync_penalty(self) -> float:
        """What a synchronous step costs over a queued one of the same size (seconds, >= 0)."""
        return max(0.0, self.residual[True] - self.residual[False])


def predicted_speedup(cost, round_s: float, rows: int, spec_steps: float, drafted: float, accepted: float,
                      plain_tokens: float) -> float | None:
    """The decode speed-up speculation should give, from what was drafted and the measured costs.

    A verify step of `rows` rows with k drafts each emits 1 + m tokens per row on average (m the
    drafts accepted per step) and takes T(rows x (1 + k)) + k x D, against T(rows) for a plain step
    (T: a decode step's measured time, `cost(tokens)`; D: one draft round, `round_s`). Steps that
    drafted nothing cost T(rows) each:

        speed-up = T(B) x (plain + S (1 + m)) / (plain x T(B) + S (T(B (1 + k)) + k D))

    with S the verify steps, plain the tokens of steps without drafts, per row. m and k come from
    the requests' own counts (accepted / S, drafted / S), so the model needs no acceptance rate
    per position: 1 + m is the expected tokens per step, (1 - a^(k+1)) / (1 - a) for a chain whose
    drafts are each accepted with probability a.

    Returns None when nothing was drafted.
    """
    if spec_steps <= 0:
        return None
    m, k = accepted / spec_steps, drafted / spec_steps
    t1 = cost(rows)
    tokens = plain_tokens + spec_steps * (1 + m)
    seconds = plain_tokens * t1 + spec_steps * (cost(rows * (1 + k)) + k * round_s)
    return t1 * tokens / seconds
