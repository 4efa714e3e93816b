"""Drafters: cheap guesses of a sequence's next tokens, for the target to verify.

One small interface (`Drafter`), and these kinds:

- `NgramDrafter` (prompt lookup): find the latest earlier occurrence of the
  sequence's last n tokens (n = 4 down to 2) and propose what followed it, as
  many tokens as the match is long. No model; deterministic, so its draft
  distribution q is one-hot.
- `DraftModelDrafter`: a small model sharing the target's tokenizer, run k
  times per step over its own paged KV cache (its own BlockPool and
  ModelRunner, the same machinery as the target's). It samples each draft
  from its own distribution q with the request's sampling parameters and key,
  and hands q to the verifier (macinfer.spec_decode.rejection).
- `FeatureDrafter` (macinfer.spec_decode.feature_draft): a one-layer draft fed the
  target's own hidden states (EAGLE-style).
- `LookupDrafter`: n-gram lookup for rows whose text repeats itself, a model
  drafter for the others ("<model>+ngram", and "auto").

A drafter may also say what kind of draft a row would get (`kind(seq)`, with a
`prior(kind)` acceptance): the speculative decoder tracks acceptance per kind.

A drafter writes its proposal into `seq.spec_token_ids` (and `seq.spec_probs`,
the (k, V) q rows, or None for a deterministic drafter); the scheduler then
treats those tokens as more tokens to compute (vLLM v1's scheme).

The draft model's view of a request is a `_DraftSeq`: the tokens fed to the
draft so far and how many of them have K/V in the draft's pool. After the target
verified, the draft's tokens past the common prefix with the target's are
stale; `_sync` cuts them off (rollback) and frees the draft blocks past that point:

    target tokens   [ ... t  d0  d1  x ]        d0, d1 accepted, x emitted by the target
    draft fed       [ ... t  d0  d1  d2 ]       d2 drafted (and fed), then rejected
    common prefix   [ ... t  d0  d1 ]           -> draft num_computed_tokens cut to here
"""

from __future__ import annotations

import time
from typing import Protocol

import mlx.core as mx
from mlx.utils import tree_flatten

from macinfer.core.block_pool import BlockPool
from macinfer.core.model_runner import ModelRunner
from macinfer.core.scheduler import ScheduledSequence
from macinfer.core.sequence import Sequence
from macinfer.kv.model_probe import inspect_model, supports_batched_offsets
from macinfer.spec_decode.ngram_index import NgramIndex


class Drafter(Protocol):
    """What the speculative decoder needs from a drafter."""

    name: str
    has_model: bool  # True: each drafted token costs a draft forward (a round)
    # Fed the target's final hidden states of every forward (a feature draft), or None:
    # hidden_sink(seqs, starts, counts, hidden (B, L, D)), the target runner's `hidden_sink`.
    hidden_sink: object

    def available(self, seq: Sequence, k: int) -> int:
        """How many tokens (<= k) the drafter can propose for seq right now."""

    def propose(self, seqs: list[Sequence], num_draft: list[int]) -> None:
        """Set seq.spec_token_ids (at most num_draft[i] tokens) and seq.spec_probs for each seq."""

    def remove(self, request_id: str) -> None:
        """Forget a request (finished or preempted): free whatever it holds."""


# A draft round feeding at most this many tokens per row is a decode round (last step's verified
# tokens) and is timed for `round_s`, the cost adaptive k charges per drafted token. A new prompt's
# catch-up is not that cost, nor a catch-up after lookup drafted for a while (LookupDrafter: the
# model is then fed every token accepted meanwhile, up to 13 rows in one round): counted, those
# made `round_s` 4.1-5.8 ms where a round of one or two rows costs 2.0-2.3 ms (SmolLM2's feature
# draft on the dev CPU), and kept drafting off where it paid.
STEADY_TOKENS = 2


def draft_pick(seq: Sequence, logits: mx.array):
    """(drafted token, q) for one row, both lazy: greedy takes the argmax (q None); a sampled
    draft draws from q, the distribution the verifier's rejection sampling must be given."""
    if seq.sampler.params.greedy:
        return mx.argmax(logits, axis=-1), None
    scaled = seq.sampler.scaled(logits)  # q = softmax(scaled): drawn from without taking log(q)
    return mx.random.categorical(scaled, key=seq.sampler.next_key()), mx.softmax(scaled, axis=-1)


def pick_kept(seq: Sequence, sub: mx.array, head):
    """draft_pick for a draft whose head keeps a subset of the vocabulary (a SubsetHead):
    `sub` holds one row's logits over the kept columns only (head None: over the whole vocabulary).

    A greedy row picks among those columns: building the full-vocabulary logits (-inf
    elsewhere) and taking their argmax cost 24 ms for 8 rows of SmolLM2's vocabulary here,
    and gives the same token (the kept ids are sorted, so the first maximum is the same).
    A sampled row needs the full q for the verifier: draft_pick on the expanded row.
    """
    if head is None:
        return draft_pick(seq, sub)
    if seq.sampler.params.greedy:
        return head.ids[mx.argmax(sub, axis=-1)], None
    return draft_pick(seq, head.expand(sub))


def copy_probs(q0: mx.array, copy: list[int]) -> mx.array:
    """q for a copy whose first token a sampled model draft drew (LookupDrafter.propose): (len(copy), V).

    The copy is kept only where the model's own draw d_0 equals its first token, and the model's drafts
    are kept otherwise, so d_0 is distributed as the model's row q0 either way; given d_0 the later copy
    tokens are fixed (one-hot rows). Rejection sampling with this q stays exact.
    """
    width = max(q0.shape[-1], max(copy) + 1)
    if width > q0.shape[-1]:  # a draft head narrower than a copied token id: zero mass there
        q0 = mx.pad(q0, [(0, width - q0.shape[-1])])
    rest = (mx.arange(width)[None] == mx.array(copy[1:], dtype=mx.int32)[:, None]).astype(q0.dtype)
    return mx.concatenate([q0[None], rest])


def module_bytes(module, shared: set[int]) -> int:
    """Bytes of a module's arrays, leaving out those in `shared` (ids of the target's own arrays:
    a draft that reads the target's embedding holds no copy of it)."""
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()) if id(v) not in shared)


def drafter_bytes(drafter, target_model) -> int:
    """What a drafter holds beyond the target: its own weights and its KV pool (0 for lookup).

    A drafter reports it by `nbytes(shared)`; one without that method (a test's scripted one) holds nothing."""
    nbytes = getattr(drafter, "nbytes", None)
    if nbytes is None:
        return 0
    return nbytes({id(v) for _, v in tree_flatten(target_model.parameters())})


class NgramDrafter:
    """Prompt-lookup drafting from the sequence's own tokens.

    The offer is trusted as far as the copy has held: the latest earlier occurrence of
    the last n tokens (n = 4 down to 2) is extended backwards to the match length m (how
    many tokens before the end agree with the tokens before that occurrence), and at most
    m tokens are offered. On the held-out chat continuations of scripts/train/train_draft.py,
    SmolLM2-135M's first drafted token was right 42% of the time at m = 2, 58-61% at m = 3-5
    and 88-100% from m = 8 (a repeated list, a quoted block): so the acceptance is tracked
    per match-length bucket (`kind`), with those rates as priors.

    Args:
        max_n, min_n: n-gram sizes tried, longest first.
        max_match: how far back the match length is measured.

    Example:
        >>> NgramDrafter().lookup([1, 2, 3, 4, 9, 1, 2, 3], 3)
        [4, 9, 1]
        >>> NgramDrafter().match([7, 1, 2, 3, 4, 9, 7, 1, 2, 3], 8)  # "7 1 2 3" matched: m = 4
        ([4, 9, 7, 1, 2, 3], 4)
    """

    name = "ngram"
    has_model = False
    hidden_sink = None
    BUCKETS = ((2, 0.40), (4, 0.55), (7, 0.70), (10**9, 0.90))  # (largest m, prior acceptance)

    def __init__(self, max_n: int = 4, min_n: int = 2, max_match: int = 32):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n, self.max_match = max_n, min_n, max_match
        # request_id -> (its tokens' n-grams, the lookup and m when index.size tokens were indexed)
        self._cache: dict[str, tuple[NgramIndex, list[int], int]] = {}

    def match(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """(up to k tokens that followed the latest earlier match of the last n tokens, the match length m)."""
        return NgramIndex(self.min_n, self.max_n, self.max_match).match(tokens, k)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The k tokens (or fewer) that followed the latest earlier match of the last n tokens."""
        return self.match(tokens, k)[0]

    def _lookup(self, seq: Sequence, k: int) -> tuple[list[int], int]:
        cached = self._cache.get(seq.request_id)
        if cached is None or cached[0].size != seq.num_tokens:  # max_match tokens: no offer is longer than m
            index = NgramIndex(self.min_n, self.max_n, self.max_match) if cached is None else cached[0]
            cached = self._cache[seq.request_id] = (index, *index.match(seq.token_ids, self.max_match))
        _, drafts, m = cached
        return drafts[: min(k, m)], m

    def match_length(self, seq: Sequence) -> int:
        """How long the sequence's current copy has held (0: no earlier occurrence)."""
        return self._lookup(seq, 1)[1]

    def available(self, seq: Sequence, k: int) -> int:
        return len(self._lookup(seq, k)[0])

    def kind(self, seq: Sequence) -> str:
        """The acceptance bucket of seq's current match (SpecDecoder tracks acceptance per kind)."""
        m = self.match_length(seq)
        return "ngram:" + str(next(i for i, (top, _) in enumerate(self.BUCKETS) if m <= top))

    def prior(self, kind: str) -> float:
        return self.BUCKETS[int(kind.split(":")[1])][1]

    def propose(self, seqs: list[Sequence], num_draft: list[int]) -> None:
        for seq, k in zip(seqs, num_draft):
            seq.spec_token_ids = self._lookup(seq, k)[0] if k > 0 else []  # at most m tokens
            seq.spec_probs = None  # deterministic: q is one-hot

    def remove(self, request_id: str) -> None:
        self._cache.pop(request_id, None)


class LookupDrafter:
    """n-gram lookup where that pays, a model draft everywhere else.

    A small model's drafts are right ~35-45% of the time on chat (scripts/train/train_eagle.py);
    a copy that has held for a few tokens is right far more often (NgramDrafter) and costs no
    draft round, but a short match in free text is right less often than the model. So each
    step, a row whose text matches an earlier stretch offers both (`options`), and the
    speculative decoder picks by each one's measured acceptance for this request and its cost
    (SpecDecoder._option); a row without a match drafts with the model. `draft="<model>+ngram"`,
    and what `auto` gives a model it found a draft for.

    Args:
        model: a DraftModelDrafter or FeatureDrafter.
        ngram: the NgramDrafter (default: a new one).
        min_match: the match length from which a row drafts by lookup when nobody weighs the two
            (`kind`; fixed k, or nothing measured yet): 3, 56% first-token acceptance, above the
            shipped feature draft's 44%. Any match is offered as an option.
    """

    has_model = True
    # A row whose match is shorter than this drafts with the model too, and keeps the copy
    # only where the two begin alike (`propose`); from here on (NgramDrafter.BUCKETS' last) the
    # copy is trusted alone. Measured with the shipped feature draft over 40 training prompts: a
    # copy of 2-7 tokens began right 87% of the time where the model's first draft agreed (221
    # steps), and 24% where it did not, the model 45% there (253 steps); a copy of 8+ tokens was
    # right 65% of the time where they disagreed, the model 19%.
    TRUST_MATCH = 8
    DISPUTE_DECAY = 0.9

    def __init__(self, model, ngram: NgramDrafter | None = None, min_match: int = 3):
        self.model, self.ngram, self.min_match = model, ngram or NgramDrafter(), min_match
        self.name = f"{model.name}+ngram"
        self.hidden_sink = model.hidden_sink
        # Where the copy and the model began differently: who turned out right (decayed counts, the
        # prior as measured above). While the copy wins, short copies are no longer checked.
        self.wins = {"model": 2.0, "lookup": 1.0}
        self._disputes: dict[str, tuple[int, int, int]] = {}  # request -> (position, copy's token, model's)
        # This step's checked rows: request -> (the kind that was not used, its first token). The
        # speculative decoder scores these as one-token drafts of that kind, so the model's estimate
        # learns from steps that a copy drafted (and the copy's from the model's).
        self.shadows: dict[str, tuple[str, int]] = {}

    def _lookup(self, seq: Sequence) -> bool:
        return self.ngram.match_length(seq) >= self.min_match

    @property
    def round_s(self) -> float | None:
        return getattr(self.model, "round_s", None)

    def options(self, seq: Sequence, k: int) -> list[tuple[str, int]]:
        """(kind, tokens offered) of each way this row could draft now, the model's first."""
        found = [("model", self.model.available(seq, k))]
        if self.ngram.match_length(seq):
            found.append((self.ngram.kind(seq), self.ngram.available(seq, k)))
        return found

    def available(self, seq: Sequence, k: int) -> int:
        return max(o for _, o in self.options(seq, k))

    def kind(self, seq: Sequence) -> str:
        """The row's kind of draft when nobody weighs the options: lookup from min_match on."""
        return self.ngram.kind(seq) if self._lookup(seq) else "model"

    def prior(self, kind: str) -> float:
        return self.ngram.prior(kind) if kind.startswith("ngram:") else 0.5

    def propose(self, seqs: list[Sequence], num_draft: list[int], kinds: list[str] | None = None) -> None:
        """kinds: each row's kind of draft (from `options`); default: lookup wherever there is a match.

        A row drafting a short copy (TRUST_MATCH) is drafted by the model too: where the model's first
        token differs from the copy's, the row keeps the model's drafts and its entry in `kinds` becomes
        "model" (what it drafted with, for the acceptance counts). On a sampled row the model's first
        token is its own draw, so a kept copy is verified against the model's q at its first position
        (`copy_probs`).
        """
        lookup = ([k.startswith("ngram:") for k in kinds] if kinds is not None else [self._lookup(s) for s in seqs])
        for seq in seqs:
            self._settle(seq)
        self.shadows = {}
        check = self.wins["model"] >= self.wins["lookup"]
        checked = [i for i, (s, lk) in enumerate(zip(seqs, lookup))
                   if check and lk and self.ngram.match_length(s) < self.TRUST_MATCH]
        rows = [i for i, lk in enumerate(lookup) if lk]
        if rows:
            self.ngram.propose([seqs[i] for i in rows], [num_draft[i] for i in rows])
        copies = {i: seqs[i].spec_token_ids for i in checked}
        rows = [i for i, lk in enumerate(lookup) if not lk or i in copies]
        if rows:
            self.model.propose([seqs[i] for i in rows], [num_draft[i] for i in rows])
        for i, copy in copies.items():
            seq, own = seqs[i], seqs[i].spec_token_ids
            if own and copy and own[0] != copy[0]:
                self._disputes[seq.request_id] = (seq.num_tokens, copy[0], own[0])
                self.shadows[seq.request_id] = (kinds[i] if kinds is not None else self.ngram.kind(seq), copy[0])
                if kinds is not None:
                    kinds[i] = "model"
            else:
                if own:
                    self.shadows[seq.request_id] = ("model", own[0])
                q = seq.spec_probs  # a sampled row whose model drew the copy's first token: see copy_probs
                seq.spec_token_ids, seq.spec_probs = copy, None if q is None or not copy else copy_probs(q[0], copy)

    def _settle(self, seq: Sequence) -> None:
        """Count who was right at the row's last dispute, once the target has decided that token."""
        d = self._disputes.get(seq.request_id)
        if d is None or seq.num_tokens <= d[0]:
            return
        del self._disputes[seq.request_id]
        actual = seq.token_ids[d[0]]
        for who, token in (("lookup", d[1]), ("model", d[2])):
            self.wins[who] = self.DISPUTE_DECAY * self.wins[who] + (token == actual)

    def remove(self, request_id: str) -> None:
        self.ngram.remove(request_id)
        self.model.remove(request_id)
        self._disputes.pop(request_id, None)

    def nbytes(self, shared: set[int]) -> int:
        nbytes = getattr(self.model, "nbytes", None)
        return nbytes(shared) if nbytes is not None else 0


class _DraftSeq:
    """The draft model's view of one request (duck-types Sequence for BlockPool and ModelRunner)."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.token_ids: list[int] = []  # tokens fed (or to feed) to the draft
        self.num_computed_tokens = 0  # of those, how many have K/V in the draft pool
        self.num_valid = 0  # leading token_ids known to equal the target's
        self.num_prompt_tokens = 0  # the target's (ModelRunner.set_context reads it: prompt windows)
        self.block_table: list[int] = []


class DraftModelDrafter:
    """Draft tokens with a small model over its own paged KV cache.

    Args:
        model: the draft, an mlx-lm model sharing the target's tokenizer
            (macinfer.spec_decode.draft_model.load_draft checks that).
        num_blocks, block_size: the draft's own block pool.
        name: for messages and stats.
    """

    has_model = True
    hidden_sink = None

    def __init__(self, model, num_blocks: int, block_size: int, name: str = "draft"):
        self.name = name
        self.model = model
        self.pool = BlockPool(num_blocks, block_size)
        self.runner = ModelRunner(model, inspect_model(model, name), num_blocks, block_size,
                                  batch_decode=supports_batched_offsets(model))
        # A head over a subset of the vocabulary (macinfer.core.lm_head.SubsetHead): rounds take
        # the logits of its kept columns only, and pick_kept widens them where q is needed.
        head = getattr(model, "lm_head", None)
        self.head = head if hasattr(head, "expand") and hasattr(head, "ids") else None
        self.states: dict[str, _DraftSeq] = {}
        # Seconds per draft round of decode rows (EMA; None until measured; see STEADY_TOKENS).
        self.round_s: float | None = None

    def available(self, seq: Sequence, k: int) -> int:
        return k

    def nbytes(self, shared: set[int]) -> int:
        """The draft's weights (not the target's, where it shares them) and its KV pool."""
        return module_bytes(self.model, shared) + self.runner.kv_bytes

    def _sync(self, seq: Sequence) -> _DraftSeq:
        """Bring the draft's tokens in line with the target's; roll back what diverged."""
        st = self.states.get(seq.request_id)
        if st is None:
            st = self.states[seq.request_id] = _DraftSeq(seq.request_id)
            st.num_prompt_tokens = seq.num_prompt_tokens
        # The target only ever appends, so the first num_valid tokens still agree.
        v, end = st.num_valid, min(len(st.token_ids), seq.num_tokens)
        while v < end and st.token_ids[v] == seq.token_ids[v]:
            v += 1
        del st.token_ids[v:]
        st.token_ids.extend(seq.token_ids[v:])
        st.num_valid = len(st.token_ids)
        # At least the last token is fed again: its logits give the first draft.
        st.num_computed_tokens = min(st.num_computed_tokens, v, len(st.token_ids) - 1)
        self.pool.trim(st, st.num_computed_tokens)
        return st

    def propose(self, seqs: list[Sequence], num_draft: list[int]) -> None:
        rows = []  # (seq, draft view, k)
        for seq, k in zip(seqs, num_draft):
            seq.spec_token_ids, seq.spec_probs = [], None
            if k <= 0:
                continue
            st = self._sync(seq)
            # k rounds: the first feeds everything not yet computed, each later one the
            # previous draft; the last draft is never fed (it may be rejected).
            if not self.pool.allocate_slots(st, st.num_valid - st.num_computed_tokens + k - 1):
                continue  # the draft pool is full: no drafts for this one this step
            rows.append((seq, st, k))
        probs: dict[str, list[mx.array]] = {}
        for r in range(max((k for _, _, k in rows), default=0)):
            active = [(seq, st) for seq, st, k in rows if k > r]
            groups = [active] if self.runner.batch_decode else [[a] for a in active]
            t0 = time.perf_counter()
            steady = all(len(st.token_ids) - st.num_computed_tokens <= STEADY_TOKENS for _, st in active)
            for group in groups:
                sched = [ScheduledSequence(st, len(st.token_ids) - st.num_computed_tokens) for _, st in group]
                logits = self._forward(sched)  # (B, V), or (B, N) over a SubsetHead's kept columns
                picks = []
                for j, (seq, _) in enumerate(group):
                    tok, q = draft_pick(seq, logits[j]) if self.head is None else pick_kept(seq, logits[j], self.head)
                    if q is not None:
                        probs.setdefault(seq.request_id, []).append(q)
                    picks.append(tok)
                picks = mx.stack(picks)
                mx.eval(picks, [c.state for c in self.runner.caches])  # see ModelRunner.execute_model
                for s, (seq, st), tok in zip(sched, group, picks.tolist()):
                    st.num_computed_tokens += s.num_new_tokens
                    st.token_ids.append(tok)
                    seq.spec_token_ids.append(tok)
            if steady:
                dt = time.perf_counter() - t0
                self.round_s = dt if self.round_s is None else 0.7 * self.round_s + 0.3 * dt
        for seq, _, _ in rows:
            if seq.request_id in probs:
                seq.spec_probs = mx.stack(probs[seq.request_id])  # (k, V)

    def _forward(self, sched: list) -> mx.array:
        """Each row's next-token logits: (B, V), or (B, N) over the kept columns of a SubsetHead."""
        if self.head is None:
            return self.runner.forward(sched)
        return self.runner.forward(sched, head=lambda h: h @ self.head.weight.T)

    def remove(self, request_id: str) -> None:
        st = self.states.pop(request_id, None)
        if st is not None:
            self.pool.free(st)
