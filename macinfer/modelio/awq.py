"""AWQ as a float-weight transform: activation-aware scaling and clipping before any recipe.

mlx-lm's `mlx_lm.quant.awq.awq_quantize` searches the scales and clips and then
quantises every layer the same way. Here the same searches (mlx-lm's `scale_block`,
`clip_block`) run without that final step: the scales are folded into the previous
norm / linear (an exact float identity) and the clipped weights stay float, so that
any recipe of macinfer.modelio.quantize can quantise afterwards.
"""

from __future__ import annotations

from macinfer.errors import MacinferError
from macinfer.modelio.quant_config import Progress, QuantConfig
from macinfer.modelio.texts import encode_text


def calibration_tokens(tokenizer, text: str, n_tokens: int, seq_len: int):
    """Token ids to calibrate on, from the start of `text`.

    Args:
        tokenizer: the model's tokenizer.
        text: the calibration text.
        n_tokens: tokens wanted at most.
        seq_len: tokens per sequence.

    Returns:
        An (N, seq_len) mx.array, N = n_tokens // seq_len or fewer if the text is short.

    Raises:
        MacinferError: the text holds fewer than seq_len tokens.
    """
    import mlx.core as mx

    ids = encode_text(tokenizer, text)
    n = min(n_tokens, len(ids)) // seq_len
    if n == 0:
        raise MacinferError(
            f"the calibration text has {len(ids)} tokens; AWQ needs at least {seq_len}: give a longer --calibration"
        )
    return mx.array(ids[: n * seq_len]).reshape(n, seq_len)


def awq_transform(model, config: dict, tokens, cfg: QuantConfig, progress: Progress | None = None) -> list[float]:
    """Activation-aware scaling and clipping of float weights, block by block (in place).

    This is mlx_lm.quant.awq.awq_quantize without its final nn.quantize: the scales
    are folded into the previous norm / linear (an exact float identity) and the
    clipped weights are kept in float, so any recipe can quantise afterwards. The
    search uses cfg.bits / cfg.group_size for every layer. A block whose output
    error (vs float, on the calibration tokens) is not lower than plain
    round-to-nearest is put back as it was, as mlx-lm does.

    Args:
        model: the float (float32) model, changed in place.
        config: its config.json (model_type picks mlx-lm's AWQ layer map).
        tokens: (N, L) calibration token ids (calibration_tokens).
        cfg: bits, group size and search resolution (n_grid).
        progress: called as progress("AWQ search", done, total, "layer i") per block.

    Returns:
        Per block, the output error after AWQ divided by the error of RTN.
    """
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS

    awq_cfg = AWQ_MODEL_CONFIGS.get(config.get("model_type"))
    if awq_cfg is None:
        raise MacinferError(
            f"--awq supports {', '.join(sorted(AWQ_MODEL_CONFIGS))}; not {config.get('model_type')}: drop --awq"
        )
    inner = model[awq_cfg.lm_key] if awq_cfg.lm_key else model
    mask = create_attention_mask(tokens)
    x = inner.model[awq_cfg.embed](tokens)  # (N, L, D)
    ratios = []
    blocks = inner.layers
    for i, block in enumerate(blocks):
        x, ratio = _transform_block(block, x, mask, awq_cfg, cfg)  # float outputs: next block's input
        ratios.append(ratio)
        if progress:
            progress("AWQ search", i + 1, len(blocks), f"layer {i}")
    return ratios


def _transform_block(block, x, mask, awq_cfg, cfg: QuantConfig):
    """Scale and clip one block in place; (its float output on x, AWQ error / RTN error)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_map
    from mlx_lm.quant.awq import clip_block, run_layer, scale_block

    bits, gs = cfg.bits, cfg.group_size

    def quantize_func(w):
        return mx.dequantize(*mx.quantize(w, group_size=gs, bits=bits), group_size=gs, bits=bits)

    orig_params = block.parameters()  # before capture adds input_feat to the linears
    orig_leaves = block.leaf_modules()
    block.update_modules(tree_map(_capture, orig_leaves, is_leaf=nn.Module.is_module))
    out = run_layer(block, x, mask=mask)
    block.update_modules(orig_leaves)
    before = _block_error(block, x, out, mask, cfg)

    scale_block(block=block, configs=awq_cfg.scale_configs, quantize_func=quantize_func,
                n_grid=cfg.n_grid, layer_kwargs={"mask": mask})
    clip_block(block=block, no_clip_keys=awq_cfg.no_clip, quantize_func=quantize_func,
               group_size=gs, n_grid=cfg.n_grid)
    for _, m in block.named_modules():
        m.pop("input_feat", None)  # else it would be saved as a weight
    after = _block_error(block, x, out, mask, cfg)
    if after >= before:
        block.update(orig_params)
        after = before
    mx.eval(block.parameters())
    return out, (after / before if before else 1.0)


def _capture(module):
    """Wrap a linear so that it records each input, which the searches replay (as mlx-lm does)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchLinear

    if not isinstance(module, (nn.Linear, SwitchLinear)):
        return module

    class Catcher(nn.Module):
        def __call__(self, x, *args, **kwargs):
            prev = module.get("input_feat")
            module.input_feat = x if prev is None else mx.concatenate([prev, x], axis=0)
            return module(x, *args, **kwargs)

    return Catcher()


def _block_error(block, x, ref, mask, cfg: QuantConfig) -> float:
    """The block's output error once quantised (RTN), measured on a copy of its leaves."""
    import mlx.nn as nn
    from mlx_lm.quant.awq import mse, run_layer

    # Quantise, measure, then put the float leaves back: the block itself stays float.
    leaves = block.leaf_modules()
    nn.quantize(block, group_size=cfg.group_size, bits=cfg.bits)
    err = (mse(ref, run_layer(block, x, mask=mask)).sum() / ref.size).item()
    block.update_modules(leaves)
    return err
