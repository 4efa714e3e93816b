"""Quantise a model to grouped affine MLX weights: `macinfer quantize SRC OUT`.

SRC is anything macinfer.loader.resolve accepts (catalog name, MLX / Hugging Face
directory, .gguf file, HF repo id); OUT is a new MLX model directory that both
macinfer and `mlx_lm.load` load unchanged.

What is mlx-lm's and what is ours:
  - mlx-lm: `quantize_model` (nn.quantize + the config's quantization section),
    the layer choice of the mixed recipe (`mixed_quant_predicate_builder`, the
    llama.cpp Q4_K_M rule), the AWQ scale and clip searches (`mlx_lm.quant.awq`),
    `save_model` / `save_config`, `dequantize_model`.
  - ours: sources that are already quantised (GGUF: dequantise, then requantise),
    embeddings kept at 8 bits in the mixed recipe (mlx-lm's recipe leaves a tied
    embedding, which is also the lm_head, at low bits), AWQ run as a float-weight
    transform so that any recipe can follow it, validation with one-line errors,
    the disk-space check, the write-to-temp-then-rename, and the report.

Bits per weight (bpw) is mlx-lm's definition: all tensor bytes (packed weights,
scales, biases, norms) x 8 / the parameter count of the unquantised model.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from macinfer.errors import MacinferError
from macinfer.modelio.texts import CALIBRATION_TEXT, encode_text
from macinfer.paths import models_dir

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
RECIPES = {
    "uniform": "every linear and embedding layer at --bits",
    "mixed": "embeddings and lm_head at 8 bits; v_proj and down_proj of the first and last "
    "eighth of the layers and every third one between at 6 bits (8 if --bits >= 5); the rest at --bits",
}
EMBED_BITS = 8
HIGH_BITS = {2: 6, 3: 6, 4: 6, 5: 8, 6: 8, 8: 8}
MODELS_DIR = models_dir()
# Files copied from SRC next to the new weights: mlx-lm's download patterns minus the weights.
SIDE_FILES = ("*.json", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt", "*.jsonl", "*.jinja")
NOT_SIDE_FILES = {"config.json", "model.safetensors.index.json"}

Progress = Callable[[str, int, int, str], None]  # (stage, done, total, item)


@dataclass(frozen=True)
class QuantConfig:
    """How to quantise. Validates on construction (one-line MacinferError)."""

    bits: int = 4
    group_size: int = 64
    recipe: str = "uniform"
    awq: bool = False
    calibration: Path | None = None  # AWQ text; None: models/calibration.txt
    calibration_tokens: int = 1024
    seq_len: int = 256
    n_grid: int = 20  # AWQ search resolution (mlx-lm's default)
    dtype: str | None = None  # scales/biases/float layers; None: keep the source's

    def __post_init__(self):
        if self.bits not in BITS:
            raise MacinferError(f"unsupported --bits {self.bits}: choose one of {', '.join(map(str, BITS))}")
        if self.group_size not in GROUP_SIZES:
            raise MacinferError(
                f"unsupported --group-size {self.group_size}: choose one of {', '.join(map(str, GROUP_SIZES))}"
            )
        if self.recipe not in RECIPES:
            raise MacinferError(f"unknown recipe '{self.recipe}': choose one of {', '.join(RECIPES)}")
        if self.dtype not in (None, "float16", "bfloat16", "float32"):
            raise MacinferError(f"unsupported dtype '{self.dtype}': float16, bfloat16 or float32")
        if self.calibration_tokens < self.seq_len or self.seq_len < 16:
            raise MacinferError("calibration needs at least one sequence of 16 tokens or more")


@dataclass
class QuantizeReport:
    """What `quantize` did; the CLI prints it as the summary."""

    source: str
    out: Path
    config: QuantConfig
    num_params: int
    size_before: int  # tensor bytes of the source as loaded (MLX form)
    size_after: int  # tensor bytes written
    bpw_before: float
    bpw_after: float
    layers_by_bits: dict[int, int]  # bits -> number of quantised layers
    requantized_from: str | None  # e.g. "4-bit g32": the source was already quantised
    seconds: float
    awq_loss_ratio: list[float] = field(default_factory=list)  # per block, AWQ / RTN output error


# ---------------------------------------------------------------------------
# Sizes and bits per weight


def weight_bytes(path: Path) -> int:
    """Bytes of tensor data in a model directory's safetensors (headers excluded)."""
    total = 0
    for f in sorted(Path(path).glob("model*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


def bits_per_weight(nbytes: int, num_params: int) -> float:
    return 8 * nbytes / num_params


def describe(quantization: dict | None) -> str:
    """'4-bit g64', '4/6/8-bit g64' (mixed) or 'float'."""
    if not quantization or "bits" not in quantization:
        return "float"
    per_layer = {v["bits"] for v in quantization.values() if isinstance(v, dict) and "bits" in v}
    bits = sorted(per_layer | {quantization["bits"]})
    return f"{'/'.join(map(str, bits))}-bit g{quantization.get('group_size', 64)}"


# ---------------------------------------------------------------------------
# Source and destination checks


def check_out(out: Path, force: bool) -> None:
    """Refuse an existing OUT (without force) or a missing parent, before any work."""
    if out.exists() and not force:
        raise MacinferError(f"{out} already exists: pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise MacinferError(f"{out} exists and is not a directory: remove it first")
    if not out.parent.is_dir():
        raise MacinferError(f"the parent directory of {out} does not exist: create it first")


def check_complete(path: Path, name: str) -> None:
    """A sharded checkpoint must have every shard its index names."""
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError):
        raise MacinferError(f"{name}: model.safetensors.index.json is unreadable; is the download complete?") from None
    missing = sorted(s for s in shards if not (path / s).exists())
    if missing:
        raise MacinferError(
            f"{name} is incomplete: {len(missing)} of {len(shards)} weight shards missing (first: {missing[0]})"
        )


def load_source(path: Path, name: str):
    """Load SRC lazily (nothing is read until quantised); returns (model, config, tokenizer)."""
    from mlx_lm.utils import load_model as mlx_load_model, load_tokenizer

    check_complete(path, name)
    try:
        model, config = mlx_load_model(path, lazy=True)
    except ValueError as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "not supported" in msg:
            raise MacinferError(f"{name}: unknown architecture ({msg})") from None
        raise MacinferError(f"{name}: could not load the weights ({msg}); is the source complete?") from None
    except (RuntimeError, OSError, KeyError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MacinferError(f"{name}: could not load the weights ({msg}); is the source complete?") from None
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # transformers raises many kinds here
        raise MacinferError(f"{name}: could not load the tokenizer ({type(e).__name__})") from None
    return model, config, tokenizer


# ---------------------------------------------------------------------------
# Recipes


def make_predicate(model, cfg: QuantConfig) -> Callable:
    """The quant_predicate for mlx_lm.utils.quantize_model that implements cfg.recipe.

    Returns a per-layer dict (bits, group size, mode) or False, so the config
    records every layer's bits explicitly.
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
    """Layers the recipe wants quantised whose input width the group size does not divide."""
    out = []
    for path, m in model.named_modules():
        if hasattr(m, "to_quantized") and hasattr(m, "weight") and predicate(path, m):
            if m.weight.shape[-1] % group_size:
                out.append((path, m.weight.shape[-1]))
    return out


# ---------------------------------------------------------------------------
# AWQ


def calibration_tokens(tokenizer, text: str, n_tokens: int, seq_len: int):
    """(N, seq_len) token ids from the start of `text`; N = n_tokens // seq_len or fewer."""
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

    Returns:
        Per block, the output error after AWQ divided by the error of RTN.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_map
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.switch_layers import SwitchLinear
    from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS, clip_block, mse, run_layer, scale_block

    awq_cfg = AWQ_MODEL_CONFIGS.get(config.get("model_type"))
    if awq_cfg is None:
        raise MacinferError(
            f"--awq supports {', '.join(sorted(AWQ_MODEL_CONFIGS))}; not {config.get('model_type')}: drop --awq"
        )
    inner = model[awq_cfg.lm_key] if awq_cfg.lm_key else model
    bits, gs = cfg.bits, cfg.group_size

    def quantize_func(w):
        return mx.dequantize(*mx.quantize(w, group_size=gs, bits=bits), group_size=gs, bits=bits)

    def capture(module):
        # Record each linear's input so the searches can replay it (as mlx-lm does).
        if not isinstance(module, (nn.Linear, SwitchLinear)):
            return module

        class Catcher(nn.Module):
            def __call__(self, x, *args, **kwargs):
                prev = module.get("input_feat")
                module.input_feat = x if prev is None else mx.concatenate([prev, x], axis=0)
                return module(x, *args, **kwargs)

        return Catcher()

    def block_error(block, x, ref):
        # Quantise a copy of the block's leaves, measure, then put the float leaves back.
        leaves = block.leaf_modules()
        nn.quantize(block, group_size=gs, bits=bits)
        err = (mse(ref, run_layer(block, x, mask=mask)).sum() / ref.size).item()
        block.update_modules(leaves)
        return err

    mask = create_attention_mask(tokens)
    x = inner.model[awq_cfg.embed](tokens)  # (N, L, D)
    ratios = []
    blocks = inner.layers
    for i, block in enumerate(blocks):
        orig_params = block.parameters()  # before capture adds input_feat to the linears
        orig_leaves = block.leaf_modules()
        block.update_modules(tree_map(capture, orig_leaves, is_leaf=nn.Module.is_module))
        out = run_layer(block, x, mask=mask)  # float outputs: next block's input
        block.update_modules(orig_leaves)
        before = block_error(block, x, out)

        scale_block(block=block, configs=awq_cfg.scale_configs, quantize_func=quantize_func,
                    n_grid=cfg.n_grid, layer_kwargs={"mask": mask})
        clip_block(block=block, no_clip_keys=awq_cfg.no_clip, quantize_func=quantize_func,
                   group_size=gs, n_grid=cfg.n_grid)
        for _, m in block.named_modules():
            m.pop("input_feat", None)  # else it would be saved as a weight
        after = block_error(block, x, out)
        if after >= before:
            block.update(orig_params)
            after = before
        ratios.append(after / before if before else 1.0)
        mx.eval(block.parameters())
        x = out
        if progress:
            progress("AWQ search", i + 1, len(blocks), f"layer {i}")
    return ratios


# ---------------------------------------------------------------------------
# The whole job


def _float_dtype(model) -> str:
    """The floating dtype holding most parameters."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    counts: dict = {}
    for _, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            counts[v.dtype] = counts.get(v.dtype, 0) + v.size
    best = max(counts, key=counts.get) if counts else mx.float32
    return str(best).replace("mlx.core.", "")


def _cast(model, dtype: str) -> None:
    import mlx.core as mx
    from mlx.utils import tree_map

    dt = getattr(mx, dtype)
    model.update(tree_map(lambda v: v.astype(dt) if mx.issubdtype(v.dtype, mx.floating) else v, model.parameters()))


def _replace_dir(tmp: Path, out: Path) -> None:
    """Rename tmp to out; an existing out is moved aside first and removed only after."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
        old.rmdir()
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def quantize(
    src: str,
    out: str | Path,
    cfg: QuantConfig = QuantConfig(),
    *,
    force: bool = False,
    progress: Progress | None = None,
    log: Callable[[str], None] | None = None,
) -> QuantizeReport:
    """Quantise SRC into a new MLX model directory OUT.

    Args:
        src: catalog name, model directory, .gguf file or Hugging Face repo id.
        out: the directory to create (written as a hidden temp dir next to it, then renamed).
        cfg: bits, group size, recipe, AWQ.
        force: replace OUT if it exists.
        progress: called as progress(stage, done, total, item) per tensor / AWQ block.
        log: called with one-line notes (e.g. "dequantising a 4-bit source").

    Returns:
        A QuantizeReport (sizes, bits per weight, layer counts).

    Example:
        >>> quantize("smollm2-135m", "smol-q4", QuantConfig(bits=4, recipe="mixed"))
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model, get_total_parameters, quantize_model, save_config, save_model

    from macinfer.modelio.loader import resolve

    t0 = time.perf_counter()
    log = log or (lambda s: None)
    out = Path(out).expanduser().absolute()
    check_out(out, force)
    calib_text = None
    if cfg.awq:
        calib = Path(cfg.calibration or CALIBRATION_TEXT)
        try:
            calib_text = calib.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise MacinferError(f"cannot read the calibration text {calib}: {type(e).__name__}") from None

    # 1. Resolve and load the source lazily.
    name, path = resolve(src)
    model, config, tokenizer = load_source(path, name)
    size_before = weight_bytes(path)
    old_q = config.get("quantization") or config.get("quantization_config")
    requantized_from = None
    if old_q and "bits" in old_q:
        requantized_from = describe(old_q)
        log(f"{name} is already quantised ({requantized_from}): dequantising, then requantising; "
            "the result cannot be better than the source")
    bytes_before = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    if requantized_from:
        model = dequantize_model(model)
    for k in ("quantization", "quantization_config"):
        config.pop(k, None)
    num_params = get_total_parameters(model)
    dtype = cfg.dtype or _float_dtype(model)

    # 2. Validate the recipe against the model before any heavy work.
    predicate = make_predicate(model, cfg)
    bad = unquantizable(model, predicate, cfg.group_size)
    if bad:
        widths = sorted({w for _, w in bad})
        raise MacinferError(
            f"--group-size {cfg.group_size} does not divide the input width ({', '.join(map(str, widths))}) "
            f"of {len(bad)} layers of {name}: use a group size that divides it"
        )

    # 3. AWQ works on float32 weights, then hands them back in the output dtype.
    ratios = []
    if cfg.awq:
        tokens = calibration_tokens(tokenizer, calib_text, cfg.calibration_tokens, cfg.seq_len)
        _cast(model, "float32")
        mx.eval(model.parameters())
        ratios = awq_transform(model, config, tokens, cfg, progress)
    _cast(model, dtype)
    config["torch_dtype"] = dtype

    # 4. Quantise (lazily: the arithmetic runs tensor by tensor below).
    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints its own bpw line
        model, config = quantize_model(model, config, cfg.group_size, cfg.bits, quant_predicate=predicate)
    params = tree_flatten(model.parameters())
    size_after = sum(v.nbytes for _, v in params)
    layers_by_bits: dict[int, int] = {}
    for _, m in model.named_modules():
        if hasattr(m, "bits"):
            layers_by_bits[m.bits] = layers_by_bits.get(m.bits, 0) + 1

    # 5. Room on disk for the weights plus the side files, checked before writing.
    side = [f for pat in SIDE_FILES for f in path.glob(pat) if f.name not in NOT_SIDE_FILES and f.is_file()]
    need = size_after + sum(f.stat().st_size for f in side) + (1 << 20)
    free = shutil.disk_usage(out.parent).free
    if free < need:
        raise MacinferError(
            f"not enough disk space in {out.parent}: need {need / 1e6:.1f} MB, {free / 1e6:.1f} MB free"
        )

    # 6. Compute every tensor (the per-tensor progress), write to a temp dir, rename.
    modules = [(p, m) for p, m in model.named_modules() if not m.children() or hasattr(m, "bits")]
    modules = [(p, m) for p, m in modules if tree_flatten(m.parameters())]
    for i, (p, m) in enumerate(modules):
        try:
            mx.eval(m.parameters())  # reads the source tensor (lazy load) and quantises it
        except (RuntimeError, OSError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise MacinferError(f"{name}: could not read {p} ({why}); is the source complete?") from None
        if progress:
            progress("quantizing", i + 1, len(modules), p)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    try:
        save_model(tmp, model)
        save_config(config, tmp / "config.json")
        for f in side:
            shutil.copy(f, tmp / f.name)
        _replace_dir(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno == errno.ENOSPC:
            raise MacinferError(f"disk full while writing {out}: nothing was written") from None
        raise MacinferError(f"could not write {out}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    written = weight_bytes(out)
    return QuantizeReport(
        source=name,
        out=out,
        config=cfg,
        num_params=num_params,
        size_before=size_before or bytes_before,
        size_after=written,
        bpw_before=bits_per_weight(bytes_before, num_params),
        bpw_after=bits_per_weight(written, num_params),
        layers_by_bits=dict(sorted(layers_by_bits.items())),
        requantized_from=requantized_from,
        seconds=time.perf_counter() - t0,
        awq_loss_ratio=ratios,
    )
