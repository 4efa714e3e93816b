"""What a decode step costs: the time model SpecDecoder weighs drafts against.

A step that computes `tokens` tokens (rows x width) takes A + b * tokens seconds, and c more
if it runs synchronously (it drafts). The decoder (macinfer.spec_decode.decoder) fits A, b and c
on the decode-only steps it sees, and picks the number of drafts per row that maximises expected
tokens per second.
"""

from __future__ import annotations


class StepCost:
    """Decode step time as A + b * tokens, plus c for a synchronous step: a fit with forgetting, plus a prior.

    A queued step (K = 0, the host's work overlapping the step in flight) and a synchronous one
    (it drafts, so the host waits for the step before) differ by c, what queueing hides. Every step
    that drafts is synchronous, so fitting one line through both kinds would charge c to the extra
    tokens: measured on the dev CPU (float32 SmolLM2 + OpenBLAS, a feature draft), one line gave
    9.9 ms per token where the verify forwards themselves took 48 / 54 / 59 ms for 1 / 2 / 3 tokens
    (5.5 ms per token). So the fit is weighted least squares over (1, tokens, synchronous): c is
    told apart from b by synchronous steps of different widths (or of one token: a feature draft
    that declined), and held at 0 by a small ridge where nothing tells them apart.

    The prior on b (cost of a token = `prior_slope` x the first step measured) stands in
    until steps of different sizes have been measured; it is forgotten like any
    observation. It is optimistic on purpose: steps of one size (a batch that never
    drafts) cannot measure the slope, so a pessimistic prior would keep K at 0 and
    never learn otherwise (at 0.1, 8 requests of SmolLM2 with a feature draft never
    drafted); an optimistic one gets drafting tried, and the verify steps it costs
    measure the real slope (float32 + OpenBLAS: 1 -> 8 tokens took 104 -> 160 ms,
    ~0.07 per token at first and flatter after; a quantised model on a CPU: ~1).
    NOTE: the prior is a ridge on b (worth `prior_weight` steps one token apart), not points on
    its line: points far apart pin the slope as hard as many steps would, c then takes up
    what the verify steps' own slope disagrees with, and a large c keeps steps from drafting
    (measured on the dev CPU with such points: b = 1.1-3.6 ms and c = 10-20 ms over a 64-token
    reply whose steps cost 5.3 ms per token and 2.6 ms more synchronously).
    """

    RIDGE = 0.05  # weight (in observations) holding c at 0 where the steps do not tell c from b; never forgotten
    LOWER = (1e-6, 0.0, 0.0)  # A > 0, b >= 0, c >= 0
    FAST = 0.7  # steps under FAST x the prediction, twice in a row: the host got faster, start again

    def __init__(self, decay: float = 0.95, prior_slope: float = 0.03, prior_weight: float = 3.0):
        self.decay, self.prior_slope, self.prior_weight = decay, prior_slope, prior_weight
        self.xx = None  # weighted sums of f f^T and f y over the features f = (1, tokens, synchronous)
        self.xy = None
        self._coef = (0.0, 0.0, 0.0)  # A, b, c as last solved
        self._fast = 0  # steps in a row that took under FAST x the prediction

    def _add(self, tokens: float, sync: bool, y: float, w: float) -> None:
        f = (1.0, float(tokens), 1.0 if sync else 0.0)
        for i in range(3):
            self.xy[i] += w * f[i] * y
            for j in range(3):
                self.xx[i][j] += w * f[i] * f[j]

    def observe(self, tokens: int, seconds: float, sync: bool = False) -> None:
        """Add one measured decode step; older ones (and the prior) weigh `decay` times less.

        Args:
            tokens: the tokens the step computed (rows x width).
            seconds: its wall time, drafting excluded.
            sync: a synchronous step (one that drafts, or was planned to): nothing of the host's
                work per step overlaps a step queued behind it, as it does for queued steps.
        """
        # The host got faster (another process let go of the CPU): steps timed while it was busy
        # would hold the fit high for ~100 steps (queued steps of one width cannot move b or c), so
        # two steps in a row well under the prediction start the fit again from this one.
        if self.xx is not None:
            self._fast = self._fast + 1 if seconds < self.FAST * self.predict(tokens, sync) else 0
        if self.xx is None or self._fast >= 2:
            self._fast = 0
            self.xx, self.xy = [[0.0] * 3 for _ in range(3)], [0.0] * 3
            # Prior: b = prior_slope x a one-token step's cost (this step's, by the prior's own slope).
            base = seconds / (1 + self.prior_slope * (tokens - 1))
            self.xx[1][1] += self.prior_weight
            self.xy[1] += self.prior_weight * self.prior_slope * base
        self.xx = [[v * self.decay for v in row] for row in self.xx]
        self.xy = [v * self.decay for v in self.xy]
        self._add(tokens, sync, seconds, 1.0)
        self._coef = self._solve()

    def _solve(self) -> tuple[float, float, float]:
        """(A, b, c) minimising the weighted squared error plus RIDGE * c^2, within LOWER.

        NOTE: a coefficient below its bound is held at the bound and the others solved again (the
        least-squares optimum on that face), not clipped after the solve: clipping A to 0 where the
        unconstrained A came out negative (wide synchronous steps timed on a busy host, width-1
        queued steps fast again) left T(1) at twice the queued steps' measured time, for as long
        as those steps weighed anything.
        """
        held: dict[int, float] = {}
        for _ in range(3):
            coef = self._solve_holding(held)
            if coef is None:
                return self._coef
            below = [i for i in range(3) if i not in held and coef[i] < self.LOWER[i]]
            if not below:
                return coef
            worst = min(below, key=lambda i: coef[i] - self.LOWER[i])
            held[worst] = self.LOWER[worst]
        return tuple(max(v, low) for v, low in zip(coef, self.LOWER))

    def _solve_holding(self, held: dict[int, float]) -> tuple[float, float, float] | None:
        """The normal equations solved with the coefficients in `held` fixed; None if A or c is not
        determined (a b that is not, steps of one size only, is held at 0)."""
        m = [row[:] + [y] for row, y in zip(self.xx, self.xy)]
        m[2][2] += self.RIDGE
        for i, v in held.items():
            m[i] = [float(i == j) for j in range(3)] + [v]
        scale = max(self.xx[0][0], 1e-12)
        for col in range(3):  # Gauss-Jordan with partial pivoting on a 3 x 3 system
            piv = max(range(col, 3), key=lambda r: abs(m[r][col]))
            if abs(m[piv][col]) <= 1e-9 * scale:  # steps of one size only: no slope to see
                if col != 1:
                    return None
                m[1], piv = [0.0, 1.0, 0.0, 0.0], 1  # b = 0, the other rows solved without it
            m[col], m[piv] = m[piv], m[col]
            p = m[col][col]
            m[col] = [v / p for v in m[col]]
            for r in range(3):
                if r != col and m[r][col]:
                    f = m[r][col]
                    m[r] = [a - f * b for a, b in zip(m[r], m[col])]
        return m[0][3], m[1][3], m[2][3]

    @property
    def ready(self) -> bool:
        return self.xx is not None

    def coeffs(self) -> tuple[float, float]:
        """The fit's coefficients (only once `ready`).

        Returns:
            (A, b): fixed cost per queued step and cost per token, in seconds; b >= 0 and A > 0.
        """
        return self._coef[0], self._coef[1]

    def __call__(self, tokens: int) -> float:
        """A queued decode step's time for `tokens` (a synchronous one costs `sync_penalty` more)."""
        a, b, _ = self._coef
        return a + b * tokens

    def predict(self, tokens: int, sync: bool) -> float:
        """A decode step's time for `tokens`, synchronous or queued."""
        return self(tokens) + (self.sync_penalty if sync else 0.0)

    @property
    def sync_penalty(self) -> float:
        """What a synchronous step costs over a queued one of the same size (seconds, >= 0)."""
        return self._coef[2]


def predicted_speedup(cost, round_s: float, rows: int, spec_steps: float, drafted: float, accepted: float,
                      plain_tokens: float, sync_s: float = 0.0) -> float | None:
    """The decode speed-up speculation should give, from what was drafted and the measured costs.

    A verify step of `rows` rows with k drafts each emits 1 + m tokens per row on average (m the
    drafts accepted per step) and takes T(rows x (1 + k)) + c + k x D, against T(rows) for a plain step
    (T: a queued decode step's measured time, `cost(tokens)`; c: what running synchronously adds,
    `sync_s` (StepCost.sync_penalty); D: one draft round, `round_s`). Steps that drafted nothing cost T(rows) each:

        speed-up = T(B) x (plain + S (1 + m)) / (plain x T(B) + S (T(B (1 + k)) + c + k D))

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
    seconds = plain_tokens * t1 + spec_steps * (cost(rows * (1 + k)) + sync_s + k * round_s)
    return t1 * tokens / seconds
