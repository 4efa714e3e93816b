"""KV-cache arithmetic for a model: how much memory its context costs, and how many users fit.

The seed's formulas, per model config:

    per token    = 2 (K and V) x layers x kv_heads x head_dim x bytes_per_value
    per sequence = per token x context            (paged: context rounded up to whole blocks)
    per server   = per sequence x concurrency
    headroom     = memory - weights
    max concurrency = headroom // per sequence
    crossover    = weights / per token            (context where one sequence's KV outgrows the weights)

Quantised KV (mlx-lm's QuantizedKVCache) stores `bits` per value plus a float16 scale and
bias per group of `group_size` values, so bytes_per_value = bits/8 + 4/group_size.

Like the seed, it assumes every layer is full attention with the same KV-head count
(sliding-window layers would cost less) and ignores allocator overhead beyond block rounding.
Units: GB = 10^9 bytes, GiB = 2^30 (a "64GB" Mac has 64 GiB); "8k" tokens = 8192.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from macinfer import units
from macinfer.errors import MacinferError

# Well-known configs (public config.json values), so `macinfer kv llama-2-70b` needs no download.
PRESETS: dict[str, dict] = {
    "llama-2-7b": dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, hidden_size=4096,
                       intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096,
                       tie_word_embeddings=False, torch_dtype="float16"),
    "llama-2-70b": dict(num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, hidden_size=8192,
                        intermediate_size=28672, vocab_size=32000, max_position_embeddings=4096,
                        tie_word_embeddings=False, torch_dtype="float16"),
    "llama-3.1-8b": dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                         intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
                         tie_word_embeddings=False, torch_dtype="bfloat16"),
    "llama-3.1-70b": dict(num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, hidden_size=8192,
                          intermediate_size=28672, vocab_size=128256, max_position_embeddings=131072,
                          tie_word_embeddings=False, torch_dtype="bfloat16"),
    "mistral-7b": dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                       intermediate_size=14336, vocab_size=32768, max_position_embeddings=32768,
                       tie_word_embeddings=False, torch_dtype="bfloat16"),
    "qwen2.5-7b": dict(num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_size=3584,
                       intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768,
                       tie_word_embeddings=False, torch_dtype="bfloat16"),
}

_DTYPE_BITS = {"float32": 32, "float16": 16, "bfloat16": 16, "float64": 64}


# -- parsing ------------------------------------------------------------------------------
def parse_tokens(text: str | int) -> int:
    """'8k' -> 8192, '128K' -> 131072, '1m' -> 1048576, '100000' -> 100000."""
    if isinstance(text, int):
        n = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([km]?)\s*", str(text), re.I)
        if not m:
            raise MacinferError(f"cannot read '{text}' as a token count: write e.g. 8k, 128k or 100000")
        n = int(float(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[m.group(2).lower()])
    if n < 1:
        raise MacinferError(f"a context length must be at least 1 token, got {text}")
    return n


def fmt_bytes(n: float) -> str:
    """Decimal units, 3 significant figures: 327680 -> '328 KB', 3.2768e10 -> '32.8 GB'."""
    return units.fmt_bytes(n, digits=3)


def machine_memory() -> int:
    """This machine's physical memory in bytes."""
    if sys.platform == "darwin":
        try:
            return int(subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True).stdout)
        except (OSError, ValueError):
            pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        raise MacinferError("cannot read this machine's memory size: pass --memory, e.g. --memory 64GB") from None


# -- the model's shape ---------------------------------------------------------------------
@dataclass
class KVModel:
    """The figures of a model that the arithmetic needs."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    weight_bytes: int
    context_length: int
    native_kv_bits: int  # activation dtype: the KV cache's dtype when not quantised
    weights_source: str  # "files" (measured) or "estimated from config"
    notes: list[str] = field(default_factory=list)


def estimate_params(cfg: dict) -> int:
    """Parameter count of a decoder-only transformer from its config (Llama-style MLP)."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads = cfg.get("num_attention_heads", 1)
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    inter = cfg.get("intermediate_size", 4 * h)
    vocab = cfg.get("vocab_size", 32000)
    attn = h * heads * hd * 2 + h * kv * hd * 2  # q, o + k, v
    per_layer = attn + 3 * h * inter + 2 * h
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return layers * per_layer + embed + h


def _weight_bits(cfg: dict) -> float:
    q = cfg.get("quantization") or cfg.get("quantization_config")
    if q and "bits" in q:
        return q["bits"] + 32 / q.get("group_size", 64)  # float16 scale + bias per group
    return _DTYPE_BITS.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16"), 16)


def from_config(name: str, config: dict, weight_bytes: int | None = None) -> KVModel:
    """Build a KVModel from a Hugging Face / mlx-lm config.json dict.

    Args:
        weight_bytes: measured size of the weights; None estimates it from the config.
    """
    cfg = config.get("text_config", config)
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg.get("num_attention_heads") or 1)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    except (KeyError, TypeError, ValueError) as e:
        raise MacinferError(f"{name}: config has no {e} to size the KV cache from") from None
    notes = []
    source = "files"
    if weight_bytes is None:
        weight_bytes = int(estimate_params(cfg) * _weight_bits({**config, **cfg}) / 8)
        source = "estimated from config"
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True) and cfg.get("layer_types"):
        notes.append("has sliding-window layers: counted as full attention (an upper bound)")
    dtype = str(cfg.get("torch_dtype") or config.get("torch_dtype") or "float16")
    return KVModel(
        name=name, num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, weight_bytes=weight_bytes,
        context_length=int(cfg.get("max_position_embeddings") or 4096),
        native_kv_bits=_DTYPE_BITS.get(dtype, 16), weights_source=source, notes=notes,
    )


def from_directory(name: str, path: Path) -> KVModel:
    config = json.loads((path / "config.json").read_text())
    files = list(path.glob("*.safetensors"))
    return from_config(name, config, sum(f.stat().st_size for f in files) if files else None)


def resolve_kv_model(spec: str | None) -> KVModel:
    """MODEL as `macinfer kv` takes it: a preset, a config.json, a model dir, or anything `run` takes."""
    key = (spec or "").lower()
    if key in PRESETS:
        return from_config(key, PRESETS[key])
    if spec:
        p = Path(spec).expanduser()
        if p.is_file() and p.name.endswith(".json"):
            return from_config(p.parent.name or p.stem, json.loads(p.read_text()))
        if p.is_dir() and (p / "config.json").exists():
            return from_directory(p.name, p)
    from macinfer.modelio.loader import resolve

    try:
        name, path = resolve(spec)
    except MacinferError as e:
        raise MacinferError(f"{e} (or a preset: {', '.join(PRESETS)})") from None
    return from_directory(name, path)


# -- the arithmetic ------------------------------------------------------------------------
def bytes_per_value(kv_bits: int, group_size: int = 64) -> float:
    """Bytes one cached K or V element costs: quantised widths pay a float16 scale and bias per group."""
    if kv_bits >= 16:
        return kv_bits / 8
    return kv_bits / 8 + 4 / group_size


def kv_bytes_per_token(m: KVModel, kv_bits: int | None = None, group_size: int = 64) -> float:
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * bytes_per_value(kv_bits or m.native_kv_bits, group_size)


def round_to_blocks(tokens: int, block_size: int) -> int:
    """Tokens a paged cache reserves for `tokens`: whole blocks (block_size 0 = contiguous, exact)."""
    return math.ceil(tokens / block_size) * block_size if block_size else tokens


def plan(
    m: KVModel,
    memory: int,
    contexts: list[int],
    concurrency: int = 1,
    kv_bits: int | None = None,
    group_size: int = 64,
    block_size: int = 16,
) -> dict:
    """Every figure `macinfer kv` prints, as a dict (also its --json).

    Example (Llama-2-70B-like: 80 layers, 8 KV heads, head_dim 128, float16):
        per_token_bytes = 2 * 80 * 8 * 128 * 2 = 327,680; at 100,000 tokens 32.8 GB.
    """
    kv_bits = kv_bits or m.native_kv_bits
    if kv_bits not in (4, 8, 16, 32):
        raise MacinferError(f"--kv-bits must be 4, 8, 16 or 32, got {kv_bits}")
    if concurrency < 1:
        raise MacinferError(f"--concurrency must be at least 1, got {concurrency}")
    per_token = kv_bytes_per_token(m, kv_bits, group_size)
    headroom = memory - m.weight_bytes
    rows = []
    for ctx in contexts:
        reserved = round_to_blocks(ctx, block_size)
        per_seq = per_token * reserved
        rows.append({
            "context": ctx,
            "reserved_tokens": reserved,
            "per_sequence_bytes": per_seq,
            "block_waste_bytes": per_token * (reserved - ctx),
            "per_server_bytes": per_seq * concurrency,
            "kv_over_weights": per_seq / m.weight_bytes if m.weight_bytes else None,
            "max_concurrency": max(0, int(headroom // per_seq)) if per_seq else None,
            "fits": headroom >= per_seq * concurrency,
            "beyond_model_context": ctx > m.context_length,
        })
    return {
        "model": asdict(m),
        "memory_bytes": memory,
        "kv_bits": kv_bits,
        "kv_group_size": group_size if kv_bits < 16 else None,
        "block_size": block_size,
        "concurrency": concurrency,
        "bytes_per_value": bytes_per_value(kv_bits, group_size),
        "per_token_bytes": per_token,
        "headroom_bytes": headroom,
        # One sequence's KV equals the weights at this many tokens; C sequences at 1/C of it.
        "crossover_context": math.ceil(m.weight_bytes / per_token) if per_token else None,
        "crossover_context_at_concurrency": math.ceil(m.weight_bytes / (per_token * concurrency)) if per_token else None,
        "contexts": rows,
    }


def render(report: dict, console=None) -> None:
    """Print a plan as a rich table with the summary lines above it."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    m = report["model"]
    kv = f"{report['kv_bits']}-bit" + (f" g{report['kv_group_size']}" if report["kv_group_size"] else "")
    paging = f"blocks of {report['block_size']}" if report["block_size"] else "contiguous"
    console.print(
        f"[bold]{m['name']}[/]: {m['num_layers']} layers x {m['num_kv_heads']} KV heads x head_dim {m['head_dim']}, "
        f"weights {fmt_bytes(m['weight_bytes'])} ({m['weights_source']}), context {m['context_length']:,}"
    )
    console.print(
        f"KV {kv} ({report['bytes_per_value']:g} B/value), {paging}: "
        f"[bold]{report['per_token_bytes']:,.0f} bytes/token[/] ({fmt_bytes(report['per_token_bytes'])})"
    )
    head = report["headroom_bytes"]
    console.print(
        f"memory {fmt_bytes(report['memory_bytes'])} - weights {fmt_bytes(m['weight_bytes'])} = headroom "
        + (f"[bold]{fmt_bytes(head)}[/]" if head > 0 else "[bold red]none: the weights alone do not fit[/]")
    )
    console.print(
        f"KV outgrows the weights at {report['crossover_context']:,} tokens for one sequence, "
        f"{report['crossover_context_at_concurrency']:,} tokens each at concurrency {report['concurrency']}"
    )
    t = Table()
    t.add_column("context", justify="right")
    t.add_column("per sequence", justify="right")
    t.add_column("x weights", justify="right")
    t.add_column(f"server @ {report['concurrency']}", justify="right")
    t.add_column("max concurrency", justify="right")
    for r in report["contexts"]:
        ctx = f"{r['context']:,}" + (" *" if r["beyond_model_context"] else "")
        ratio = "" if r["kv_over_weights"] is None else f"{r['kv_over_weights']:.2f}"
        server = fmt_bytes(r["per_server_bytes"]) + ("" if r["fits"] else " [red](no fit)[/]")
        t.add_row(ctx, fmt_bytes(r["per_sequence_bytes"]), ratio, server, f"{r['max_concurrency']:,}")
    console.print(t)
    if any(r["beyond_model_context"] for r in report["contexts"]):
        console.print(f"* beyond the model's context length ({m['context_length']:,})")
    for note in m["notes"]:
        console.print(f"note: {note}")
    if report["kv_bits"] == 16 and sys.platform != "darwin":
        console.print("note: without Metal, macinfer keeps KV in float32 on this host: --kv-bits 32 for its figures")
