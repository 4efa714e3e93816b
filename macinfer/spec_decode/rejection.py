"""Verifying drafted tokens: greedy matching and exact rejection sampling.

A drafter proposes k tokens d_0..d_{k-1}; one target forward gives the target's
distributions p_0..p_k at those positions plus one more (the bonus):

    tokens fed     [ t  d_0  d_1 ... d_{k-1} ]        t: the last real token
    target gives   [ p_0 p_1 p_2 ...   p_k   ]        p_i: next-token distribution
    p_i verifies d_i; p_k is the bonus position, used when every draft is accepted.

Rejection sampling (Leviathan et al. 2023, Chen et al. 2023): accept d_i with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection, emit a token
drawn from norm(max(0, p_i - q_i)) and stop; if all k are accepted, emit a
token drawn from p_k. Each emitted token is then distributed exactly as the
target would sample it, whatever q is. A deterministic drafter (n-gram) has a
one-hot q: accept with probability p_i(d_i), and on rejection sample from p_i
with d_i removed.

With greedy decoding p_i is one-hot on argmax, and the rule reduces to "accept
while d_i == argmax", so the output is token-for-token the non-speculative one.

All functions return one layout, shape (..., k + 2), int32:

    [num_accepted, x_0, x_1, ..., x_k]   the emitted tokens are x_0..x_{num_accepted}

(x_i = d_i for i < num_accepted; the slots after x_{num_accepted} are junk).
"""

from __future__ import annotations

import mlx.core as mx


def greedy_verify(target_ids: mx.array, drafts: mx.array) -> mx.array:
    """Greedy verification.

    Args:
        target_ids: (..., k + 1) the target's argmax at each position.
        drafts: (..., k) drafted token ids.

    Returns:
        (..., k + 2) int32 [num_accepted, x_0..x_k] (x = target_ids).
    """
    target_ids = target_ids.astype(mx.int32)
    k = drafts.shape[-1]
    match = (target_ids[..., :k] == drafts.astype(mx.int32)).astype(mx.int32)
    num_accepted = mx.cumprod(match, axis=-1).sum(axis=-1, keepdims=True)  # leading matches
    return mx.concatenate([num_accepted.astype(mx.int32), target_ids], axis=-1)


def rejection_sample(p: mx.array, drafts: mx.array, q: mx.array | None, key: mx.array) -> mx.array:
    """Exact speculative sampling.

    Args:
        p: (..., k + 1, V) target probabilities at the k drafted positions and the bonus
            position (the Sampler's exact distribution: temperature and filters applied).
        drafts: (..., k) drafted token ids, drawn from q.
        q: (..., k, V) the draft distributions the drafts were drawn from, or None when
            the drafter is deterministic (q one-hot on each draft).
        key: a PRNG key (the request's own).

    Returns:
        (..., k + 2) int32 [num_accepted, x_0..x_k]: the emitted tokens are x_0..x_{num_accepted}.
    """
    k = drafts.shape[-1]
    drafts = drafts.astype(mx.int32)
    key_u, key_x = mx.random.split(key)
    p_draft = mx.take_along_axis(p[..., :k, :], drafts[..., None], axis=-1)[..., 0]  # (..., k)
    if q is None:
        q_draft = mx.ones_like(p_draft)
    else:
        q_draft = mx.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    # u < p/q happens with probability min(1, p/q); written without a division.
    u = mx.random.uniform(shape=p_draft.shape, key=key_u)
    accept = (u * q_draft < p_draft).astype(mx.int32)
    num_accepted = mx.cumprod(accept, axis=-1).sum(axis=-1, keepdims=True)  # (..., 1)

    # The one emitted token is drawn at position j = num_accepted: from the residual
    # max(0, p_j - q_j) where a draft was rejected, from p_k where all were accepted. Only that
    # row is built (the other k rows' passes over the vocabulary cost ~0.4 ms each on a CPU).
    p_j = mx.take_along_axis(p, num_accepted[..., None], axis=-2)[..., 0, :]  # (..., V)
    rejected = num_accepted < k  # (..., 1): else j = k, no draft there, the residual is p_k itself
    last = mx.minimum(num_accepted, k - 1)
    if q is None:  # one-hot q: the residual is p_j without the draft
        d_j = mx.take_along_axis(drafts, last, axis=-1)  # (..., 1)
        residual = mx.where((mx.arange(p.shape[-1]) == d_j) & rejected, 0.0, p_j)
    else:
        q_j = mx.take_along_axis(q, last[..., None], axis=-2)[..., 0, :]
        residual = mx.maximum(p_j - mx.where(rejected, q_j, 0.0), 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    # NOTE: a residual has zero mass only where p == q, and then that position is
    # accepted with probability 1, so the fallback to p is never emitted.
    dist = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p_j)
    x = mx.random.categorical(mx.log(dist), key=key_x)  # (...,)
    pos = mx.arange(k + 1)
    padded = mx.concatenate([drafts, mx.zeros_like(drafts[..., :1])], axis=-1)
    tokens = mx.where(pos < num_accepted, padded, x[..., None]).astype(mx.int32)
    return mx.concatenate([num_accepted.astype(mx.int32), tokens], axis=-1)

