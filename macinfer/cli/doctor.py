"""`macinfer doctor`: what this machine is and how macinfer runs on it, in a form to paste into an issue.

Each check is a function `check_<name>(ctx) -> (summary, figures)` named in
`CHECKS`, run in that order. A check that cannot run on this host raises `Skip`
(its message is the reason), one that found a problem raises `CheckFailed`, and
any other exception is reported as a failure too: one line, never a traceback.
`ctx` carries what later checks reuse (the peak bandwidth, whether the kernel
passed its self-check).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import time

import click

from macinfer.timing import median_ms

RAN, SKIPPED, FAILED = "ran", "skipped", "failed"
CHECKS = ("system", "software", "metal", "bandwidth", "kernel_self_check", "kernel_timing", "decode")

# The self-check grid: every shape class (macinfer.kv.kernel_dispatch) of each head_dim x block_size,
# in all three dtypes: what an engine checks at start-up for its own model. 64 and 128 are the common
# head sizes; 80 and 96 are not multiples of the 32 lanes; 256 the largest.
GRID_HEAD_DIMS = (64, 80, 96, 128, 256)
GRID_BLOCK_SIZES = (16, 32)
GRID_KV_BITS = (None, 8)  # float pools, and 8-bit KV read by the quantised kernel
# Kernel vs SDPA timing: one decode query per sequence, the embedded model's attention shape.
TIMING_BATCHES = (1, 8, 32)
TIMING_CONTEXTS = (1024, 8192, 32768)
TIMING_MAX_TOKENS = 262144  # batch x context at most (b32 x 32k would take 0.8 GB of K/V)
TIMING_SHAPE = dict(heads=9, kv_heads=3, head_dim=64, block_size=16)
DECODE_MODEL = None  # the embedded SmolLM2-135M
DECODE_TOKENS = 100
DECODE_PROMPT = "Tell me the story of the first lighthouse keeper on a small northern island."


class Skip(Exception):
    """The check cannot run on this host; str(e) is the reason."""


class CheckFailed(Exception):
    """The check ran and found a problem; str(e) says what, `figures` what it measured."""

    def __init__(self, message: str, figures: dict | None = None):
        super().__init__(message)
        self.figures = figures or {}


def _one_line(text: str) -> str:
    return " ".join(str(text).split()) or "(no message)"


def run_check(name: str, ctx: dict) -> dict:
    """Run check_<name>: {name, status, summary | reason, figures, seconds}."""
    fn = globals()[f"check_{name}"]
    t0 = time.perf_counter()
    try:
        summary, figures = fn(ctx)
        result = {"name": name, "status": RAN, "summary": _one_line(summary), "figures": figures}
    except Skip as e:
        result = {"name": name, "status": SKIPPED, "reason": _one_line(e), "figures": {}}
    except CheckFailed as e:
        result = {"name": name, "status": FAILED, "reason": _one_line(e), "figures": e.figures}
    except Exception as e:  # a broken check must not hide the others: one line, no traceback
        result = {"name": name, "status": FAILED, "reason": _one_line(f"{type(e).__name__}: {e}"), "figures": {}}
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return result


def run_checks(quick: bool = False, on_result=None) -> list[dict]:
    """Run every check in `CHECKS` order, calling on_result(result) as each finishes."""
    ctx = {"quick": quick}
    results = []
    for name in CHECKS:
        results.append(run_check(name, ctx))
        if on_result:
            on_result(results[-1])
    return results


def text_line(result: dict) -> str:
    return f"{result['name']:<17} {result['status']:<7}  {result.get('summary') or result.get('reason')}"


# -- the checks ---------------------------------------------------------------------------------


def _memory_bytes() -> int | None:
    import subprocess

    if platform.system() == "Darwin":
        try:
            return int(subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True,
                                      timeout=2).stdout.strip())
        except (OSError, ValueError, subprocess.SubprocessError):
            return None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _os_name() -> str:
    if platform.system() == "Darwin":
        return f"macOS {platform.mac_ver()[0]}"
    return platform.platform(terse=True)


def check_system(ctx):
    from macinfer.perf import bandwidth
    from macinfer.units import fmt_bytes

    chip = bandwidth.apple_chip()
    cores = bandwidth.gpu_core_count()
    mem = _memory_bytes()
    figures = {
        "chip": chip or bandwidth.cpu_model(), "apple_silicon": chip is not None, "gpu_cores": cores,
        "memory_bytes": mem, "os": _os_name(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    summary = (f"{figures['chip']}, GPU cores {cores if cores is not None else 'n/a'}, "
               f"memory {fmt_bytes(mem) if mem else 'unknown'}, {figures['cpus']} CPUs, {figures['os']} "
               f"({figures['machine']}), Python {figures['python']}")
    return summary, figures


def _version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_software(ctx):
    import mlx.core as mx

    import macinfer
    from macinfer import _blas

    figures = {"macinfer": macinfer.__version__, "mlx": mx.__version__, "mlx-lm": _version("mlx-lm"),
               "mlx-metal": _version("mlx-metal"), "numpy": _version("numpy"), "blas": _blas.loaded or "bundled"}
    shown = [f"{k} {v}" for k, v in figures.items() if v is not None and k != "blas"]
    return ", ".join(shown) + f", BLAS {figures['blas']}", figures


def check_metal(ctx):
    import mlx.core as mx

    from macinfer.kv import metal_attention as ma

    available = bool(ma.metal_available())
    ctx["metal"] = available
    try:
        info = {k: v for k, v in mx.device_info().items() if isinstance(v, (int, float, str))}
    except Exception:  # device_info is informative only
        info = {}
    figures = {"available": available, "device": info}
    if not available:
        return "Metal available: no (MLX runs on its CPU backend; the kernel checks are skipped)", figures
    from macinfer.units import fmt_bytes

    extra = [str(info[k]) for k in ("device_name", "architecture") if k in info]
    if "max_recommended_working_set_size" in info:
        extra.append(f"recommended working set {fmt_bytes(int(info['max_recommended_working_set_size']))}")
    return "Metal available: yes" + (f" ({', '.join(extra)})" if extra else ""), figures


def check_bandwidth(ctx):
    from macinfer.perf import bandwidth

    peak = bandwidth.peak_bandwidth()
    ctx["peak"] = peak
    return f"peak {peak.describe()}", {"gbps": peak.gbps, "source": peak.source, "detail": peak.detail}


def _needs_metal(why: str):
    from macinfer.kv import metal_attention as ma

    if not ma.metal_available():
        raise Skip(f"no Metal on this host: {why}")


def check_kernel_self_check(ctx):
    """The Metal kernel against the engine's reference (gather + SDPA): every shape class over a grid, checked
    as the engine checks at start-up (KernelDispatch.prepare, with its thread-limit retry)."""
    _needs_metal("the kernel cannot run here (the engine uses the reference attention)")
    from macinfer.kv import kernel_dispatch as kd
    from macinfer.kv import metal_attention as ma
    from macinfer.kv.paged_attention import paged_attention

    ctx["kernel_ok"] = False
    kinds = [kd.layer_kind(dtype, d, bits) for d in GRID_HEAD_DIMS for bits in GRID_KV_BITS for dtype in
             ma.SUPPORTED_DTYPES if bits is None or d % 32 == 0]  # MLX's groups are 32 / 64 / 128
    classes, diffs, limited = 0, {}, {}
    for block_size in GRID_BLOCK_SIZES:
        dispatch = kd.KernelDispatch("metal", ma.paged_attention_metal, paged_attention)
        failures = dispatch.prepare(kinds, block_size)
        classes += len(dispatch.choices)
        for name, diff in dispatch.diffs.items():
            diffs[name] = max(diffs.get(name, 0.0), diff)
        limited.update({f"{k[0].split('.')[-1]} d{k[1]}{' kv8' if k[2] else ''}": 32 * n
                        for k, n in dispatch.simdgroups.items() if n < ma.MAX_SIMDGROUPS})
        figures = {"classes": classes, "cases": 3 * classes, "max_abs_diff": diffs, "thread_limited": limited}
        if failures:
            raise CheckFailed(f"{failures[0]} (block {block_size}; {len(failures)} classes fail; the engine falls back "
                              "to the reference)", figures)
    ctx["kernel_ok"], ctx["thread_limited"] = True, limited
    figures.update(head_dims=list(GRID_HEAD_DIMS), block_sizes=list(GRID_BLOCK_SIZES))
    text = ", ".join(f"{k} {v:.2g}" for k, v in diffs.items())
    threads = "; threadgroups lowered to the pipeline's limit: " + ", ".join(f"{k} {v}" for k, v in limited.items()) \
        if limited else ""
    return (f"kernel matches the reference in all {classes} shape classes ({3 * classes} cases: head_dim "
            f"{'/'.join(map(str, GRID_HEAD_DIMS))} x block {'/'.join(map(str, GRID_BLOCK_SIZES))} x 3 dtypes, float "
            f"and 8-bit KV); max |diff| {text}{threads}"), figures


def _timing_problem(batch: int, context: int, dtype, *, heads, kv_heads, head_dim, block_size):
    import mlx.core as mx
    import numpy as np

    per_seq = -(-context // block_size)
    num_blocks = 1 + batch * per_seq  # block 0 is the null block
    ids = np.random.default_rng(0).permutation(np.arange(1, num_blocks))  # shuffled: a pool after churn
    pool_shape = (kv_heads, num_blocks * block_size, head_dim)
    return dict(
        queries=mx.random.normal((batch, heads, 1, head_dim)).astype(dtype),
        k_pool=mx.random.normal(pool_shape).astype(dtype),
        v_pool=mx.random.normal(pool_shape).astype(dtype),
        block_tables=mx.array(ids.reshape(batch, per_seq).astype(np.int32)),
        context_lens=[context] * batch,
        block_size=block_size,
        scale=head_dim**-0.5,
    )


def check_kernel_timing(ctx):
    """One layer's decode attention, median ms: the kernel vs gather + SDPA (the reference)."""
    _needs_metal("no kernel to time against SDPA (scripts/bench/attention.py times the reference alone)")
    if not ctx.get("kernel_ok"):
        raise Skip("the kernel did not pass its self-check: not timed")
    import mlx.core as mx

    from macinfer.kv import metal_attention as ma
    from macinfer.kv.paged_attention import paged_attention

    repeats = 3 if ctx.get("quick") else 10
    shape = TIMING_SHAPE
    nsg = min([ma.MAX_SIMDGROUPS] + [n // 32 for n in ctx.get("thread_limited", {}).values()])
    rows, parts = [], []
    for batch in TIMING_BATCHES:
        for context in (c for c in TIMING_CONTEXTS if batch * c <= TIMING_MAX_TOKENS):
            args = _timing_problem(batch, context, mx.float16, **shape)
            mx.eval(args["queries"], args["k_pool"], args["v_pool"])
            gb = 2 * batch * context * shape["kv_heads"] * shape["head_dim"] * 2 / 1e9  # K and V, float16
            ref = median_ms(lambda: paged_attention(**args), repeats)
            ker = median_ms(lambda: ma.paged_attention_metal(**args, n_simdgroups=nsg), repeats)
            rows.append({"batch": batch, "context": context, "sdpa_ms": round(ref, 4), "kernel_ms": round(ker, 4),
                         "kernel_over_sdpa": round(ker / ref, 3), "kernel_gbps": round(gb / ker * 1e3, 1)})
            parts.append(f"b{batch} {context // 1024}k {ker:.3g}/{ref:.3g} ms ({ker / ref:.2f}x)")
            del args
    figures = {"shape": {**shape, "dtype": "float16"}, "repeats": repeats, "rows": rows}
    return "kernel/SDPA ms, one layer: " + ", ".join(parts), figures


def check_decode(ctx):
    """A 100-token greedy decode of the embedded model, with bandwidth utilisation."""
    if ctx.get("quick"):
        raise Skip(f"--quick: the {DECODE_TOKENS}-token decode of the embedded model is not run")
    from macinfer.errors import MacinferError
    from macinfer.modelio.embedded import embedded_gguf_path

    if DECODE_MODEL is None:
        try:
            embedded_gguf_path()
        except MacinferError as e:
            raise Skip(str(e)) from None
    from macinfer.core.sampling import SamplingParams
    from macinfer.llm import LLM
    from macinfer.perf import bandwidth

    llm = LLM(DECODE_MODEL, max_num_seqs=1, enable_prefix_cache=False, persist_prefix_cache=False)
    info = llm.info
    if getattr(llm.tokenizer, "chat_template", None):
        ids = llm.apply_chat_template([{"role": "user", "content": DECODE_PROMPT}])
    else:
        ids = llm.encode(DECODE_PROMPT)
    out = llm.generate([ids], SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True))[0]
    m = out.metrics
    peak = ctx.get("peak") or bandwidth.peak_bandwidth()
    per_step = bandwidth.bytes_per_step(info, m.mean_kv_tokens)
    rate = m.decode_forward_rate
    util = bandwidth.utilisation(per_step, rate, peak) if rate else None
    backend = llm.engine.attention_backend
    figures = {"model": info.name, "quantization": info.quantization, "attention": backend,
               "prompt_tokens": m.prompt_tokens, "generation_tokens": m.generation_tokens, "ttft_s": m.ttft,
               "decode_tps": m.decode_tps, "bytes_per_decode_step": int(per_step),
               "peak_bandwidth_gbps": peak.gbps, "peak_bandwidth_source": peak.source,
               "bandwidth_utilisation": util}
    from macinfer.units import fmt_bytes

    summary = (f"{info.name} ({info.quantization}), attention {backend}: {m.generation_tokens} tokens, "
               f"decode {m.decode_tps or 0:.1f} tok/s, TTFT {m.ttft or 0:.2f} s, {fmt_bytes(per_step)}/step, "
               + (f"bandwidth {100 * util:.1f}% of {peak.describe()}" if util is not None else "bandwidth n/a"))
    return summary, figures


# -- the command --------------------------------------------------------------------------------


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: {'checks': [{name, status, ...}]}.")
@click.option("--quick", is_flag=True, help=f"Skip the slow checks (the {DECODE_TOKENS}-token decode of the "
              "embedded model; fewer timing repeats).")
def doctor_cmd(as_json, quick):
    """Check this machine and print a report to paste into an issue.

    One line per check, each "ran", "skipped" (with the reason) or "failed":
    system (chip, GPU cores, memory, OS, Python), software (macinfer, MLX,
    mlx-lm versions), metal (available?), bandwidth (the peak used for
    bandwidth utilisation and where it came from), kernel_self_check (the
    fused Metal attention kernel against the reference over a grid of shapes
    and dtypes), kernel_timing (kernel vs SDPA at batch 1/8/32, context 1k/8k/32k),
    decode (100 tokens of the embedded model, with bandwidth utilisation).
    Without Metal the kernel checks are skipped. Exits 1 if a check failed.

    \b
    Examples:
      macinfer doctor                 # everything (about a minute on a CPU host)
      macinfer doctor --quick --json  # one JSON object, without the decode
    """
    if as_json:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the one JSON object only
            results = run_checks(quick)
        click.echo(json.dumps({"macinfer_doctor": 1, "quick": quick, "checks": results}, default=str))
    else:  # each line as its check finishes: the decode takes a while on a CPU host
        results = run_checks(quick, lambda r: click.echo(text_line(r)))
    if any(r["status"] == FAILED for r in results):
        sys.exit(1)
