"""Quantisation recipes: which bits each layer gets, as a predicate for mlx-lm's quantize_model.

"uniform" gives every quantisable layer cfg.bits. "mixed" reuses mlx-lm's choice of
"more bits" layers (mixed_4_6, llama.cpp's Q4_K_M rule) and sets the bits itself:
HIGH_BITS for those layers, and embeddings / lm_head at EMBED_BITS (mlx-lm's recipe
leaves a tied embedding, which is also the lm_head, at low bits).
"""

from __future__ import annotations

from typing import Callable

from macinfer.errors import MacinferError
from macinfer.modelio.quant_config import QuantConfig

EMBED_BITS = 8
HIGH_BITS = {2: 6, 3: 6, 4: 6, 5: 8, 6: 8, 8: 8}


def make_predicate(model, cfg: QuantConfig) -> Callable:
    """The quant_predicate for mlx_lm.utils.quantize_model that implements cfg.recipe.

    Args:
        model: the float model (its own quant_predicate, if any, is respected).
        cfg: bits, group size and recipe.

    Returns:
        predicate(path, module): a per-layer dict (bits, group size, mode) or False,
        so the config records every layer's bits explicitly.
    """
    model_pred = getattr(model, "quant_predicate", None)  # e.g. MoE routers stay float
    base = {"group_size": cfg.group_size, "mode": "affine"}
    high = None
    if cfg.recipe == "mixed":
        from mlx_lm.convert import mixed_quant_predicate_builder

        # mlx-lm's mixed_4_6 picks its "more bits" layers with llama.cpp's Q4_K_M rule;
        # we reuse that choice and set the bits ourselves.
        try:
            high = mixed_quant_predicate_builder("mixed_4_6", model, cfg.group_size)
        except ValueError:
            raise MacinferError("recipe 'mixed' needs a model with down_proj layers: use --recipe uniform") from None

    def predicate(path: str, module) -> bool | dict:
        if not hasattr(module, "to_quantized"):
            return False
        if model_pred is not None and model_pred(path, module) is False:
            return False
        if high is None:
            return {**base, "bits": cfg.bits}
        if "embed_tokens" in path or "lm_head" in path or path.endswith("wte"):
            return {**base, "bits": max(EMBED_BITS, cfg.bits)}
        if high(path, module)["bits"] == 6:
            return {**base, "bits": HIGH_BITS[cfg.bits]}
        return {**base, "bits": cfg.bits}

    return predicate


def unquantizable(model, predicate, group_size: int) -> list[tuple[str, int]]:
    """Layers the recipe wants quantised whose input width the group size does not divide.

    Args:
        model: the float model.
        predicate: the recipe's predicate (make_predicate).
        group_size: the quantisation group size.

    Returns:
        (layer path, input width) of each such layer.
    """
    out = []
    for path, m in model.named_modules():
        if hasattr(m, "to_quantized") and hasattr(m, "weight") and predicate(path, m):
            if m.weight.shape[-1] % group_size:
                out.append((path, m.weight.shape[-1]))
    return out


def checked_predicate(model, cfg: QuantConfig, name: str) -> Callable:
    """The recipe's predicate, once every layer it quantises has a width the group size divides.

    Args:
        model: the float model.
        cfg: bits, group size and recipe.
        name: the model's name, for the error.

    Returns:
        The predicate (make_predicate).

    Raises:
        MacinferError: some layer's input width is not a multiple of cfg.group_size.
    """
    predicate = make_predicate(model, cfg)
    bad = unquantizable(model, predicate, cfg.group_size)
    if bad:
        widths = sorted({w for _, w in bad})
        raise MacinferError(
            f"--group-size {cfg.group_size} does not divide the input width ({', '.join(map(str, widths))}) "
            f"of {len(bad)} layers of {name}: use a group size that divides it"
        )
    return predicate
