"""Speculative decoding inside continuous batching: choosing k, verifying, accounting.

One step, as the engine runs it with a drafter:

  1. `SpecDecoder.propose(running)`: for every decode row (1 token left), pick how
     many tokens to draft and let the drafter write them into `seq.spec_token_ids`.
  2. The scheduler schedules 1 + k tokens for such a row (vLLM v1: drafts are just
     more tokens to compute); drafts are dropped rather than preempt anyone.
  3. ModelRunner runs ONE forward over every decode row, padded to 1 + max k, and
     hands the logits of the drafted positions to `verify_rows` (exact rejection
     sampling, macinfer.spec_decode.rejection).
  4. `Scheduler.update_from_output` appends the accepted tokens and the target's own
     next token, counts the accepted drafts as computed and frees the blocks that held
     only rejected ones; `SpecDecoder.update_from_output` updates acceptance, costs and
     the request metrics.

Choosing k (adaptive). Decode rows share one forward padded to L = 1 + K, so the
choice is K per step, from the requests' tracked acceptance and measured costs:

    expected tokens of row i   E_i(K) = (1 - a_i^(k_i + 1)) / (1 - a_i),  k_i = min(K, offer_i)
    step time                  T(K)   = A + b * B * (1 + K * (1 - prod_i r_i)) + D * K
    K*                         argmax_K  sum_i E_i(K) / T(K)        (K = 0: no speculation)

a_i is request i's acceptance rate for the kind of draft it would get now (decayed
counts, with the pooled rate for that kind as prior, greedy and sampled requests pooled
apart; a drafter may tell kinds apart, as NgramDrafter does by match length); A + b * tokens
is the measured cost of a decode step (a linear fit over recent decode-only steps, forgetting old ones: StepCost
in macinfer.spec_decode.step_cost), D the measured cost of one draft-model round (0 for n-gram,
and when no row would draft with the model), r_i how often the drafter lately declined a
row of that kind (a feature draft unsure of its first token drafts nothing: the round is
paid, the forward is not widened; the decline counts as a rejection in a_i). offer_i is
what the drafter can propose (an n-gram drafter often has nothing, or a short match).
A request's counts fade fast while it drafts (its latest drafts say most) and slowly while
it does not, so its estimate drifts back to the prior and it probes again now and then. A
step that goes synchronous to draft also pays what queueing it would have hidden
(StepCost.sync_penalty). Where the drafter offers several kinds for a row (a LookupDrafter:
lookup or its model), the row takes the one expected to give the most tokens per second; where
both drafted (a checked copy), the one not used is scored as a one-token draft of its kind.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from macinfer.spec_decode.drafter import Drafter
from macinfer.spec_decode.rejection import greedy_verify, rejection_sample
from macinfer.spec_decode.step_cost import StepCost
from macinfer.core.sequence import Sequence, SequenceStatus


# -- verification (called by ModelRunner.execute_model) ---------------------------------
def verify_rows(group: list[int], rows: list, logits: mx.array) -> list[tuple[int, mx.array]]:
    """Verify every sampling row of one forward.

    Args:
        group: each row's index in the step's scheduled list.
        rows: the ScheduledSequences of the forward.
        logits: (B, L, V) logits of every position of the forward.

    Returns:
        (scheduled index, lazy int32 (k + 2,) [num_accepted, x_0..x_k]) per sampling row;
        a row without drafts gets [0, its next token].
    """
    V = logits.shape[-1]
    argmax = None
    out = []
    for j, r in enumerate(rows):
        if not r.samples:
            continue
        seq, n, k = r.seq, r.num_new_tokens, r.num_spec_tokens
        lg = logits[j, n - 1 - k: n]  # (k + 1, V): the positions that verify d_0..d_{k-1}, then the bonus
        drafts = seq.spec_token_ids[:k]
        if seq.sampler.params.greedy:
            if argmax is None:
                argmax = mx.argmax(logits, axis=-1)  # (B, L)
            res = greedy_verify(argmax[j, n - 1 - k: n], mx.array(drafts, dtype=mx.int32))
        elif k == 0:
            res = mx.concatenate([mx.zeros((1,), mx.int32), seq.sampler(lg).astype(mx.int32)])
        else:
            q = seq.spec_probs
            if q is not None:
                q = q[:k]
                if q.shape[-1] != V:  # a full draft model with more (or fewer) output rows
                    q = q[:, :V] if q.shape[-1] > V else mx.pad(q, [(0, 0), (0, V - q.shape[-1])])
            res = rejection_sample(seq.sampler.probs(lg), mx.array(drafts, dtype=mx.int32), q, seq.sampler.next_key())
        out.append((group[j], res))
    return out


@dataclass
class _Acceptance:
    accepted: float = 0.0  # decayed counts
    tried: float = 0.0


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verify step emits with k drafts, each accepted with probability alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class SpecDecoder:
    """Drafts for the decode rows of each step and learns how many are worth it.

    Args:
        drafter: a Drafter.
        num_speculative_tokens: the most tokens drafted per row per step.
        adaptive: False drafts num_speculative_tokens every step (tests, benchmarks).
    """

    # A request's own acceptance counts: what it drafted lately weighs most (ASK_DECAY per step it
    # was asked to draft), and while it is not asked they fade slowly (IDLE_DECAY per step) back to
    # the prior, so it is asked again now and then. NOTE: its own counts reach 1 / (1 - ASK_DECAY)
    # asks at most, which must outweigh the prior (PRIOR pooled asks): else a text where drafts
    # never pay (words sampled at random) keeps an estimate near the pooled rate, and is asked
    # every step. Nor may the prior be much weaker: at 2 asks, three rejections in a row (a 17%
    # chance at 45% acceptance) put a chat request's estimate below break-even, and it stayed out
    # for ~20 steps while the counts faded. Measured with `auto` on the embedded model, 12 held-out
    # prompts twice, same run: 4 asks against 2 left 17 against 122 and 17 against 55 steps
    # undrafted, and gave 1.267x against 1.239x and 1.256x against 1.246x plain; the never-repeating
    # text 1.00x either way.
    ASK_DECAY = 0.9
    IDLE_DECAY = 0.97
    POOL_DECAY = 0.99  # per step, the drafter's pooled counts (the prior of new requests)
    PRIOR = 4.0  # weight of the pooled rate in a request's estimate
    DECLINE_DECAY = 0.97  # per request asked, the pooled decline counts
    # Queued steps measure A and b of the step cost but never c (StepCost.sync_penalty), so a c
    # fitted on a few slow synchronous steps (a host busy for a moment) would hold drafting off
    # until it faded, ~100 steps. After PROBE_AFTER queued steps, one step is planned as if it were
    # synchronous anyway; if drafting pays then, it drafts, and its measurement refreshes c.
    PROBE_AFTER = 32
    STALE = 0.8  # a synchronous step under STALE x the fit's prediction: probe again at once

    def __init__(self, drafter: Drafter, num_speculative_tokens: int = 12, adaptive: bool = True):
        if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {num_speculative_tokens}")
        self.drafter = drafter
        self.max_k = num_speculative_tokens
        self.adaptive = adaptive
        # Decayed counts per (request, kind of draft), and pooled per (kind, sampled): kinds are the
        # drafter's (`kind(seq)`, e.g. an n-gram match-length bucket), "" if it has none. Sampled
        # and greedy requests pool apart: a draft is accepted less often under sampling (it must
        # match a draw, not the argmax), so each mode's new requests start from their own rate.
        self.acceptance: dict[tuple[str, str], _Acceptance] = {}
        self.pooled: dict[tuple[str, bool], _Acceptance] = {}
        self._kinds: dict[str, str] = {}  # request -> the kind it drafted this step
        self._shadows: dict[str, tuple[str, int]] = {}  # request -> (a kind drafted but not used, its first token)
        self.step_cost = StepCost()
        self._draft_s = 0.0  # time spent drafting in the current step
        self._declined: set[str] = set()  # requests the drafter was asked to draft for and did not
        self.declines: dict[str, _Acceptance] = {}  # per kind: declined (accepted) of asked (tried), decayed
        self.last_k = 0
        # Async scheduling (wants_sync): a plan made with a step in flight is carried out by the
        # next step; plans judged on stale tokens can be wrong (an n-gram match the pending token
        # breaks), so each one that ends in no drafts doubles how many steps go unplanned.
        self._draft_next, self._planned = False, False
        self._plan_backoff, self._plan_penalty = 0, 1
        self._plan_k = 0  # the K the carried-out plan was made for
        self._since_sync = 0  # queued steps since a synchronous one was measured or probed for

    # -- acceptance -------------------------------------------------------------------
    def kind(self, seq: Sequence) -> str:
        fn = getattr(self.drafter, "kind", None)
        return fn(seq) if fn is not None else ""

    def _prior(self, kind: str) -> float:
        fn = getattr(self.drafter, "prior", None)
        return fn(kind) if fn is not None else 0.5

    def _pool(self, kind: str, sampled: bool) -> _Acceptance:
        pool = self.pooled.get((kind, sampled))
        if pool is None:  # starts at the drafter's prior for this kind, worth 4 drafts
            pool = self.pooled[kind, sampled] = _Acceptance(accepted=4.0 * self._prior(kind), tried=4.0)
        return pool

    def alpha(self, request_id: str, kind: str = "", sampled: bool = False) -> float:
        """A request's acceptance rate for drafts of this kind: its own decayed counts, with its mode's
        pooled rate as prior."""
        pool = self._pool(kind, sampled)
        a = self.acceptance.get((request_id, kind), _Acceptance())
        return (a.accepted + self.PRIOR * pool.accepted / max(pool.tried, 1e-9)) / (a.tried + self.PRIOR)

    def _record(self, request_id: str, kind: str, accepted: float, tried: float, own: bool = True,
                sampled: bool = False) -> None:
        if own:
            a = self.acceptance.setdefault((request_id, kind), _Acceptance())
            fade = self.ASK_DECAY / self.IDLE_DECAY  # asked this step: ASK_DECAY in all
            a.accepted = fade * a.accepted + accepted
            a.tried = fade * a.tried + tried
        pool = self._pool(kind, sampled)
        pool.accepted += accepted
        pool.tried += tried

    def decline_rate(self, kind: str = "") -> float:
        """How often the drafter, asked for drafts of this kind, lately drafted nothing (pooled)."""
        d = self.declines.get(kind)
        return d.accepted / d.tried if d is not None and d.tried > 0 else 0.0

    def draft_round_seconds(self) -> float:
        """One draft-model round, as the drafter measured it; 0 for n-gram.

        Until measured, 0: the first drafts measure it. (A pessimistic guess, such as a quarter
        of a step, can keep K at 0 for good when many rows share a step, and then nothing is
        ever measured: a one-layer feature draft at 8 requests never drafted.)
        """
        if not self.drafter.has_model:
            return 0.0
        measured = getattr(self.drafter, "round_s", None)
        return measured if measured is not None else 0.0

    def _uses_model(self, kind: str) -> bool:
        """Whether drafting a row of this kind costs draft-model rounds (lookup's kinds do not)."""
        return self.drafter.has_model and not kind.startswith("ngram:")

    def choose_k(self, alphas: list[float], offers: list[int], rounds: bool = True,
                 declines: list[float] | None = None, sync_now: bool = False) -> int:
        """The K that maximises expected tokens per second this step (see module docstring).

        rounds: False if no row would draft with the model (no draft-round cost).
        declines: each row's chance that the drafter, asked, drafts nothing (a feature draft
            unsure of its first token). Such a row still costs its draft round, and its
            acceptance (alphas) counts the decline as a rejection, but it adds no verify
            position: the forward is only widened if some row drafts.
        sync_now: this step runs synchronously whatever K is (it was planned to draft); else
            K = 0 keeps it queued, and drafting pays the synchronous step's extra cost
            (StepCost.sync_penalty: the host's work no longer overlaps the model's).
        """
        if not self.adaptive:
            return self.max_k
        if not self.step_cost.ready:
            return 0  # measure one plain decode step first
        B = len(alphas)
        declines = declines or [0.0] * B
        best_k, best = 0, 0.0
        for K in range(0, max(offers, default=0) + 1):
            tokens = sum(expected_tokens(a, min(K, o)) for a, o in zip(alphas, offers))
            all_decline = 1.0
            for d, o in zip(declines, offers):
                all_decline *= d if min(K, o) > 0 else 1.0
            width = B * (1 + K * (1.0 - all_decline)) if K else B
            sync = bool(K) or sync_now
            seconds = (self.step_cost.predict(width, sync)
                       + (self.draft_round_seconds() * K if rounds else 0.0))
            if tokens / seconds > best * (1 + 1e-6):
                best_k, best = K, tokens / seconds
        return best_k

    # -- the step ---------------------------------------------------------------------
    def _tick(self, running: list[Sequence]) -> None:
        """Once per step: forget finished requests, decay the acceptance counts."""
        live = {s.request_id for s in running}
        for rid in {r for r, _ in self.acceptance if r not in live}:
            self.remove(rid)
        for a in self.acceptance.values():
            a.accepted *= self.IDLE_DECAY
            a.tried *= self.IDLE_DECAY
        for (kind, _), pool in self.pooled.items():  # drifts back to the prior while unused
            pool.accepted = self.POOL_DECAY * pool.accepted + (1 - self.POOL_DECAY) * self._prior(kind)
            pool.tried = self.POOL_DECAY * pool.tried + (1 - self.POOL_DECAY)

    def plan_k(self, seqs: list[Sequence], pending: bool) -> int:
        """The K the next step would draft for these decode rows, without drafting anything.

        The engine asks before it queues a step asynchronously (which cannot draft: drafts
        need the previous step's token). With a step still in flight (pending), that token
        is unknown, so the drafter's offer is judged on the tokens known so far; any K keeps
        the output exact, so a stale guess only costs speed.
        """
        if not self.adaptive:
            return self.max_k
        return self._choose(seqs, 2 if pending else 1, sync_now=False)[0]

    def _choose(self, seqs: list[Sequence], last: int, sync_now: bool) -> tuple[int, list[int], list[str]]:
        """(K, each row's offer, each row's kind of draft) for these decode rows.

        `last`: tokens each row still produces before a draft could start (its next token, and
        with a step in flight the pending one); a row never drafts past its max_tokens.
        """
        # per_row requests (penalties, logprobs) never draft (macinfer.core.sampling.Sampler), nor
        # structured output (propose).
        caps = [0 if s.sampler.per_row or s.grammar is not None else
                min(self.max_k, s.max_tokens - s.num_output_tokens - last) for s in seqs]
        picks = [self._option(s, c, len(seqs), sync_now) if c > 0 else (self.kind(s), 0) for s, c in zip(seqs, caps)]
        kinds, offers = [k for k, _ in picks], [o for _, o in picks]
        alphas = [self.alpha(s.request_id, kd, not s.sampler.params.greedy) for s, kd in zip(seqs, kinds)]
        declines = [self.decline_rate(kd) for kd in kinds]
        rounds = any(o > 0 and self._uses_model(kd) for o, kd in zip(offers, kinds))
        K = self.choose_k(alphas, offers, rounds, declines, sync_now) if seqs else 0
        return K, offers, kinds

    def _option(self, seq: Sequence, cap: int, rows: int, sync_now: bool) -> tuple[str, int]:
        """The kind of draft this row gets and how many tokens it offers: of the drafter's options
        (`options(seq, k)`: a LookupDrafter offers lookup and its model), the one expected to give
        the most tokens per second for this row; (kind, 0) when none beats not drafting.

        NOTE: a row whose text repeats a little is often better off with the model than with a
        short lookup: judging both by their own measured acceptance keeps lookup's drafts from
        displacing better ones (and a lookup that keeps failing from turning drafting off).
        """
        options = getattr(self.drafter, "options", None)
        if options is None:
            return self.kind(seq), self.drafter.available(seq, cap)
        found = options(seq, cap)
        if len(found) == 1 or not self.adaptive or not self.step_cost.ready:  # nothing to weigh them by
            default = self.kind(seq)
            return next((o for o in found if o[0] == default), found[0])
        base = self.step_cost(rows)
        slope = self.step_cost(rows + 1) - base
        sync = self.step_cost.sync_penalty
        best, pick = 1.0 / (base + (sync if sync_now else 0.0)), (found[0][0], 0)
        for kind, offer in found:
            a, d = self.alpha(seq.request_id, kind, not seq.sampler.params.greedy), self.decline_rate(kind)
            round_s = self.draft_round_seconds() if self._uses_model(kind) else 0.0
            for k in range(1, offer + 1):
                rate = expected_tokens(a, k) / (base + sync + slope * k * (1.0 - d) + round_s * k)
                if rate > best * (1 + 1e-6):
                    best, pick = rate, (kind, offer)
        return pick

    def wants_sync(self, seqs: list[Sequence], pending: bool) -> bool:
        """Whether the next step should be synchronous so that it can draft for these rows.

        The engine asks before it queues a step asynchronously. With a step in flight
        (pending) a yes means: read it back, and draft in the step after.
        """
        if not pending and self._draft_next:
            self._draft_next, self._planned = False, True
            return True
        if self._plan_backoff > 0:
            self._plan_backoff -= 1
            return False
        K = self.plan_k(seqs, pending)
        if not K and self._since_sync >= self.PROBE_AFTER:
            self._since_sync = 0
            K = self._choose(seqs, 2 if pending else 1, sync_now=True)[0]
        if K > 0:
            self._draft_next, self._plan_k = pending, K
            return True
        return False

    def skip_step(self, running: list[Sequence], num_rows: int, seconds: float | None) -> None:
        """A step ran without drafts, queued asynchronously: age the counts as propose would,
        and learn its cost (wall time between two such steps, which is what K = 0 costs)."""
        self._tick(running)
        self.last_k = 0
        self._since_sync += 1
        if seconds:
            self.step_cost.observe(num_rows, seconds)

    def propose(self, running: list[Sequence]) -> None:
        """Draft tokens for the decode rows among running (sets seq.spec_token_ids)."""
        t0 = time.perf_counter()
        self._tick(running)

        decodes = []
        for seq in running:
            seq.spec_token_ids, seq.spec_probs = [], None
            # Structured output is not drafted: its matcher advances on accepted tokens only.
            if seq.status is SequenceStatus.RUNNING and seq.num_uncomputed_tokens == 1 and seq.grammar is None:
                decodes.append(seq)
        K, offers, kinds = self._choose(decodes, 1, sync_now=True)
        if self._planned and not K and self.adaptive:
            # Planned a step ago, and the step is synchronous now whatever we do. Judged again,
            # K is 0 only on a knife edge (a step's cost or the counts' aging moved it) or because
            # the offers are gone (an n-gram match the pending token broke). Keep the plan in the
            # first case: a synchronous step that does not draft is the worst of both.
            K = min(self._plan_k, max(offers, default=0))
        self.last_k = K
        self._draft_next = False  # this step drafts (or not) on the tokens known now
        if self._planned:
            self._planned = False
            if K:
                self._plan_penalty = 1
            else:  # a synchronous step for nothing: plan less often for a while
                self._plan_backoff = self._plan_penalty
                self._plan_penalty = min(2 * self._plan_penalty, 64)
        self._draft_s = 0.0
        self._declined = set()
        if K > 0:
            if getattr(self.drafter, "options", None) is not None:
                self.drafter.propose(decodes, [min(K, o) for o in offers], kinds)
            else:
                self.drafter.propose(decodes, [min(K, o) for o in offers])
            # Asked and came back empty: the drafter chose not to draft (a feature draft unsure
            # of its first token), as opposed to drafts dropped later for room.
            self._declined = {s.request_id for s, o in zip(decodes, offers) if o > 0 and not s.spec_token_ids}
            for s, o, kd in zip(decodes, offers, kinds):
                if o > 0:
                    d = self.declines.setdefault(kd, _Acceptance(0.0, 2.0))  # prior: 0 of 2 declined
                    d.accepted = self.DECLINE_DECAY * d.accepted + (s.request_id in self._declined)
                    d.tried = self.DECLINE_DECAY * d.tried + 1.0
        # What each row drafted with: the drafter may have changed a row's kind (LookupDrafter.propose).
        self._kinds = {s.request_id: kd for s, kd in zip(decodes, kinds)}
        self._shadows = dict(getattr(self.drafter, "shadows", None) or {}) if K > 0 else {}
        self._draft_s = time.perf_counter() - t0

    def update_from_output(self, scheduled: list, sampled: list, step_seconds: float | None) -> None:
        """After the step (its tokens appended by the scheduler): acceptance, metrics, the step's cost.

        Args:
            scheduled: the step's ScheduledSequences.
            sampled: what execute_model returned for each (a list of tokens for rows with drafts).
            step_seconds: the whole step's wall time, drafting included; None: not a measure of the
                step's cost (it traced a compiled forward).
        """
        decode_only, width = True, 1
        for s, toks in zip(scheduled, sampled):
            if s.num_new_tokens - s.num_spec_tokens != 1 or toks is None:
                decode_only = False
            width = max(width, s.num_new_tokens)
            kind = self._kinds.get(s.seq.request_id, "")  # what drafted for it this step
            if s.seq.is_finished:  # its target blocks are free already: free the drafter's too
                self.remove(s.seq.request_id)
            k, sampled_row = s.num_spec_tokens, not s.seq.sampler.params.greedy
            if not k:
                if s.seq.request_id in self._declined and not s.seq.is_finished:
                    # Asked and declined (a feature draft unsure of its first token): the draft
                    # round cost time and bought nothing, like a rejected draft.
                    self._record(s.seq.request_id, kind, 0.0, 1.0, sampled=sampled_row)
                continue
            accepted = len(toks) - 1
            tried = min(accepted + 1, k)  # drafts after the first rejection were never tested
            self._record(s.seq.request_id, kind, accepted, tried, not s.seq.is_finished, sampled_row)
            shadow = self._shadows.get(s.seq.request_id)
            if shadow is not None:  # the other kind's first token, judged by the token the target kept there
                self._record(s.seq.request_id, shadow[0], float(shadow[1] == toks[0]), 1.0, not s.seq.is_finished,
                             sampled_row)
            m = s.seq.metrics
            m.draft_tokens += k
            m.accepted_tokens += accepted
            m.spec_steps += 1
            if kind.startswith("ngram:"):
                m.lookup_draft_tokens += k
                m.lookup_accepted_tokens += accepted
        if decode_only and scheduled and step_seconds is not None:
            self._measured_sync(len(scheduled) * width, max(step_seconds - self._draft_s, 1e-6))

    def _measured_sync(self, tokens: int, seconds: float) -> None:
        """A synchronous decode step's time, for the step cost. One that took well under what the fit
        predicted shows the fit's c (or b) stale: the next queued step may probe again at once,
        as one fresh step does not outweigh several stale ones."""
        stale = self.step_cost.ready and seconds < self.STALE * self.step_cost.predict(tokens, True)
        self.step_cost.observe(tokens, seconds, sync=True)
        self._since_sync = self.PROBE_AFTER if stale else 0

    def remove(self, request_id: str) -> None:
        for key in [key for key in self.acceptance if key[0] == request_id]:
            del self.acceptance[key]
        self._kinds.pop(request_id, None)
        self.drafter.remove(request_id)
