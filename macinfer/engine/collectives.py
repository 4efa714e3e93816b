"""The collectives inside a split model's forward: recorded while it is built, replayed alone to time them.

mlx-lm's split models call `mx.distributed` inside their forward: ShardedToAllLinear's all_sum
(tensor parallel); a pipeline stage's recv_like / send and the closing all_gather that hands the
last stage's hidden states to every rank. One forward is one lazy graph, so the time of its
collectives cannot be read off its evaluation. Instead `Recorder` notes each call (op, shape,
dtype, peer) while the forward is built, and `replay` runs the same calls alone on zeros, in the
same order, on every rank: the forward's communication time without its compute.

The recorder also keeps what each all_gather received: on a pipeline, this rank's stage output (the
hidden states it sent on, or its last layer's). `run_micro_batches` queues those one micro-batch at a
time, so a stage computes micro-batch m + 1 while the next stage works on m.

NOTE: recording swaps the functions on the `mx.distributed` module for the time one forward is
built, on the engine's thread (the only thread that builds MLX graphs or runs collectives).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import mlx.core as mx

_OPS = ("all_sum", "all_gather", "send", "recv", "recv_like")


class Recorder:
    """The collectives of the forwards built inside `recording()`, in call order.

    calls: (op, shape, dtype, peer) with op one of all_sum / all_gather / send / recv (recv_like
    is recorded as recv) and peer the destination or source rank (None for collectives).
    gathered: the arrays handed to all_gather (a pipeline's stage outputs).
    """

    def __init__(self):
        self.calls: list[tuple[str, tuple, mx.Dtype, int | None]] = []
        self.gathered: list[mx.array] = []

    @contextmanager
    def recording(self):
        originals = {name: getattr(mx.distributed, name) for name in _OPS}
        for name, fn in originals.items():
            setattr(mx.distributed, name, self._wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(mx.distributed, name, fn)

    def _wrap(self, name: str, fn):
        def recorded(*args, **kwargs):
            out = fn(*args, **kwargs)
            if name == "recv":  # recv(shape, dtype, src)
                shape, dtype, peer = (list(args) + [kwargs.get(k) for k in ("shape", "dtype", "src")[len(args):]])[:3]
                self.calls.append(("recv", tuple(shape), dtype, peer))
                return out
            x = args[0] if args else kwargs["x"]
            peer = (args[1] if len(args) > 1 else kwargs.get("dst", kwargs.get("src"))) if name in ("send", "recv_like") else None
            self.calls.append(("recv" if name == "recv_like" else name, tuple(x.shape), x.dtype, peer))
            if name == "all_gather":
                self.gathered.append(x)
            return out
        return recorded


def replay(calls: list[tuple], group) -> float:
    """Run `calls` (a Recorder's) on zeros, in order, on this rank; returns the seconds they took.

    Every rank must replay its own record of the same forward: the calls then pair up as the
    forward's did. Each call's input depends on the one before, so the order holds inside a graph.
    """
    inputs = [None if op == "recv" else mx.zeros(shape, dtype) for op, shape, dtype, _ in calls]
    mx.eval([x for x in inputs if x is not None])
    t0 = time.perf_counter()
    prev = None
    for (op, shape, dtype, peer), x in zip(calls, inputs):
        if op == "recv":  # no inputs to hang the order on: what came before goes first
            if prev is not None:
                mx.eval(prev)
            prev = mx.distributed.recv(shape, dtype, peer, group=group)
            continue
        x = x if prev is None else mx.depends(x, prev)
        if op == "send":
            prev = mx.distributed.send(x, peer, group=group)
        else:
            prev = getattr(mx.distributed, op)(x, group=group)
    if prev is not None:
        mx.eval(prev)
    return time.perf_counter() - t0


def micro_batch_bounds(rows: int, n: int) -> list[tuple[int, int]]:
    """Rows [lo, hi) of each of min(n, rows) micro-batches, as even as can be (the first ones larger)."""
    n = max(1, min(n, rows))
    base, extra = divmod(rows, n)
    bounds, lo = [], 0
    for i in range(n):
        hi = lo + base + (i < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def run_micro_batches(run_forward, n: int, recorder: Recorder, tables, starts, tokens, seqs=None,
                      all_logits=False, head=None, prompt_lens=None) -> mx.array:
    """A pipelined forward (ModelRunner.run_forward's arguments) as n micro-batches of its rows -> logits (B, V).

    Each micro-batch is a forward of its own, built and queued in turn: first up to its stage
    output (the all_gather's input), so that this rank moves on to micro-batch m + 1 while the
    next stage still works on m; then, once every stage output is queued, each closing
    all_gather with its head. Every rank queues the same sends, receives and all_gathers in the
    same order, so they pair up (MLX runs a stream's work in the order it was queued).

        stage 1 (first layers):  L0 S0 L1 S1 ... G0 G1        L: layers, S / R: send / receive
        stage 0 (last layers):   R0 L0 R1 L1 ... G0 G1        G: the closing all_gather

    A forward that wants every position's logits (drafts) or another head runs whole.
    """
    bounds = micro_batch_bounds(len(tables), n)
    if len(bounds) == 1 or all_logits or head is not None:
        return run_forward(tables, starts, tokens, seqs, all_logits, head, prompt_lens)
    parts = []
    for lo, hi in bounds:
        gathered = len(recorder.gathered)
        part = run_forward(tables[lo:hi], starts[lo:hi], tokens[lo:hi], seqs and seqs[lo:hi], False, None,
                           prompt_lens and prompt_lens[lo:hi])
        # A model without the closing all_gather: the whole micro-batch, in turn (no overlap, still paired).
        mx.async_eval(recorder.gathered[gathered:] or part)
        parts.append(part)
    for part in parts:
        mx.async_eval(part)
    return mx.concatenate(parts)
