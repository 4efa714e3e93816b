"""A model directory read without loading it: its config, weight files, parameter count, size, quantisation."""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
import re
import struct
import time
from pathlib import Path

from macinfer.errors import MacinferError

# What mlx-lm loads as weights (mlx_lm.utils's glob; kept in step with it).
WEIGHTS_GLOB = "model*.safetensors"



@functools.lru_cache(maxsize=1)
def _mlx_lm_architectures() -> tuple[frozenset, dict]:
    """mlx-lm's model modules and MODEL_REMAPPING, read from its files.

    NOTE: importing mlx_lm (its __init__ pulls in transformers) takes seconds; `ls` must not.
    """
    spec = importlib.util.find_spec("mlx_lm")  # a top-level name: its __init__ does not run
    if spec is None or not spec.submodule_search_locations:
        return frozenset(), {}
    root = Path(list(spec.submodule_search_locations)[0])
    helpers = {"base", "cache", "rope_utils", "switch_layers", "activations", "pipeline", "bitlinear_layers"}
    names = frozenset(p.stem for p in (root / "models").glob("*.py") if not p.stem.startswith("_") and p.stem not in helpers)
    remap = {}
    try:
        for node in ast.parse((root / "utils.py").read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODEL_REMAPPING" for t in node.targets):
                remap = ast.literal_eval(node.value)
    except (OSError, SyntaxError, ValueError):
        pass
    return names, remap if isinstance(remap, dict) else {}


def mlx_lm_knows(model_type) -> bool:
    """Whether mlx-lm has a module for this model_type (as mlx_lm.utils._get_classes finds it)."""
    if not isinstance(model_type, str) or not re.fullmatch(r"[\w-]+", model_type):
        return False
    names, remap = _mlx_lm_architectures()
    return remap.get(model_type, model_type) in names


def read_config(path: Path) -> dict | None:
    """config.json as a dict, or None when it is missing or not a JSON object (listings)."""
    try:
        return _parse_config(path, str(path))
    except MacinferError:
        return None


def check_config(path: Path, name: str | None = None) -> dict:
    """config.json as a dict, with what is wrong with it in one line (before mlx-lm loads the model).

    Args:
        path: the model directory.
        name: the model's name in the error (default: the path).

    Raises:
        MacinferError: config.json is unreadable, not JSON, not an object, or has no model_type.
    """
    name = name or str(path)
    config = _parse_config(path, name)
    if not isinstance(config.get("model_type"), str):
        raise MacinferError(f"{name}: config.json has no model_type: it is not a model's config")
    return config


def _parse_config(path: Path, name: str) -> dict:
    try:
        text = (Path(path) / "config.json").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MacinferError(f"{name}: cannot read config.json ({getattr(e, 'strerror', None) or e})") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise MacinferError(f"{name}: config.json is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}): "
                            "fix it or download the model again") from None
    if not isinstance(config, dict):
        raise MacinferError(f"{name}: config.json holds a JSON {type(config).__name__}, not an object")
    return config


def weight_files(path: Path) -> list[Path]:
    return sorted(Path(path).glob(WEIGHTS_GLOB))


def safetensors_header(path: Path) -> dict:
    """name -> {"dtype", "shape"} from a safetensors file's JSON header (no tensor data read)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("truncated")
        (n,) = struct.unpack("<Q", head)
        if n > 100_000_000:
            raise ValueError("implausible header size")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def count_params(files: list[Path], config: dict) -> int | None:
    """Parameters from tensor shapes: a quantised weight counts numel(scales) x its group size."""
    shapes: dict[str, list[int]] = {}
    try:
        for f in files:
            shapes.update({k: v["shape"] for k, v in safetensors_header(f).items()})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not shapes:
        return None
    q = config.get("quantization") or config.get("quantization_config") or {}
    q = q if isinstance(q, dict) else {}

    def numel(shape):
        n = 1
        for d in shape:
            n *= int(d)
        return n

    total = 0
    for name, shape in shapes.items():
        for suffix in (".scales", ".biases"):
            if name.endswith(suffix) and name[: -len(suffix)] + ".weight" in shapes:
                break
        else:
            base = name[: -len(".weight")] if name.endswith(".weight") else None
            if base is not None and base + ".scales" in shapes:
                per = q.get(base) if isinstance(q.get(base), dict) else {}
                group = per.get("group_size") or q.get("group_size") or 64
                total += numel(shapes[base + ".scales"]) * int(group)
            else:
                total += numel(shape)
    return total


def describe_quant(config: dict) -> str:
    """'4-bit g64', '4-bit g32 mxfp4', '8-bit g64 (mixed: 6-bit layers)' or the float dtype."""
    q = config.get("quantization") or config.get("quantization_config")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    if not isinstance(q, dict) or "bits" not in q:
        if isinstance(q, dict) and q.get("quant_method"):
            return str(q["quant_method"])
        return str(config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or text.get("dtype") or "float")
    s = f"{q['bits']}-bit g{q.get('group_size', 64)}"
    if q.get("mode") and q["mode"] != "affine":
        s += f" {q['mode']}"
    others = sorted({v["bits"] for v in q.values() if isinstance(v, dict) and "bits" in v} - {q["bits"]})
    if others:
        s += " (mixed: " + ", ".join(f"{b}-bit" for b in others) + " layers)"
    return s


def text_config(config: dict) -> dict:
    t = config.get("text_config")
    return {**config, **t} if isinstance(t, dict) else config


def has_chat_template(path: Path) -> bool:
    path = Path(path)
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def dir_size(path: Path) -> int:
    """Bytes of the regular files under path (symlinks not followed)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except OSError:
                continue
            if not os.path.islink(os.path.join(root, f)):
                total += st.st_size
    return total


def last_access(files) -> float | None:
    times = []
    for f in files:
        try:
            times.append(os.stat(f).st_atime)
        except OSError:
            pass
    return max(times) if times else None


def fmt_params(n: int | None) -> str:
    if not n:
        return "?"
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def fmt_ago(t: float | None, now: float | None = None) -> str:
    if t is None:
        return "-"
    s = max(0.0, (now or time.time()) - t)
    for unit, sec in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= sec:
            return f"{int(s // sec)} {unit} ago"
    return "just now"




def dir_size_followed(path: Path) -> int:
    """Bytes of a snapshot directory, following its symlinks into the blobs."""
    total = 0
    for f in Path(path).rglob("*"):
        try:
            if f.is_file():
                total += f.stat().st_size
        except OSError:
            pass
    return total
