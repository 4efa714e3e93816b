"""A linear layer for MLX's CPU backend that computes a few rows as the weight times their transpose.

A decode step computes one row per sequence, a speculative verify step 1 + k rows (k drafts). On
the CPU backend a linear layer is a BLAS sgemm, `x @ W.T`; with OpenBLAS a product of 2 to 4 rows
by a weight of the small sizes a small model has costs up to twice one row's, where `(W @ x.T).T`,
the same dot products with the small side as the matrix's columns, costs about what one row does.
Measured in one process (2-core x86, OpenBLAS 0.3.21 Haswell kernels, float32; SmolLM2-135M's
30 layers through the engine's forward after 100 tokens, median of 25): 2 rows 57.6 -> 53.7 ms,
3 rows 64.6 -> 58.7 ms, one row unchanged (48 ms); in isolation, `(W @ x.T).T` over `x @ W.T` at
2-4 rows is 0.52-0.64x for 576 x 576 to 1536 x 576 weights, 0.54-0.77x at 2048 x 2048, and ~0.9-1.1x
from 8192 x 2048 up (and for a 49,152-row head, where it is slower). So only those rows and weights
take the other form: one row (a decode step of one sequence) computes exactly as mlx-lm does.

The two forms compute each output as the same dot product, with BLAS free to sum it in another
order: results may differ in the last bits, as a batched row already does from a single one.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

ROWS = (2, 4)  # rows computed as W @ x.T (inclusive bounds): where it was measured to pay
MAX_WEIGHT = 2048 * 2048  # weight elements up to which it does (larger weights: no gain measured)


class CpuLinear(nn.Linear):
    """nn.Linear whose products of ROWS rows by a weight of at most MAX_WEIGHT elements are (W @ x.T).T."""

    def __call__(self, x: mx.array) -> mx.array:
        w = self["weight"]
        rows = x.size // x.shape[-1]
        if ROWS[0] <= rows <= ROWS[1] and w.size <= MAX_WEIGHT:
            xt = x.reshape(rows, x.shape[-1]).T
            y = mx.addmm(self["bias"][:, None], w, xt) if "bias" in self else w @ xt
            return y.T.reshape(*x.shape[:-1], w.shape[0])
        # nn.Linear's own computation, inline: every decode step calls this once per layer
        return mx.addmm(self["bias"], x, w.T) if "bias" in self else x @ w.T


def use_cpu_linears(model: nn.Module) -> int:
    """Make the float nn.Linear layers of a model loaded for the CPU backend CpuLinear; returns how many.

    Quantized and sharded layers (other classes) are left as they are, and so is everything on Metal,
    whose matrix-vector kernels have no such cost.
    """
    if mx.metal.is_available():
        return 0
    n = 0
    for _, m in model.named_modules():
        if type(m) is nn.Linear:
            m.__class__ = CpuLinear  # same fields, another __call__
            n += 1
    return n
