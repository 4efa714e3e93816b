"""Probing an mlx-lm model for the paged cache: what each layer needs, and routing its attention.

`inspect_model` builds the model's own caches (`make_prompt_cache`) and runs one lazy
forward (nothing is computed) to learn each attention layer's K/V shapes and which
layers keep recurrent state; what cannot be paged is refused here, in one line.
`install_attention_patch` sends the model's `scaled_dot_product_attention` calls for
paged caches to paged attention (macinfer.kv.paged_cache), after the families that
attend their own way are retyped (macinfer.kv.attention_variants).
"""

from __future__ import annotations

import inspect
import re
import sys

import mlx.core as mx
import mlx.nn as nn

from macinfer.errors import MacinferError
from macinfer.kv import paged_cache as _pc
from macinfer.kv.attention_variants import batched_offsets_work, install_attention_variants
from macinfer.kv.paged_cache import LayerSpec, paged_sdpa
from macinfer.kv.state_cache import ModelSpecs, split_caches, state_specs, token_windows


def install_attention_patch(model: nn.Module) -> int:
    """Route `scaled_dot_product_attention` in every module the model's classes live in.

    Returns:
        How many modules were patched (0: the model does not use mlx-lm's sdpa).
    """
    from mlx_lm.models import base

    install_attention_variants(model)  # families that attend their own way (gemma2, KV sharing)
    names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    patched = 0
    for name in names:
        mod = sys.modules.get(name)
        fn = getattr(mod, "scaled_dot_product_attention", None)
        if fn is base.scaled_dot_product_attention:
            mod.scaled_dot_product_attention = paged_sdpa
            patched += 1
        elif fn is paged_sdpa:
            patched += 1
    return patched


class UnseenAttention(MacinferError):
    """Some layer computes its attention in its own code, where no cache hook sees it."""


def inspect_model(model: nn.Module, model_type: str = "?") -> list[LayerSpec]:
    """Probe the model once (lazily: nothing is computed) and describe its layers.

    Raises:
        MacinferError: naming the architecture, if any layer cannot be paged.
    """
    from mlx_lm.models.cache import ChunkedKVCache, RotatingKVCache, make_prompt_cache


    # Recurrent layers (ArraysCache) get state slots (macinfer.kv.state_cache); the rest must be attention.
    model_caches = make_prompt_cache(model)
    caches, states, layout = split_caches(model_caches, model_type)
    for c in caches:  # split_caches refused every other cache type
        if isinstance(c, RotatingKVCache) and c.keep:
            raise MacinferError(f"{model_type}: attention-sink caches (keep={c.keep}) are not supported")
    install_attention_patch(model)
    windows = token_windows(model, states)
    for c in states:  # a token window starts full of zeros (token_windows): then its size is fixed
        if id(c) in windows:
            c[0] = mx.zeros((1, windows[id(c)]), dtype=mx.int64)
    _pc.probe_calls = []
    try:
        model(mx.array([[0, 0]]), cache=model_caches)  # lazy: only shapes are computed
        calls = _pc.probe_calls
    except Exception as e:  # noqa: BLE001 - any failure here means we cannot page it
        raise MacinferError(f"{model_type}: probing the model's attention failed ({type(e).__name__}: {e})") from None
    finally:
        _pc.probe_calls = None
    if states:
        _refuse_growing_states(model, model_caches, states, model_type)
    by_cache = {id(c): (kshape, vshape, dtype) for c, kshape, vshape, dtype in calls}
    if len(calls) != len(caches) or any(id(c) not in by_cache for c in caches):
        raise UnseenAttention(
            f"{model_type}: its attention does not go through mlx-lm's scaled_dot_product_attention once "
            f"per layer ({len(calls)} calls for {len(caches)} layers), so it cannot be paged safely"
        )
    specs = []
    for c in caches:
        kshape, vshape, dtype = by_cache[id(c)]
        window = c.max_size if isinstance(c, RotatingKVCache) else None
        chunk = c.chunk_size if isinstance(c, ChunkedKVCache) else None
        specs.append(LayerSpec(n_kv_heads=kshape[1], k_head_dim=kshape[3], v_head_dim=vshape[3], window=window,
                               dtype=dtype, chunk=chunk))
    lists = any(entry[0] == "kvlist" for entry in layout)
    return ModelSpecs(specs, state_specs(states, model_type, windows), layout) if states or lists else specs


def _refuse_growing_states(model: nn.Module, model_caches: list, states: list, model_type: str) -> None:
    """A state slot has a fixed size: refuse a layer whose state grows with the tokens it has seen
    (a token window not started full, see token_windows). One more lazy forward."""
    before = [[a.shape for a in c.cache] for c in states]
    try:
        model(mx.array([[0, 0, 0, 0]]), cache=model_caches)
    except Exception:  # noqa: BLE001 - the first probe passed; the state shapes stand as they are
        return
    after = [[a.shape for a in c.cache] for c in states]
    if after != before:
        raise MacinferError(f"{model_type}: a recurrent layer's state changes size with the tokens it has seen, "
                            "so it cannot take a fixed-size state slot")


def supports_batched_offsets(model: nn.Module) -> bool:
    """Whether every RoPE in the model accepts a per-row (B,) offset array."""
    from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

    # Dynamic NTK scaling computes its base from a Python max over the offset; others (gpt_bigcode's
    # position ids) make a Python int of it, which a lazy two-row forward finds out.
    return (not any(isinstance(m, DynamicNTKScalingRoPE) for _, m in model.named_modules())
            and batched_offsets_work(model))


# Reading an array back (or evaluating one) inside a forward: what a lazy forward must not do.
_EVAL_POINT = re.compile(r"mx\.eval\(|mx\.async_eval\(|\.item\(\)|\.tolist\(\)|np\.(?:as)?array\(")


def forward_evaluates(model: nn.Module) -> list[str]:
    """The modules of the model's classes whose source reads arrays back (mlx-lm's dbrx routes with
    `inds.tolist()`, muse_spark evaluates its prefill chunks): their forward is not lazy.

    Read from the source of every module a class of the model lives in, so a new mlx-lm model is
    judged as it is; macinfer's own modules (the attention and RoPE it installs) keep their forwards
    lazy by construction and are not read. The engine then builds such a forward only while nothing
    else evaluates (macinfer.core.evaluator).
    """
    names = sorted(n for n in {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
                   if n.split(".")[0] != "macinfer")
    found = []
    for name in names:
        try:
            source = inspect.getsource(sys.modules[name])
        except (KeyError, OSError, TypeError):
            continue
        if _EVAL_POINT.search(source):
            found.append(name)
    return found
