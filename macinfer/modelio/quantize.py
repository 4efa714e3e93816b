"""Quantise a model to grouped affine MLX weights: `macinfer quantize SRC OUT`.

SRC is anything macinfer.modelio.loader.resolve accepts (catalog name, MLX / Hugging Face
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

Where the parts live: the options and the report in macinfer.modelio.quant_config,
the recipes in macinfer.modelio.recipes, AWQ in macinfer.modelio.awq, sizes and bits
per weight (mlx-lm's definition) in macinfer.modelio.sizes; this module is the job,
in the steps `quantize` numbers.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from macinfer.errors import MacinferError
from macinfer.modelio.awq import awq_transform, calibration_tokens
from macinfer.modelio.quant_config import Progress, QuantConfig, QuantizeReport
from macinfer.modelio.recipes import checked_predicate
from macinfer.modelio.sizes import bits_per_weight, describe, weight_bytes
from macinfer.modelio.texts import CALIBRATION_TEXT
from macinfer.staging import remove_stale_partials, replace_dir, staging_dir

# Files copied from SRC next to the new weights: mlx-lm's download patterns minus the weights.
SIDE_FILES = ("*.json", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt", "*.jsonl", "*.jinja")
NOT_SIDE_FILES = {"config.json", "model.safetensors.index.json"}

# ---------------------------------------------------------------------------
# Source and destination checks


def check_out(out: Path, force: bool) -> None:
    """Refuse an existing OUT (without force) or a missing parent, before any work.

    Args:
        out: the output directory (absolute).
        force: whether an existing OUT may be replaced.

    Raises:
        MacinferError: OUT exists (without force) or is a file, or its parent is missing.
    """
    if out.exists() and not force:
        raise MacinferError(f"{out} already exists: pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise MacinferError(f"{out} exists and is not a directory: remove it first")
    if not out.parent.is_dir():
        raise MacinferError(f"the parent directory of {out} does not exist: create it first")


def check_complete(path: Path, name: str) -> None:
    """A sharded checkpoint must have every shard its index names.

    Args:
        path: the model directory.
        name: the model's name, for the error.

    Raises:
        MacinferError: the index is unreadable or names a missing shard.
    """
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
    """Load SRC lazily (nothing is read until quantised).

    Args:
        path: the resolved model directory.
        name: the model's name, for errors.

    Returns:
        (model, config, tokenizer).
    """
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
# The whole job


@dataclass
class _Source:
    """SRC loaded lazily as a float model, and what the report says about it."""

    name: str
    path: Path
    model: object
    config: dict
    tokenizer: object
    size_before: int  # tensor bytes in SRC's safetensors (0 for a GGUF converted elsewhere)
    bytes_before: int  # tensor bytes as loaded, before any dequantisation
    requantized_from: str | None
    num_params: int


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
    t0 = time.perf_counter()
    out = Path(out).expanduser().absolute()
    check_out(out, force)
    remove_stale_partials(out)  # left by a killed run (the disk-space check below counts on the room)
    calib_text = _read_calibration(cfg) if cfg.awq else None
    # 1. Resolve and load the source lazily (dequantised if it was quantised).
    source = _open_source(src, log or (lambda s: None))
    model, config = source.model, source.config
    dtype = cfg.dtype or _float_dtype(model)
    # 2. Validate the recipe against the model before any heavy work.
    predicate = checked_predicate(model, cfg, source.name)
    # 3. AWQ works on float32 weights, then hands them back in the output dtype.
    ratios = _awq(source, cfg, calib_text, progress) if cfg.awq else []
    _cast(model, dtype)
    config["torch_dtype"] = dtype
    # 4. Quantise (lazily: the arithmetic runs tensor by tensor in step 6).
    model, config, size_after, layers_by_bits = _quantize_lazily(model, config, cfg, predicate)
    # 5. Room on disk for the weights plus the side files, checked before writing.
    side = _side_files(source.path)
    _check_disk_space(out, size_after + sum(f.stat().st_size for f in side) + (1 << 20))
    # 6. Compute every tensor (the per-tensor progress), write to a temp dir, rename.
    _compute(model, source.name, progress)
    _write_atomically(model, config, side, out)
    return _report(source, out, cfg, layers_by_bits, ratios, t0)


def _report(source: _Source, out: Path, cfg: QuantConfig, layers_by_bits: dict[int, int], ratios: list[float],
            t0: float) -> QuantizeReport:
    """The report of a job started at perf_counter() t0; the sizes after are those written."""
    written = weight_bytes(out)
    return QuantizeReport(
        source=source.name,
        out=out,
        config=cfg,
        num_params=source.num_params,
        size_before=source.size_before or source.bytes_before,
        size_after=written,
        bpw_before=bits_per_weight(source.bytes_before, source.num_params),
        bpw_after=bits_per_weight(written, source.num_params),
        layers_by_bits=dict(sorted(layers_by_bits.items())),
        requantized_from=source.requantized_from,
        seconds=time.perf_counter() - t0,
        awq_loss_ratio=ratios,
    )


def _read_calibration(cfg: QuantConfig) -> str:
    """The AWQ calibration text, read before anything is loaded so that a bad path fails fast."""
    calib = Path(cfg.calibration or CALIBRATION_TEXT)
    try:
        return calib.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MacinferError(f"cannot read the calibration text {calib}: {type(e).__name__}") from None


def _open_source(src: str, log: Callable[[str], None]) -> _Source:
    """Resolve and lazily load SRC; a quantised source is dequantised to float."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model, get_total_parameters

    from macinfer.modelio.loader import resolve

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
    return _Source(name, path, model, config, tokenizer, size_before, bytes_before, requantized_from,
                   get_total_parameters(model))


def _awq(source: _Source, cfg: QuantConfig, calib_text: str, progress: Progress | None) -> list[float]:
    """AWQ on the source's weights, cast to float32 for the searches; per block AWQ / RTN error."""
    import mlx.core as mx

    tokens = calibration_tokens(source.tokenizer, calib_text, cfg.calibration_tokens, cfg.seq_len)
    _cast(source.model, "float32")
    mx.eval(source.model.parameters())
    return awq_transform(source.model, source.config, tokens, cfg, progress)


def _quantize_lazily(model, config: dict, cfg: QuantConfig, predicate: Callable):
    """mlx-lm's quantize_model under the recipe; (model, config, tensor bytes, bits -> layer count)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model

    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints its own bpw line
        model, config = quantize_model(model, config, cfg.group_size, cfg.bits, quant_predicate=predicate)
    size_after = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    layers_by_bits: dict[int, int] = {}
    for _, m in model.named_modules():
        if hasattr(m, "bits"):
            layers_by_bits[m.bits] = layers_by_bits.get(m.bits, 0) + 1
    return model, config, size_after, layers_by_bits


def _side_files(path: Path) -> list[Path]:
    """The files of SRC that OUT gets a copy of (tokenizer, generation config ...)."""
    return [f for pat in SIDE_FILES for f in path.glob(pat) if f.name not in NOT_SIDE_FILES and f.is_file()]


def _check_disk_space(out: Path, need: int) -> None:
    free = shutil.disk_usage(out.parent).free
    if free < need:
        raise MacinferError(
            f"not enough disk space in {out.parent}: need {need / 1e6:.1f} MB, {free / 1e6:.1f} MB free"
        )


def _compute(model, name: str, progress: Progress | None) -> None:
    """Evaluate every module's tensors: this reads the source (lazy load) and quantises it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    modules = [(p, m) for p, m in model.named_modules() if not m.children() or hasattr(m, "bits")]
    modules = [(p, m) for p, m in modules if tree_flatten(m.parameters())]
    for i, (p, m) in enumerate(modules):
        try:
            mx.eval(m.parameters())
        except (RuntimeError, OSError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise MacinferError(f"{name}: could not read {p} ({why}); is the source complete?") from None
        if progress:
            progress("quantizing", i + 1, len(modules), p)


def _write_atomically(model, config: dict, side: list[Path], out: Path) -> None:
    """Save into a hidden staging dir next to OUT, then rename it: a failure leaves no half model
    (and an OUT being replaced stays as it was)."""
    from mlx_lm.utils import save_config, save_model

    tmp = staging_dir(out)
    try:
        save_model(tmp, model)
        save_config(config, tmp / "config.json")
        for f in side:
            shutil.copy(f, tmp / f.name)
        replace_dir(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno == errno.ENOSPC:
            raise MacinferError(f"disk full while writing {out}: nothing was written") from None
        raise MacinferError(f"could not write {out}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
