"""GGUF import: turn a GGUF file into an mlx-lm model directory.

The output is what `mlx_lm.load` expects: `config.json` (Hugging Face names, plus mlx-lm's
`quantization` section), `model.safetensors` (or shards + index) with the mlx-lm model's
weight names, a tokenizer rebuilt from the metadata, and `gguf_conversion.json`: what each
tensor became and how far its values are from gguf's own dequantisation. The steps:

1. Open the file with the `gguf` package's reader (macinfer.modelio.gguf_file): tensors stay
   memory-mapped views of the file.
2. Refuse what cannot be converted before any work, one line naming it: architecture
   (gguf_families), metadata values (gguf_metadata), tensor types (gguf_tensors), tokenizer
   (gguf_tokenizer), a tensor mlx-lm's model has no place for.
3. config.json and the tensor-name map for the family (gguf_families).
4. Each tensor to MLX arrays (gguf_tensors: kept exactly where an MLX format holds it, else
   re-quantised with the error measured), then the family's value fix-ups (q/k row order,
   Gemma's 1 + w norms).
5. Write it all in a hidden sibling of `out` and rename it into place (macinfer.staging):
   a crash leaves no half model behind.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

from macinfer.errors import MacinferError
from macinfer.modelio.gguf_families import family, hf_config, llama3_rope_scaling, tensor_names, transform
from macinfer.modelio.gguf_file import GGUFFile, open_gguf
from macinfer.modelio.gguf_metadata import check_metadata
from macinfer.modelio.gguf_tensors import GROUP_SIZE, MLXTensor, check_type, to_mlx
from macinfer.modelio.gguf_tokenizer import check_tokenizer, write_tokenizer
from macinfer.staging import remove_stale_partials, staging_dir

Progress = Callable[[int, int, str], None]
Log = Callable[[str], None]

MAX_SHARD_BYTES = 5 << 30  # mlx-lm's shard size
REPORT = "gguf_conversion.json"


def convert_gguf(src: str | Path, out: str | Path, progress: Progress | None = None, log: Log | None = None) -> Path:
    """Convert a GGUF file into an mlx-lm model directory.

    Args:
        src: the .gguf file (families: macinfer.modelio.gguf_families.FAMILIES; tensor types:
            macinfer.modelio.gguf_tensors.SUPPORTED).
        out: the directory to create; it must not exist yet (or be empty).
        progress: called as progress(done, total, what) while converting; the last call
            has done == total.
        log: called with one line per GGML type converted (kept exactly, or re-quantised
            with its largest and mean absolute weight error).

    Returns:
        `out`, a directory `mlx_lm.load` accepts.

    Raises:
        MacinferError: a missing / non-GGUF / truncated file, an unsupported architecture,
            tensor type or tokenizer, bad metadata, or `out` exists.

    Example:
        >>> convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-mlx")
        PosixPath('smollm2-mlx')
    """
    src, out = Path(src), Path(out)
    progress = progress or (lambda done, total, what: None)
    f = open_gguf(src)
    fam = family(f)
    check_metadata(src, f.metadata)
    for t in f.tensors.values():
        check_type(src, t.name, t.type_name)
    check_tokenizer(src, f.metadata)
    config = hf_config(f)
    if "rope_freqs.weight" in f.tensors and fam.model_type in ("llama", "granite"):
        config["rope_scaling"] = llama3_rope_scaling(src, f.tensors["rope_freqs.weight"].data, config)
    names = tensor_names(f, config)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MacinferError(f"{out} already exists: remove it or choose another output directory")
    n_steps = len(names) + 2
    weights, quant, report = {}, {}, []
    for i, (gguf_name, param) in enumerate(sorted(names.items())):
        progress(i, n_steps, gguf_name)
        t = to_mlx(f.tensors[gguf_name], src)
        if t.quant is not None and not param.endswith(".weight"):
            t = _dequantized(t)  # a quantised bias or scale vector: only a module's weight stays packed
        arrays = transform(fam, gguf_name, t.arrays, config)
        if t.quant is None:
            weights[param] = arrays["weight"]
        else:
            base = param.rpartition(".")[0]
            weights.update({f"{base}.{k}": v for k, v in arrays.items()})
            quant[base] = t.quant
        report.append(_report_row(gguf_name, param, t))
    if quant:
        config["quantization"] = _quantization_section(quant)
        config["quantization_config"] = config["quantization"]
    for line in summary(report):
        (log or (lambda s: None))(line)
    _write_model(out, f, config, weights, report, lambda i, what: progress(n_steps - 2 + i, n_steps, what))
    progress(n_steps, n_steps, "done")
    return out


def _dequantized(t: MLXTensor) -> MLXTensor:
    import mlx.core as mx

    q = t.quant
    w = mx.dequantize(*t.arrays.values(), group_size=q["group_size"], bits=q["bits"], mode=q["mode"])
    return MLXTensor({"weight": w.astype(mx.float32)}, t.source_type, None, t.kept_exactly, t.max_err, t.mean_err)


def _report_row(gguf_name: str, param: str, t: MLXTensor) -> dict:
    q = t.quant
    target = (f"{q['bits']}-bit {q['mode']} g{q['group_size']}" if q else
              str(t.arrays["weight"].dtype).replace("mlx.core.", ""))
    return {"tensor": gguf_name, "parameter": param, "type": t.source_type, "mlx": target,
            "exact": t.kept_exactly, "max_abs_err": t.max_err, "mean_abs_err": t.mean_err}


def summary(report: list[dict]) -> list[str]:
    """One line per (GGML type -> MLX format): kept exactly, or re-quantised with the error."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in report:
        groups[(row["type"], row["mlx"], row["exact"])].append(row)
    lines = []
    for (gtype, mlx, exact), rows in sorted(groups.items()):
        n = f"{len(rows)} tensor{'s' if len(rows) != 1 else ''}"
        if exact:
            lines.append(f"{gtype} -> {mlx}: kept exactly ({n})")
        else:
            worst = max(r["max_abs_err"] for r in rows)
            mean = sum(r["mean_abs_err"] for r in rows) / len(rows)
            lines.append(f"{gtype} -> {mlx}: re-quantised ({n}); |weight error| vs gguf's dequantisation: "
                         f"largest {worst:.3g}, mean {mean:.3g}")
    return lines


def _write_model(out: Path, f: GGUFFile, config: dict, weights: dict, report: list[dict],
                 progress: Callable[[int, str], None]) -> None:
    """Tokenizer, config and weights into a hidden sibling of `out`, renamed into place when complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)  # left by a killed conversion
    tmp = staging_dir(out)
    try:
        progress(0, "tokenizer")
        write_tokenizer(f.metadata, tmp, f.architecture)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / REPORT).write_text(json.dumps({"source": str(f.path), "architecture": f.architecture,
                                              "tensors": report}, indent=1))
        progress(1, "writing weights")
        _save_weights(weights, tmp)
        if out.exists():
            out.rmdir()  # empty (checked above); os.replace cannot replace a directory otherwise
        os.replace(tmp, out)
    except (OSError, RuntimeError) as e:  # RuntimeError: mlx failing to write (disk full ...)
        shutil.rmtree(tmp, ignore_errors=True)
        if (out / "config.json").exists():  # someone else renamed a finished model into place first
            raise MacinferError(f"{out} already exists: remove it or choose another output directory") from None
        raise MacinferError(f"could not write {out}: {getattr(e, 'strerror', None) or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _quantization_section(by_module: dict[str, dict]) -> dict:
    """mlx-lm's `quantization`: the commonest bit width as the default, every other module named."""
    counts: dict[int, int] = defaultdict(int)
    for q in by_module.values():
        if q["mode"] == "affine":
            counts[q["bits"]] += 1
    default = max(counts, key=lambda b: (counts[b], -b)) if counts else 4
    section: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default, "mode": "affine"}
    for module, q in sorted(by_module.items()):
        if q["mode"] != "affine" or q["bits"] != default:
            section[module] = dict(q)
    return section


def _save_weights(weights: dict, out: Path) -> None:
    import mlx.core as mx

    shards: list[dict] = [{}]
    size = 0
    for k, v in weights.items():
        if shards[-1] and size + v.nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    if len(shards) == 1:
        mx.save_safetensors(str(out / "model.safetensors"), shards[0], metadata={"format": "mlx"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(out / fname), shard, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
