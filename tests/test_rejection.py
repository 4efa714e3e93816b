"""Rejection sampling keeps the target's distribution: chi-square over a tiny vocabulary.

The target and the draft are Markov chains over V tokens (next-token tables P and
Q), so the target's distribution at each drafted position depends on the drafts
before it, as with a real model. Many independent generations of three tokens
run at once; the joint (x0, x1, x2) must follow P. A deliberately wrong rule
(on rejection, resample from p instead of the residual) must fail the same test.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from macinfer.core.sampling import SamplingParams
from macinfer.core.sequence import Sequence, SequenceStatus
from macinfer.spec_decode.drafter import NgramDrafter, copy_probs
from macinfer.spec_decode.rejection import greedy_verify, rejection_sample

V, K, N, START = 4, 3, 60_000, 0


def chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson chi-square p-value (Wilson-Hilferty approximation of the chi-square tail)."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = observed.size - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def tables(seed=0):
    rng = np.random.default_rng(seed)
    P = rng.dirichlet(np.full(V, 2.0), size=V) * 0.8 + 0.05  # every cell >= 0.05
    Q = rng.dirichlet(np.full(V, 1.0), size=V)  # a different, peakier chain
    return P / P.sum(1, keepdims=True), Q


def wrong_resample_from_p(p, drafts, q, key):
    """The classic bug: accept with min(1, p/q) but on rejection draw from p, not norm(max(0, p - q))."""
    k = drafts.shape[-1]
    if q is None:
        q = (mx.arange(p.shape[-1]) == drafts[..., None]).astype(p.dtype)
    key_u, key_x = mx.random.split(key)
    p_d = mx.take_along_axis(p[..., :k, :], drafts[..., None], axis=-1)[..., 0]
    q_d = mx.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    accept = (mx.random.uniform(shape=p_d.shape, key=key_u) * q_d < p_d).astype(mx.int32)
    a = mx.cumprod(accept, axis=-1).sum(axis=-1, keepdims=True)
    x = mx.random.categorical(mx.log(p), key=key_x)
    padded = mx.concatenate([drafts, mx.zeros_like(drafts[..., :1])], axis=-1)
    tokens = mx.where(mx.arange(k + 1) < a, padded, x)
    return mx.concatenate([a, tokens], axis=-1).astype(mx.int32)


def mlx_lm_rule(p, drafts, q, key):
    """mlx-lm's speculative_generate_step: sample t_i ~ p_i at every position, accept while t_i == d_i."""
    k = drafts.shape[-1]
    t = mx.random.categorical(mx.log(p), key=key).astype(mx.int32)  # (..., k + 1)
    match = (t[..., :k] == drafts).astype(mx.int32)
    a = mx.cumprod(match, axis=-1).sum(axis=-1, keepdims=True)
    return mx.concatenate([a, t], axis=-1).astype(mx.int32)


def generate(rule, P, Q, one_hot_draft: bool, n_tokens=3, seed=0):
    """N independent speculative generations of n_tokens from START; returns (tokens (N, n), acceptance)."""
    rng = np.random.default_rng(seed)
    Pm, Qm = mx.array(P, dtype=mx.float32), mx.array(Q, dtype=mx.float32)
    out = np.zeros((N, n_tokens + K + 1), dtype=np.int64)
    count = np.zeros(N, dtype=np.int64)
    ctx = np.full(N, START)
    key = mx.random.key(seed)
    drafted = accepted = 0
    while (count < n_tokens).any():
        # Draft K tokens per row from Q (sampled, or Q's argmax when one-hot).
        drafts = np.zeros((N, K), dtype=np.int64)
        prev = ctx.copy()
        for i in range(K):
            if one_hot_draft:
                drafts[:, i] = Q[prev].argmax(1)
            else:
                u = rng.random(N)[:, None]
                drafts[:, i] = (np.cumsum(Q[prev], 1) < u).sum(1).clip(max=V - 1)
            prev = drafts[:, i]
        prevs = np.concatenate([ctx[:, None], drafts], axis=1)  # (N, K + 1) context of each position
        p = Pm[mx.array(prevs)]  # (N, K + 1, V)
        q = None if one_hot_draft else Qm[mx.array(prevs[:, :K])]
        key, sub = mx.random.split(key)
        res = np.array(rule(p, mx.array(drafts, dtype=mx.int32), q, sub))
        active = count < n_tokens
        a = res[:, 0]
        for j in range(K + 1):  # emitted tokens are res[:, 1 : 2 + a]
            rows = np.flatnonzero(active & (j <= a))
            out[rows, count[rows] + j] = res[rows, 1 + j]
        drafted += K * int(active.sum())
        accepted += int(a[active].sum())
        count = np.where(active, count + a + 1, count)
        ctx = out[np.arange(N), count - 1]
    return out[:, :n_tokens], accepted / drafted


def joint_pvalue(tokens, P):
    idx = tokens[:, 0] * V * V + tokens[:, 1] * V + tokens[:, 2]
    observed = np.bincount(idx, minlength=V ** 3).astype(float)
    expected = np.einsum("a,ab,bc->abc", P[START], P, P).reshape(-1) * len(tokens)
    return chi2_pvalue(observed, expected)


@pytest.mark.parametrize("one_hot_draft", [False, True], ids=["sampled-draft", "deterministic-draft"])
def test_rejection_sampling_matches_target(one_hot_draft):
    P, Q = tables()
    tokens, acc = generate(rejection_sample, P, Q, one_hot_draft)
    assert joint_pvalue(tokens, P) > 1e-3
    assert 0.03 < acc < 0.95  # both the accept and the residual paths were exercised


@pytest.mark.parametrize("one_hot_draft", [False, True], ids=["sampled-draft", "deterministic-draft"])
def test_wrong_rule_fails_the_same_test(one_hot_draft):
    P, Q = tables()
    tokens, _ = generate(wrong_resample_from_p, P, Q, one_hot_draft)
    assert joint_pvalue(tokens, P) < 1e-6


def test_mlx_lm_equality_rule_is_exact_but_accepts_less():
    """mlx-lm's rule emits the target's own samples, so it is exact too; it just accepts less
    (P(accept) = sum p*q instead of sum min(p, q))."""
    P, Q = tables()
    tokens, acc_mlx = generate(mlx_lm_rule, P, Q, one_hot_draft=False)
    assert joint_pvalue(tokens, P) > 1e-3
    _, acc = generate(rejection_sample, P, Q, one_hot_draft=False)
    assert acc_mlx < acc - 0.05


def test_greedy_verify_accepts_leading_matches():
    target = mx.array([[5, 6, 7, 8], [5, 9, 7, 8], [1, 6, 7, 8]])
    drafts = mx.array([[5, 6, 7], [5, 6, 7], [5, 6, 7]])
    assert greedy_verify(target, drafts).tolist() == [[3, 5, 6, 7, 8], [1, 5, 9, 7, 8], [0, 1, 6, 7, 8]]


def test_greedy_is_rejection_sampling_with_one_hot_p():
    """With one-hot p (greedy), the general rule gives exactly greedy_verify, for any q."""
    p = mx.eye(6)[mx.array([2, 3, 4, 5])][None]  # argmax 2, 3, 4, 5
    for drafts in ([2, 3, 4], [2, 3, 0], [1, 3, 4]):
        d = mx.array([drafts])
        q = mx.softmax(mx.random.normal((1, 3, 6), key=mx.random.key(1)), axis=-1)
        want = greedy_verify(mx.array([[2, 3, 4, 5]]), d).tolist()[0]
        emitted = want[: 2 + want[0]]  # num_accepted, x_0..x_num_accepted (the slots after are junk)
        for got in (rejection_sample(p, d, q, mx.random.key(0)), rejection_sample(p, d, None, mx.random.key(0))):
            assert got.tolist()[0][: 2 + want[0]] == emitted


def test_ngram_lookup():
    nd = NgramDrafter()
    assert nd.lookup([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    assert nd.lookup([1, 2, 3, 4, 5], 3) == []  # no earlier occurrence
    # The longest n-gram wins, then the latest occurrence.
    assert nd.lookup([7, 2, 3, 8, 1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]
    assert nd.lookup([5, 5, 5, 5], 4) == [5]  # a match right before the end offers what is left


def test_ngram_offers_as_far_as_the_copy_has_held():
    """The match is extended backwards to its length m; at most m tokens are offered."""
    from types import SimpleNamespace

    nd = NgramDrafter()
    assert nd.match([7, 1, 2, 3, 4, 9, 7, 1, 2, 3], 8) == ([4, 9, 7, 1, 2, 3], 4)
    # 4-gram "1 2 3 4" also preceded by "5 6" both times: m = 6 (capped by what exists before the hit).
    toks = [5, 6, 1, 2, 3, 4, 10, 11, 12, 13, 14, 15, 16, 17, 5, 6, 1, 2, 3, 4]
    assert nd.match(toks, 3) == ([10, 11, 12], 6)
    assert NgramDrafter(max_match=5).match(toks, 3)[1] == 5

    def seq(tokens, rid="r"):
        return SimpleNamespace(request_id=rid, token_ids=tokens, num_tokens=len(tokens))

    short = seq([8, 1, 2, 40, 41, 42, 43, 44, 45, 9, 1, 2])  # "1 2" again after 9 vs 8: m = 2
    assert nd.match_length(short) == 2 and nd.available(short, 8) == 2
    nd.propose([short], [8])
    assert short.spec_token_ids == [40, 41] and short.spec_probs is None
    long = seq(toks, "long")
    assert nd.available(long, 8) == 6 and nd.available(long, 4) == 4
    assert [nd.kind(s) for s in (short, long, seq([1, 2, 3], "none"))] == ["ngram:0", "ngram:2", "ngram:0"]
    assert nd.prior("ngram:3") > nd.prior("ngram:0")


def _scan_match(tokens, k, min_n=2, max_n=4, max_match=32):
    """Prompt lookup by scanning the whole list: what the index must find."""
    L = len(tokens)
    if k <= 0 or L <= min_n:
        return [], 0
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        hits = [s for s in range(L - n) if tokens[s: s + n] == tokens[L - n:]]
        if hits:
            hit, m = hits[-1], n
            while m < max_match and hit - (m - n) > 0 and tokens[hit - (m - n) - 1] == tokens[L - m - 1]:
                m += 1
            return tokens[hit + n: hit + n + k], m
    return [], 0


def test_ngram_index_finds_what_a_scan_finds_as_the_tokens_grow():
    """One index per request, fed each step's new tokens (1-4 at a time, as accepted drafts come),
    gives the scan's answer at every length; a list that shrank or changed is indexed anew."""
    import random

    from macinfer.spec_decode.ngram_index import NgramIndex

    rng = random.Random(0)
    for trial in range(30):
        vocab = rng.choice([3, 6, 20])  # small vocabularies repeat: matches of every length
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        index = NgramIndex(2, 4, max_match=rng.choice([5, 32]))
        while len(tokens) < 120:
            k = rng.randrange(0, 9)
            assert index.match(tokens, k) == _scan_match(tokens, k, max_match=index.max_match), (trial, len(tokens))
            tokens = tokens + [rng.randrange(vocab) for _ in range(rng.randrange(1, 5))]
        cut = tokens[:50]  # shorter: reindexed
        assert index.match(cut, 8) == _scan_match(cut, 8, max_match=index.max_match)
        changed = cut[:-1] + [vocab]  # same length, last token new to the list
        assert index.match(changed, 8) == _scan_match(changed, 8, max_match=index.max_match)


def test_ngram_lookup_indexes_only_the_new_tokens_each_step():
    """The drafter keeps each request's index: a step that appends one token adds one window per n,
    however long the sequence (the scan it replaces read all of them every step)."""
    from types import SimpleNamespace

    nd = NgramDrafter()
    tokens = [i % 50 for i in range(2000)]
    seq = SimpleNamespace(request_id="r", token_ids=tokens, num_tokens=len(tokens))
    assert nd.available(seq, 4) == 4
    index = nd._cache["r"][0]
    stored = sum(len(t) for t in index.latest)
    writes = []

    class Counting(dict):
        def __setitem__(self, key, value):
            writes.append(key)
            super().__setitem__(key, value)

    index.latest = [Counting(t) for t in index.latest]
    seq.token_ids = tokens + [0]  # the pattern goes on
    seq.num_tokens = len(seq.token_ids)
    assert nd.available(seq, 4) == 4 and nd._cache["r"][0] is index
    assert len(writes) == 3 and sum(len(t) for t in index.latest) == stored  # the 2-, 3- and 4-gram before it: seen before
    nd.remove("r")
    assert "r" not in nd._cache


def test_acceptance_is_tracked_per_kind_of_draft():
    """A request's long n-gram matches keep their high rate while its short ones fail."""
    from macinfer.spec_decode.decoder import SpecDecoder

    spec = SpecDecoder(NgramDrafter())
    assert spec.alpha("r", "ngram:3") == NgramDrafter.BUCKETS[3][1]  # the prior before anything is seen
    for _ in range(5):
        spec._record("r", "ngram:3", accepted=5, tried=5)
        spec._record("r", "ngram:0", accepted=0, tried=1)
    assert spec.alpha("r", "ngram:3") > 0.95 and spec.alpha("r", "ngram:0") < 0.2
    assert spec.alpha("other", "ngram:0") < NgramDrafter.BUCKETS[0][1]  # the pool learned too
    spec.remove("r")
    assert spec.acceptance == {}


def test_a_short_streak_of_rejections_does_not_outweigh_the_pool():
    """Three rejections in a row happen often (17% of the time at 45% acceptance): they must not put a
    request whose drafts the pool says pay below break-even (~0.15-0.2 on the dev host, where it then
    stopped drafting for ~20 steps), while a text that never accepts still drops under it."""
    from macinfer.spec_decode.decoder import SpecDecoder

    spec = SpecDecoder(NgramDrafter())
    for _ in range(300):
        spec._record("others", "ngram:1", accepted=0.45, tried=1.0)
    assert abs(spec.alpha("new", "ngram:1") - 0.45) < 0.02
    for _ in range(3):
        spec._record("r", "ngram:1", accepted=0, tried=1)
    assert spec.alpha("r", "ngram:1") > 0.25
    for _ in range(30):
        spec._record("never", "ngram:1", accepted=0, tried=1, own=True)
    assert spec.alpha("never", "ngram:1") < 0.15


def test_sampled_and_greedy_requests_pool_apart():
    """A new request's prior is the pooled rate of requests drafted in its own mode: drafts that failed
    under sampling leave a new greedy request's estimate at the prior, and a new sampled one's low."""
    from macinfer.spec_decode.decoder import SpecDecoder

    spec = SpecDecoder(NgramDrafter())
    prior = NgramDrafter.BUCKETS[1][1]
    for _ in range(10):
        spec._record("s", "ngram:1", accepted=0, tried=1, sampled=True)
    assert spec.alpha("new", "ngram:1") == prior
    assert spec.alpha("new", "ngram:1", sampled=True) < prior / 2
    # The decoder records each row's drafts in its mode's pool and asks with each row's own mode.
    from macinfer.core.scheduler import ScheduledSequence

    text = [1, 2, 3, 4, 9, 1, 2, 3, 4]  # "1 2 3 4" again: a match of 4 tokens, kind ngram:1
    greedy = Sequence("g", text, SamplingParams(max_tokens=8))
    sampled = Sequence("t", text, SamplingParams(max_tokens=8, temperature=1.0))
    for seq in (greedy, sampled):
        seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, len(text) - 1
    assert spec.kind(greedy) == "ngram:1"
    tried = spec.pooled["ngram:1", True].tried
    spec._kinds = {"t": "ngram:1"}
    spec.update_from_output([ScheduledSequence(sampled, 3, 2)], [[9]], None)  # both drafts rejected
    assert spec.pooled["ngram:1", True].tried == tried + 1 and spec.pooled["ngram:1", False].tried == 4.0
    asked = []
    spec.choose_k = lambda alphas, *a, **kw: asked.append(alphas) or 0
    spec.step_cost.observe(1, 0.05)
    spec._choose([greedy, sampled], 1, sync_now=True)
    assert asked == [[spec.alpha("g", "ngram:1"), spec.alpha("t", "ngram:1", sampled=True)]]
    assert asked[0][0] == prior > asked[0][1]


def checked_copy_generate(P, Q, copy_q: bool, n_tokens=3, seed=0):
    """N generations where each step drafts as LookupDrafter does on a sampled row with a short copy:
    the model draws d_0 ~ Q; where it equals the copy's first token the copy (COPY's chain from the
    context) is drafted, else the model's own chain. q: the model's rows, or for a kept copy
    copy_probs (copy_q) or one-hot everywhere (the naive choice)."""
    rng = np.random.default_rng(seed)
    copy_next = (np.arange(V) + 1) % V  # the copy: token t is followed by t + 1
    out = np.zeros((N, n_tokens + K + 1), dtype=np.int64)
    count, ctx, key = np.zeros(N, dtype=np.int64), np.full(N, START), mx.random.key(seed)
    Pm = mx.array(P, dtype=mx.float32)
    while (count < n_tokens).any():
        drafts, prev = np.zeros((N, K), dtype=np.int64), ctx.copy()
        for i in range(K):  # the model's chain, drawn from Q
            drafts[:, i] = (np.cumsum(Q[prev], 1) < rng.random(N)[:, None]).sum(1).clip(max=V - 1)
            prev = drafts[:, i]
        q = np.stack([Q[np.concatenate([ctx[:, None], drafts[:, :-1]], 1)[:, i]] for i in range(K)], 1)
        kept = drafts[:, 0] == copy_next[ctx]
        chain = np.stack([copy_next[ctx]] + [(copy_next[ctx] + i) % V for i in range(1, K)], 1)
        drafts[kept] = chain[kept]
        # A kept copy's q depends on the context only (its first row is Q[ctx], its chain follows ctx).
        chains = [[int(copy_next[c] + i) % V for i in range(K)] for c in range(V)]
        if copy_q:
            kept_q = np.stack([np.array(copy_probs(mx.array(Q[c], dtype=mx.float32), chains[c])) for c in range(V)])
        else:
            kept_q = np.eye(V, dtype=np.float32)[np.array(chains)]
        q = np.where(kept[:, None, None], kept_q[ctx], q).astype(np.float32)
        prevs = np.concatenate([ctx[:, None], drafts], axis=1)
        key, sub = mx.random.split(key)
        res = np.array(rejection_sample(Pm[mx.array(prevs)], mx.array(drafts, dtype=mx.int32), mx.array(q), sub))
        active, a = count < n_tokens, res[:, 0]
        for j in range(K + 1):
            r = np.flatnonzero(active & (j <= a))
            out[r, count[r] + j] = res[r, 1 + j]
        count = np.where(active, count + a + 1, count)
        ctx = out[np.arange(N), count - 1]
    return out[:, :n_tokens]


def test_a_copy_kept_where_the_models_draw_agrees_stays_exact():
    """LookupDrafter on a sampled row keeps a short copy only where the model's own draw matches its first
    token, so that token is distributed as the model's q: verified with copy_probs (the model's row, then
    one-hot) the output follows the target; verified as a deterministic copy (one-hot) it does not."""
    P, Q = tables()
    assert joint_pvalue(checked_copy_generate(P, Q, copy_q=True), P) > 1e-3
    assert joint_pvalue(checked_copy_generate(P, Q, copy_q=False), P) < 1e-6
