"""Turn what the user typed as MODEL into a loaded mlx-lm model.

MODEL may be (checked in this order):
  1. None / ""          -> the embedded default (SmolLM2-135M-Instruct GGUF)
  2. a catalog name     -> models/catalog.json (embedded or a Hugging Face repo id)
  3. a store name       -> a GGUF another tool keeps: ollama:qwen3:4b, lmstudio:<pub>/<repo>/<file>,
                           hf:<owner>/<repo>/<file> (macinfer.modelio.gguf_stores)
  4. an existing path   -> an mlx-lm / Hugging Face safetensors directory, or a .gguf file
  5. "owner/name"       -> a Hugging Face repo id, fetched with huggingface-hub
GGUF files are converted once to an MLX directory (macinfer.modelio.gguf) and cached; what
each tensor type became (kept exactly, or re-quantised and by how much) is printed then.

Loading itself is mlx-lm's (`load_model`, `load_tokenizer`), so every architecture
mlx-lm knows loads here. On hosts without Metal, float16/bfloat16 parameters
(quantisation scales included) are cast to float32: the CPU backend emulates
half precision and is ~40x slower with it (docs/platform.md); their float linear layers compute
2-4 rows (a verify step, a small batch) in the form that is faster there
(macinfer.modelio.cpu_linear).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from macinfer.errors import MacinferError
from macinfer.modelio.gguf_stores import find_stored, hf_hub_cache
from macinfer.modelio.model_files import check_config
from macinfer.paths import cache_dir, models_dir

CATALOG = models_dir() / "catalog.json"
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class ModelInfo:
    """What the engine, metrics and UI need to know about a loaded model."""

    name: str
    path: Path
    config: dict
    model_type: str
    weight_bytes: int  # all parameters as held in memory, scales included
    bytes_per_decode_step: int  # weights read per decode token (embedding: one row)
    num_params: int
    quantization: str  # e.g. "4-bit g32 (embed 8-bit)" or "float32"
    context_length: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    extra: dict = field(default_factory=dict)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, all layers, in the activation dtype."""
        item = 2 if self.dtype in ("float16", "bfloat16") else 4
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * item

    def check_context(self, n_tokens: int, max_new: int = 0) -> None:
        if n_tokens >= self.context_length:
            raise MacinferError(
                f"the prompt is {n_tokens} tokens but {self.name} holds at most "
                f"{self.context_length}: shorten it"
            )


def read_catalog() -> dict:
    try:
        return json.loads(CATALOG.read_text())
    except (OSError, json.JSONDecodeError):
        return {"default": "smollm2-135m", "models": {"smollm2-135m": {"source": "embedded"}}}


def _progress_printer(label: str):
    """A rich progress bar on stderr for long work (conversion)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    prog = Progress(TextColumn(label), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeRemainingColumn(), transient=True)
    state = {"task": None}

    def update(done: int, total: int, what: str = ""):
        if state["task"] is None:
            prog.start()
            state["task"] = prog.add_task(label, total=total)
        prog.update(state["task"], completed=done, total=total)
        if done >= total:
            prog.stop()

    return update


def _from_gguf(path: Path, progress, name: str | None = None, digest: str | None = None) -> Path:
    import sys

    from macinfer.modelio.embedded import ensure_converted

    def log(line: str) -> None:
        print(f"{path.name}: {line}", file=sys.stderr)

    return ensure_converted(path, progress=progress, name=name, digest=digest, log=log)


def _from_hub(repo: str) -> Path:
    """Fetch a Hugging Face repo into the standard HF cache (with progress bars): the one `ls`, `pull`
    and `rm` read, where the environment says now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    where = {"allow_patterns": DEFAULT_ALLOW_PATTERNS, "cache_dir": str(hf_hub_cache())}
    try:
        return Path(snapshot_download(repo, local_files_only=True, **where))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo, **where))
    except Exception as e:  # network, 404, auth: all end the same way for the user
        kind = type(e).__name__
        if "RepositoryNotFound" in kind or "404" in str(e):
            raise MacinferError(f"no model '{repo}' on Hugging Face (and no local path by that name)") from None
        raise MacinferError(
            f"could not download '{repo}' from Hugging Face ({kind}; offline?): "
            "download it on a connected machine and pass its local directory instead"
        ) from None


def resolve(spec: str | None, progress=None) -> tuple[str, Path]:
    """Resolve MODEL to (display name, local directory in mlx-lm layout)."""
    catalog = read_catalog()
    spec = spec or catalog.get("default", "smollm2-135m")
    entry = catalog.get("models", {}).get(spec)
    if entry is not None:
        if entry["source"] == "embedded":
            from macinfer.modelio.embedded import embedded_gguf_path

            return spec, _from_gguf(embedded_gguf_path(), progress or _progress_printer("converting embedded model"))
        return spec, _from_hub(entry["source"])
    stored = find_stored(spec)
    if stored is not None:  # read in place: never copied, moved or changed
        return spec, _from_gguf(stored.path, progress or _progress_printer(f"converting {spec}"), spec, stored.digest)
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix.lower() == ".gguf":
                return path.stem, _from_gguf(path, progress or _progress_printer(f"converting {path.name}"))
            raise MacinferError(f"{spec} is a file but not a .gguf: pass a model directory or a .gguf file")
        if not (path / "config.json").exists():
            raise MacinferError(f"{spec} has no config.json: is it a model directory?")
        if not any(path.glob("*.safetensors")):
            raise MacinferError(f"{spec} has no *.safetensors weights: convert it first (macinfer quantize)")
        return path.name, path
    for home in (cache_dir() / "models" / spec, cache_dir() / spec):  # names `macinfer ls` lists
        if "/" not in spec and not spec.startswith((".", "~")) and (home / "config.json").is_file():
            return spec, home
    if REPO_ID.match(spec) and not spec.startswith((".", "/", "~")):
        return spec, _from_hub(spec)
    names = ", ".join(catalog.get("models", {}))
    raise MacinferError(f"no such model '{spec}': not a path, a catalog name ({names}) or a Hugging Face repo id")


def cast_for_cpu(model) -> None:
    """Cast half-precision parameters to float32 where there is no Metal (MLX's CPU backend has no
    fast half-precision matmul); on Metal, nothing."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    if mx.metal.is_available():
        return
    half = (mx.float16, mx.bfloat16)
    params = tree_flatten(model.parameters())
    cast = [(k, v.astype(mx.float32)) for k, v in params if v.dtype in half]
    if cast:
        model.update(tree_unflatten(cast))


def fit_for_cpu(model) -> None:
    """A float model (or draft) as it runs fastest without Metal: half precision cast to float32
    (`cast_for_cpu`), the float linear layers CpuLinear (macinfer.modelio.cpu_linear); on Metal, nothing."""
    from macinfer.modelio.cpu_linear import use_cpu_linears  # here, as mlx: importing the loader loads no mlx

    cast_for_cpu(model)
    use_cpu_linears(model)


def _describe_quant(config: dict) -> str:
    q = config.get("quantization") or config.get("quantization_config")
    if not q or "bits" not in q:
        return config.get("torch_dtype") or config.get("dtype") or "float"
    s = f"{q['bits']}-bit g{q.get('group_size', 64)}"
    others = sorted({v["bits"] for v in q.values() if isinstance(v, dict) and "bits" in v} - {q["bits"]})
    if others:
        s += " (mixed: " + ", ".join(f"{b}-bit" for b in others) + " layers)"
    return s


def model_info(name: str, path: Path, model, config: dict) -> ModelInfo:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters())
    total = sum(v.nbytes for _, v in params)
    embed = sum(v.nbytes for k, v in params if "embed_tokens" in k)
    tied = config.get("tie_word_embeddings", True) and not any("lm_head" in k for k, _ in params)
    vocab = config.get("vocab_size") or 1
    # An untied embedding table is read one row per token; a tied one is the lm_head too.
    per_step = total if tied else total - embed + embed // vocab
    text_cfg = config.get("text_config", config)
    heads = text_cfg.get("num_attention_heads", 1)
    hidden = text_cfg.get("hidden_size", 0)
    layers = getattr(model, "layers", None)
    dtype = next((v.dtype for k, v in params if "norm" in k), mx.float32)
    from mlx_lm.utils import get_total_parameters

    return ModelInfo(
        name=name,
        path=path,
        config=config,
        model_type=config.get("model_type", "?"),
        weight_bytes=total,
        bytes_per_decode_step=per_step,
        num_params=get_total_parameters(model),
        quantization=_describe_quant(config),
        context_length=int(text_cfg.get("max_position_embeddings") or 4096),
        num_layers=len(layers) if layers is not None else text_cfg.get("num_hidden_layers", 0),
        num_kv_heads=text_cfg.get("num_key_value_heads") or heads,
        head_dim=text_cfg.get("head_dim") or (hidden // heads if heads else 0),
        dtype=str(dtype).replace("mlx.core.", ""),
    )


# Where there is no Metal, a quantised model is loaded as float only while float32 weights
# stay this small and under a quarter of the machine's memory.
DEQUANTIZE_MAX_BYTES = 8 << 30


def dequantize_by_default(num_params: int, quantized: bool) -> bool:
    """Whether to load quantised weights as float when the caller does not say.

    On MLX's CPU backend quantised matmul is compute-bound and float32 with OpenBLAS is the
    fast configuration (docs/platform.md, "MLX's CPU backend"); on Metal quantised weights
    are faster (less to read). A model whose float32 weights would not fit comfortably stays
    quantised.
    """
    import mlx.core as mx

    if not quantized or mx.metal.is_available():
        return False
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    return 4 * num_params <= min(DEQUANTIZE_MAX_BYTES, memory // 4 if memory else DEQUANTIZE_MAX_BYTES)


def shard_model(model, config: dict, name: str, group, parallel: str) -> str:
    """Split a (lazily loaded) model over group's ranks with mlx-lm's own `shard()` / `model.pipeline()`.

    Args:
        parallel: "tensor", "pipeline", or "auto" (tensor where mlx-lm can, else pipeline).

    Returns:
        The split used: "tensor" or "pipeline".

    Raises:
        MacinferError: the architecture has no such split in mlx-lm, or its heads (tensor) or
            layers (pipeline) do not divide over the ranks.
    """
    n, model_type = group.size(), config.get("model_type", "?")
    text = config.get("text_config", config)
    can_tensor = hasattr(model, "shard")
    can_pipeline = hasattr(getattr(model, "model", None), "pipeline")
    if parallel == "auto":
        parallel = "pipeline" if can_pipeline and not can_tensor else "tensor"
    other = {"tensor": ("pipeline", can_pipeline), "pipeline": ("tensor", can_tensor)}[parallel]
    hint = f": try --parallel {other[0]}" if other[1] else ": run it in one process"
    if parallel == "tensor":
        if not can_tensor:
            raise MacinferError(f"{name}: mlx-lm cannot split {model_type} by tensor parallelism{hint}")
        for key, what in (("num_attention_heads", "attention heads"), ("num_key_value_heads", "KV heads")):
            heads = text.get(key)
            if heads and heads % n:
                raise MacinferError(f"{name}: its {heads} {what} do not split evenly over {n} ranks: "
                                    f"use a number of ranks that divides {heads}")
        model.shard(group)
    else:
        if not can_pipeline:
            raise MacinferError(f"{name}: mlx-lm cannot pipeline {model_type}{hint}")
        if len(model.model.layers) < n:
            raise MacinferError(f"{name}: {len(model.model.layers)} layers cannot be split over {n} ranks: "
                                f"use at most {len(model.model.layers)}")
        model.model.pipeline(group)
    return parallel


def load_model(spec: str | None = None, *, dequantize: bool | None = None, progress=None,
               group=None, parallel: str = "tensor"):
    """Load MODEL (see module docstring).

    Args:
        spec: catalog name, path, .gguf file or HF repo id; None for the default.
        dequantize: turn quantised weights into float; None decides by host
            (`dequantize_by_default`: yes without Metal, where it is the fast configuration).
        group: an mx.distributed group to split the model over (`shard_model`); None: whole.
        parallel: with a group, "tensor", "pipeline" or "auto" (`shard_model`); the one used
            is `info.extra["parallel"]`.

    Returns:
        (model, tokenizer, ModelInfo); the tokenizer is mlx-lm's TokenizerWrapper.
    """
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model, get_total_parameters, load_model as mlx_load_model, load_tokenizer

    from macinfer.modelio.cpu_linear import use_cpu_linears  # here, as mlx: importing the loader loads no mlx

    name, path = resolve(spec, progress)
    model_type = check_config(path, name)["model_type"]
    try:
        # Split across ranks: loaded lazily, so each rank reads only its own part (mlx-lm's sharded_load).
        model, config = mlx_load_model(path, lazy=group is not None)
    except (TypeError, ZeroDivisionError, AttributeError) as e:  # the model's ModelArgs / __init__ on bad values
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MacinferError(f"{name}: config.json does not describe a valid {model_type} model ({msg})") from None
    except ValueError as e:
        # One line: mlx's "Missing 9 parameters: \n<name>,\n..." names them on the lines after.
        msg = " ".join(str(e).split()) or type(e).__name__
        msg = msg if len(msg) <= 160 else msg[:157] + "..."
        if "not supported" in msg:
            raise MacinferError(f"{name}: unknown architecture ({msg})") from None
        raise MacinferError(f"{name}: could not load the weights ({msg})") from None
    except (RuntimeError, OSError, FileNotFoundError, KeyError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MacinferError(f"{name}: could not load the weights ({msg}); is the file complete?") from None
    quantized = _describe_quant(config) if (config.get("quantization") or config.get("quantization_config")) else None
    by_host = dequantize is None
    if by_host:
        dequantize = dequantize_by_default(get_total_parameters(model), quantized is not None)
    # NOTE: before dequantising: float16 scales times 8-bit codes need more than float16's
    # 11 bits, so dequantising first would round the weights (GGUF's Q8_0, Q4_1 ...).
    cast_for_cpu(model)
    if dequantize and quantized:
        model = dequantize_model(model)
        config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    if group is not None:
        parallel = shard_model(model, config, name, group, parallel)
    use_cpu_linears(model)  # after dequantising and sharding: float nn.Linear layers only
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # transformers raises many kinds here
        raise MacinferError(f"{name}: could not load the tokenizer ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    mx.eval(model.parameters())
    info = model_info(name, path, model, config)
    if group is not None:
        info.extra["parallel"] = parallel
    if dequantize and quantized:
        info.extra["dequantized_from"] = quantized + (" (no Metal: float32 is the fast configuration here)"
                                                      if by_host else "")
    return model, tokenizer, info
