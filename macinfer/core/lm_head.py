"""The model's LM head: where it is, how to split it from the body, a head over part of the vocabulary.

Drafts share the target's (tied) embedding as their head, and a feature draft reads the
target's final hidden states, which needs the model cut into body and head.
"""

from __future__ import annotations

import mlx.core as mx

from macinfer.errors import MacinferError


def embedding_and_head(target_model) -> tuple:
    """(embedding module, untied lm_head module or None) of an mlx-lm model."""
    inner = getattr(target_model, "model", None)
    if inner is None and hasattr(target_model, "language_model"):
        target_model = target_model.language_model
        inner = getattr(target_model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if embed is None:
        raise MacinferError("the target model has no model.embed_tokens: an embedding-less draft cannot attach to it")
    args = getattr(target_model, "args", None)
    tied = getattr(args, "tie_word_embeddings", True) if args is not None else not hasattr(target_model, "lm_head")
    head = None if tied else getattr(target_model, "lm_head", None)
    return embed, head


def embedding_rows_and_dim(embed) -> tuple[int, int]:
    """(rows, width) of an Embedding or QuantizedEmbedding's table."""
    w = embed.weight
    rows = w.shape[0]
    dim = w.shape[1]
    bits = getattr(embed, "bits", None)
    if bits:  # QuantizedEmbedding: packed uint32 columns
        dim = dim * 32 // bits
    return rows, dim


class SubsetHead:
    """lm_head over a subset of the vocabulary: (..., D) -> full-width (..., V) logits, -inf elsewhere.

    Args:
        embed: the target's (tied) embedding, Embedding or QuantizedEmbedding.
        ids: the kept token ids (int32).
        vocab: the full vocabulary size V.
    """

    def __init__(self, embed, ids, vocab: int):
        self.ids = ids.astype(mx.int32)
        self.weight = embed(self.ids)  # (N, D) dequantised rows, a copy: 8,192 rows x 576 = 19 MB in float32
        self.vocab = vocab

    @classmethod
    def mapping(cls, ids, vocab: int) -> "SubsetHead":
        """The map of a draft's own smaller vocabulary onto the target's (row i is target token ids[i]),
        with no weight: the draft computes those N logits with its own head (an EAGLE-3 draft's d2t)."""
        head = cls.__new__(cls)
        head.ids, head.weight, head.vocab = ids.astype(mx.int32), None, vocab
        return head

    def __call__(self, h):
        return self.expand(h @ self.weight.T)

    def expand(self, sub):
        """(..., N) logits of the kept tokens -> full-width (..., V), -inf elsewhere."""
        full = mx.full((*sub.shape[:-1], self.vocab), -mx.inf, dtype=sub.dtype)
        full[..., self.ids] = sub
        return full


def split_head(model):
    """(body, head) of an mlx-lm model such that head(body(x, cache)) == model(x, cache).

    Checked numerically on a 3-token input, so a model whose __call__ does more than
    body-then-head (logit scaling, soft-capping) is refused rather than drafted for wrongly.
    """
    inner = getattr(model, "model", None)
    if inner is None:
        raise MacinferError("feature drafts need an mlx-lm model with a .model body")
    embed, untied = embedding_and_head(model)  # the same tied/untied rule the draft loader applies
    head = untied if untied is not None else embed.as_linear
    x = mx.array([[1, 2, 3]])
    try:
        same = mx.allclose(model(x), head(inner(x)), atol=1e-4, rtol=1e-4).item()
    except Exception:  # noqa: BLE001 - a body that is not (tokens, cache) -> hidden states
        same = False
    if not same:
        raise MacinferError(f"{type(model).__module__}: its logits are not lm_head(final hidden state), "
                            "so a feature draft cannot read its hidden states")
    return inner, head
