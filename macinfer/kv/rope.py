"""RoPE with the angles computed once per forward instead of twice per layer (CPU backend).

On Metal `mx.fast.rope` is one fused kernel. On the CPU backend it has no kernel: MLX
builds its fallback graph at every call, ~29 ops (positions, inverse frequencies,
cos, sin, then the rotation), and an mlx-lm model calls it twice per layer (queries
and keys). Every op costs dispatch time whatever its size, so on a decode step this
is the largest single block of the graph (58 of ~150 ops per layer on a Llama).

Yet the angles depend only on the positions, which every layer of one forward
shares. `SharedRoPE` takes the place of a model's RoPE module and, inside an engine
forward, applies a rotation (one compiled op) with cos/sin built once per forward
and kept in the ForwardContext's memo:

    cos, sin = rope(e) where e = [1 ... 1 | 0 ... 0]   (MLX's own rope, so the angles are
                                                        bit-identical to what it uses)
    out      = [x1 * cos - x2 * sin | x1 * sin + x2 * cos | x[dims:]]   (its fallback's formula)

NOTE: outputs must stay token-for-token those of mlx-lm, so this is only installed
after a start-up check (`rotation_matches`) finds it bit-identical to `mx.fast.rope`
on this machine; anything else (mlx-lm's own caches, Metal, other RoPE classes)
keeps calling the original module.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from macinfer.kv.paged_cache import current_forward


def _rope_args(module) -> tuple | None:
    """(dims, traditional, base, scale, freqs) of a RoPE that is a plain mx.fast.rope call, else None."""
    if type(module) is nn.RoPE:
        return module.dims, module.traditional, module.base, module.scale, None
    try:
        from mlx_lm.models.rope_utils import Llama3RoPE
    except ImportError:  # pragma: no cover - older mlx-lm
        return None
    if type(module) is Llama3RoPE:
        return module.dims, module.traditional, None, 1.0, module._freqs
    return None


def _rotate(x: mx.array, cos: mx.array, sin: mx.array, dims: int, traditional: bool) -> mx.array:
    """MLX's RoPE fallback rotation with given cos/sin ((B or 1, 1, L, dims/2))."""
    half = dims // 2
    if traditional:
        x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
        out = mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(*x.shape[:-1], dims)
    else:
        x1, x2 = x[..., :half], x[..., half:dims]
        out = mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    if dims < x.shape[-1]:
        out = mx.concatenate([out, x[..., dims:]], axis=-1)
    return out


def _rotate_full(x: mx.array, x_swapped: mx.array, c: mx.array, s: mx.array) -> mx.array:
    # Per element: x1 * cos + x2 * (-sin) and x2 * cos + x1 * sin. IEEE negation, a - b ==
    # a + (-b) and a + b == b + a are exact, so this equals _rotate bit for bit.
    # NOTE: not mx.compile'd: a compiled function is traced again for every new input shape,
    # and a continuous batch changes shape whenever a request joins or leaves (measured: the
    # tiny model at 16 requests fell from 0.92x to 0.75x of BatchGenerator, and building a
    # 32-row step's graph took 7.1 ms instead of 2.5).
    return x * c + x_swapped * s


def _full_width(cos: mx.array, sin: mx.array, traditional: bool) -> tuple[mx.array, mx.array, mx.array]:
    """(pair permutation, C, S) so that rotating x is x * C + x[..., perm] * S (dims == head_dim)."""
    half = cos.shape[-1]
    if traditional:  # pairs (2i, 2i + 1)
        perm = mx.arange(2 * half).reshape(half, 2)[:, ::-1].reshape(-1)
        c = mx.stack([cos, cos], axis=-1).reshape(*cos.shape[:-1], 2 * half)
        s = mx.stack([-sin, sin], axis=-1).reshape(*sin.shape[:-1], 2 * half)
    else:  # pairs (i, i + half)
        perm = mx.concatenate([mx.arange(half, 2 * half), mx.arange(half)])
        c = mx.concatenate([cos, cos], axis=-1)
        s = mx.concatenate([-sin, sin], axis=-1)
    return perm.astype(mx.int32), c, s


def _angles(B: int, L: int, args: tuple, offset, dtype) -> tuple[mx.array, mx.array]:
    """cos, sin (B, 1, L, dims/2) for rows starting at offset, through MLX's own rope."""
    dims, traditional, base, scale, freqs = args
    half = dims // 2
    ones, zeros = mx.ones((B, 1, L, half), dtype=dtype), mx.zeros((B, 1, L, half), dtype=dtype)
    # rope([1 | 0]) = [1 * cos - 0 * sin | 1 * sin + 0 * cos] = [cos | sin], exactly.
    e = (mx.stack([ones, zeros], axis=-1).reshape(B, 1, L, dims) if traditional
         else mx.concatenate([ones, zeros], axis=-1))
    r = mx.fast.rope(e, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs)
    if traditional:
        r = r.reshape(B, 1, L, half, 2)
        return r[..., 0], r[..., 1]
    return r[..., :half], r[..., half:]


class SharedRoPE(nn.Module):
    """Drop-in for a model's RoPE module; shares the angles across layers in engine forwards.

    Args:
        inner: the original module (nn.RoPE or mlx-lm's Llama3RoPE), still used for
            every call that does not come from a paged forward.
    """

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self._args = _rope_args(inner)

    def __call__(self, x: mx.array, offset=0):
        ctx = current_forward()
        # The paged cache hands out ctx.offsets itself; anything else is not our forward.
        if ctx is None or offset is not ctx.offsets:
            return self.inner(x, offset=offset)
        B, _, L, _ = x.shape
        key = ("rope", self._args[:4], id(self._args[4]), B, L, x.dtype)
        if key not in ctx.memo:
            ctx.memo[key] = _angles(B, L, self._args, offset, x.dtype)
        return _apply(x, ctx.memo[key], self._args, ctx.memo)


def _apply(x: mx.array, angles: tuple, args: tuple, memo: dict) -> mx.array:
    """Rotate x (B, H, L, D) by angles; memo holds the full-width tables for this forward."""
    dims, traditional = args[0], args[1]
    cos, sin = angles
    if dims != x.shape[-1]:  # partial rotation: the pass-through tail needs a concatenate
        return _rotate(x, cos, sin, dims, traditional)
    key = ("rope_full", id(cos))
    if key not in memo:
        memo[key] = (cos, *_full_width(cos, sin, traditional))  # cos kept alive: its id is the key
    _, perm, c, s = memo[key]
    pkey = ("rope_perm", id(perm), x.shape)
    if pkey not in memo:  # pre-broadcast: take_along_axis is then one op per call
        memo[pkey] = mx.broadcast_to(perm, x.shape)
    return _rotate_full(x, mx.take_along_axis(x, memo[pkey], axis=-1), c, s)


def rotation_matches(args: tuple, dtype=mx.float32, head_dim: int | None = None) -> bool:
    """Whether SharedRoPE reproduces mx.fast.rope bit for bit here.

    Runs the inputs a forward produces (one row and several, one position and several,
    queries as the transposed view the attention hands over), which also compiles every
    kernel variant now rather than inside the first forward of each shape (a cold
    compile costs up to ~0.7 s: spec decoding's step-cost model would learn it).
    """
    dims = args[0]
    # The engine's head_dim (partial rotation when wider) and exactly dims (full width): the head_dim
    # handed in is the first layer's K width, which an MLA layer's latent does not share with its rope.
    shapes = [(D, B, L) for D in {max(head_dim or dims, dims), dims} for B, L in ((1, 1), (1, 5), (3, 1), (3, 5))]
    for D, B, L in shapes:
        x = mx.random.normal((B, L, 4, D), key=mx.random.key(B * 10 + L)).astype(dtype).transpose(0, 2, 1, 3)
        offset = 37 if B == 1 else mx.array([0, 513, 4099], dtype=mx.int32)
        want = mx.fast.rope(x, dims, traditional=args[1], base=args[2], scale=args[3], offset=offset, freqs=args[4])
        if not mx.array_equal(_apply(x, _angles(B, L, args, offset, dtype), args, {}), want).item():
            return False
    return True


def install_shared_rope(model: nn.Module, dtype=mx.float32, head_dim: int | None = None) -> int:
    """Swap the model's RoPE modules for SharedRoPE where that is exact and pays (CPU backend).

    Returns:
        How many modules now share angles (0 on Metal, or if the check fails).
    """
    if mx.default_device().type != mx.DeviceType.cpu:
        return 0  # one fused kernel per call there: nothing to save
    swaps, checked = [], {}
    for _, parent in model.named_modules():
        if isinstance(parent, SharedRoPE):
            continue  # its `inner` is the original, on purpose
        for name, child in parent.children().items():
            if isinstance(child, SharedRoPE):
                swaps.append(None)
                continue
            args = _rope_args(child)
            if args is None:
                continue
            key = (args[:4], id(args[4]))
            if key not in checked:
                checked[key] = rotation_matches(args, dtype, head_dim)
            if checked[key]:
                swaps.append((parent, name, child))
    for swap in swaps:
        if swap is not None:
            parent, name, child = swap
            setattr(parent, name, SharedRoPE(child))
    return len(swaps)
