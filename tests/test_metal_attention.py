"""The Metal paged-attention kernel's algorithm, its source, and backend selection, on the CPU.

Nothing here runs on Metal. Three oracles instead:
- a tiny gather + SDPA (below): the NumPy algorithm reference must match it;
- the NumPy algorithm reference: METAL_SOURCE, compiled as C++ against a shim of
  the Metal built-ins and run by a small SIMT emulator (32-lane simdgroups as
  fibers, simd_sum and threadgroup_barrier as sync points), must match it;
- monkeypatched kernels for the selection logic (compile failure, run failure,
  mismatch, and a correct kernel).
"""

import contextlib
import ctypes
import math
import os
import re
import shutil
import subprocess
import sys
import warnings

import mlx.core as mx
import numpy as np
import pytest

from macinfer.kv import kernel_dispatch as kd
from macinfer.kv import metal_attention as ma
from macinfer.kv.paged_attention import QuantPool, paged_attention
from macinfer.errors import MacinferError


def gather_sdpa(queries, k_pool, v_pool, block_tables, context_lens, *, block_size, scale, window=None, sinks=None,
                softcap=None, chunk=None):
    """Oracle: gather each row's slots (head-major pools) to contiguous K/V (quantised pools: then
    dequantised, with MLX's own mx.dequantize), then MLX's SDPA (soft-capped scores: by hand,
    tests/test_attention_variants.py checks that one)."""
    B, H, QL, D = queries.shape
    BS = block_size
    out = []
    for b, C in enumerate(int(c) for c in context_lens):
        slots = mx.array([int(block_tables[b, pos // BS]) * BS + pos % BS for pos in range(C)])
        k, v = (p[:, slots][None] if isinstance(p, mx.array) else mx.dequantize(
            *(x[:, slots][None] for x in p[:3]), group_size=p.group_size, bits=p.bits) for p in (k_pool, v_pool))
        pos = mx.arange(C - QL, C)[:, None]
        key = mx.arange(C)[None]
        mask = key <= pos
        if window:
            mask = mask & (key > pos - window)
        if chunk:  # llama4: its own chunk only
            mask = mask & (key >= pos // chunk * chunk)
        if softcap is not None:
            from macinfer.kv.paged_attention import softcapped_attention

            out.append(softcapped_attention(queries[b: b + 1], k, v, scale=scale, mask=mask, softcap=softcap))
            continue
        out.append(mx.fast.scaled_dot_product_attention(queries[b: b + 1], k, v, scale=scale, mask=mask, sinks=sinks))
    return mx.concatenate(out)


def poison_unused_slots(args):
    """NaN in every pool slot no query may read: tails of last blocks, null and spare blocks."""
    BS = args["block_size"]
    used = np.zeros(args["k_pool"].shape[1], bool)  # per slot, in every head
    tables = np.array(args["block_tables"])
    for b, C in enumerate(args["context_lens"]):
        for pos in range(C):
            used[tables[b, pos // BS] * BS + pos % BS] = True
    for name in ("k_pool", "v_pool"):
        if isinstance(args[name], QuantPool):  # NaN scales: any unused slot read dequantises to NaN
            scales = np.array(args[name].scales)
            scales[:, ~used] = np.nan
            args[name] = args[name]._replace(scales=mx.array(scales))
            continue
        pool = np.array(args[name])
        pool[:, ~used] = np.nan
        args[name] = mx.array(pool)
    return args


def assert_close(got, want, tol=1e-5):
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    assert got.shape == want.shape
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


# ---------------------------------------------------------------- algorithm reference vs gather + SDPA


def lengths(BS, q_len):
    # ending on a block boundary, one past it, one short of it, and the shortest legal row
    return [2 * BS, 3 * BS + 1, 5 * BS - 1, q_len]


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("gqa", [1, 3, 4])
@pytest.mark.parametrize("q_len", [1, 2, 3, 4])
def test_reference_matches_gather_sdpa(block_size, gqa, q_len):
    window = None if q_len % 2 else block_size + 3  # windows that start mid-block
    args = ma.random_problem(
        block_size * 10 + gqa * 3 + q_len, context_lens=lengths(block_size, q_len), q_len=q_len,
        n_heads=2 * gqa, n_kv_heads=2, head_dim=32, block_size=block_size, window=window)
    args = poison_unused_slots(args)
    want = gather_sdpa(**args)
    assert_close(ma.paged_attention_online(**args), want)
    assert_close(ma.paged_attention_online(**args, n_partitions=3), want)


@pytest.mark.parametrize("window", [1, 7, 16, 17, 1000])
def test_reference_windows(window):
    args = poison_unused_slots(ma.random_problem(
        window, context_lens=[40, 16, 5], q_len=4, n_heads=4, n_kv_heads=1, head_dim=16,
        block_size=8, window=window))
    assert_close(ma.paged_attention_online(**args, n_partitions=2), gather_sdpa(**args))


@pytest.mark.parametrize("chunk,window", [(1, None), (5, None), (8, None), (13, None), (1000, None), (6, 4)])
def test_reference_chunks(chunk, window):
    """Chunked attention (llama4): chunks that end mid-block and on block ends; with a window inside them too."""
    args = ma.random_problem(chunk, context_lens=[40, 16, 5], q_len=4, n_heads=4, n_kv_heads=1, head_dim=16,
                             block_size=8, chunk=chunk, window=window)
    want = gather_sdpa(**args)
    assert_close(ma.paged_attention_online(**poison_unused_slots(dict(args)), n_partitions=2), want)
    assert_close(paged_attention(**args), want)  # the engine's path (its pools hold no NaN: zeros, stale K/V)
    # The same rows as single rows (one-row path: only the chunk's blocks are read).
    for b, C in enumerate(args["context_lens"]):
        one = {**args, "queries": args["queries"][b: b + 1], "block_tables": args["block_tables"][b: b + 1],
               "context_lens": [C]}
        assert_close(paged_attention(**one), want[b: b + 1])
    if chunk < 40:
        assert not np.allclose(np.array(want), np.array(gather_sdpa(**{**args, "chunk": None})), atol=1e-3)


@pytest.mark.parametrize("context_lens", [[1], [9], [64], [3, 200, 17, 8, 33, 1]])
def test_reference_batch_shapes(context_lens):
    args = poison_unused_slots(ma.random_problem(
        len(context_lens), context_lens=context_lens, q_len=1, n_heads=3, n_kv_heads=3,
        head_dim=24, block_size=8))
    assert_close(ma.paged_attention_online(**args), gather_sdpa(**args))


def test_reference_accepts_lists_and_keeps_dtype():
    args = ma.random_problem(1, context_lens=[10, 3], q_len=2, head_dim=16, block_size=4, dtype=mx.bfloat16)
    want = gather_sdpa(**{**args, **{k: args[k].astype(mx.float32) for k in ("queries", "k_pool", "v_pool")}})
    tables = [[int(i) for i in row if i] for row in args["block_tables"].tolist()]
    got = ma.paged_attention_online(**{**args, "block_tables": tables})
    assert got.dtype == mx.bfloat16
    assert_close(got, want, tol=2e-2)


def test_reference_matches_engine_paged_attention():
    engine = pytest.importorskip("macinfer.kv.paged_attention")
    for i, case in enumerate(ma.self_check_cases(block_size=8, head_dim=32)):
        args = ma.random_problem(i, head_dim=32, block_size=8, **case)
        assert_close(ma.paged_attention_online(**args), engine.paged_attention(**args))


def test_padded_row_with_a_short_table_is_read_within_its_table():
    """A prefill chunk of 3 tokens batched with one of 8 (L = 8): the short row's context_len counts
    its 5 padding tokens (9 + 8 = 17 -> 5 blocks of 4) while its table holds the 3 blocks its 12
    real tokens need. The reference (and the kernel, same index arithmetic) read entry 4 of a
    3-entry table: IndexError before the tables were padded to every row's context."""
    from macinfer.kv.paged_attention import paged_attention

    bs, L = 4, 8
    args = ma.random_problem(0, context_lens=[16, 12], q_len=L, n_heads=4, n_kv_heads=2, head_dim=32, block_size=bs)
    tables = [list(map(int, row[:4])) for row in np.asarray(args["block_tables"])]
    tables[1] = tables[1][:3]
    args.update(block_tables=tables, context_lens=[16, 9 + L])
    got = ma.paged_attention_online(**args)
    want = paged_attention(**args)
    assert_close(got[0], want[0])
    assert_close(got[1, :, :3], want[1, :, :3])  # the short row's 3 real queries
    launch = ma.kernel_launch(**{k: v for k, v in args.items()})
    assert launch["inputs"][3].shape == (2, 5)  # every table covers its row's context


# ---------------------------------------------------------------- the Metal source


def test_metal_source_builds_into_kernel_object():
    ma.build_kernel.cache_clear()
    assert ma.build_kernel() is not None
    if not mx.metal.is_available():
        args = ma.random_problem(0, context_lens=[5], block_size=4, head_dim=32)
        with pytest.raises(RuntimeError, match="Metal"):
            mx.eval(ma.paged_attention_metal(**args))


def test_launch_config():
    args = ma.random_problem(0, context_lens=[5, 40], q_len=3, n_heads=6, n_kv_heads=2, head_dim=64, block_size=16)
    launch = ma.kernel_launch(**args)
    assert launch["grid"] == (256, 18, 2) and launch["threadgroup"] == (256, 1, 1)  # 256 threads, as vllm-metal
    assert launch["template"] == [("T", mx.float32), ("D", 64), ("BS", 16), ("NSG", 8)]
    assert [a.dtype for a in launch["inputs"][3:]] == [mx.int32, mx.int32, mx.float32, mx.int32, mx.float32,
                                                       mx.float32, mx.int32]  # ... softcap, sinks, chunk
    assert all(ma.default_simdgroups(d) == 8 for d in (64, 80, 96, 128, 256))
    assert ma.default_simdgroups(64, max_threads=1024) == 32 and ma.default_simdgroups(256, max_threads=1024) == 16
    q = ma.kernel_launch(**{**args, **ma.random_problem(0, context_lens=[5], head_dim=64, kv_bits=8)}, n_simdgroups=3)
    assert q["template"][3:] == [("NSG", 3), ("BITS", 8), ("G", 32)] and q["threadgroup"] == (96, 1, 1)
    assert [a.dtype for a in q["inputs"][:7]] == [mx.float32, mx.uint32, mx.float32, mx.float32, mx.uint32,
                                                  mx.float32, mx.float32]


# A C++ stand-in for the Metal built-ins the kernel uses. Address spaces vanish,
# `threadgroup` arrays become function statics (one threadgroup runs at a time),
# and each GPU thread is a fiber that yields at simd_sum / threadgroup_barrier.
SHIM = r"""
#if defined(__APPLE__)  // ucontext is an XSI interface there: hidden without _XOPEN_SOURCE
#define _XOPEN_SOURCE 700
#define _DARWIN_C_SOURCE
#endif
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <ucontext.h>
#define device
#define constant
#define threadgroup static
typedef unsigned int uint;
struct uint3 { uint x, y, z; };
typedef _Float16 float16_t;
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) { uint32_t u; std::memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); bits = u >> 16; }
  operator float() const { uint32_t u = uint32_t(bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
namespace metal {
using std::max;
inline float exp(float x) { return std::exp(x); }
namespace precise { inline float tanh(float x) { return std::tanh(x); } }
}
enum class mem_flags { mem_none, mem_device, mem_threadgroup };

enum { RUNNING, AT_SIMD, AT_BARRIER, DONE };
struct Fiber { ucontext_t ctx; int state; float val, result; };
static ucontext_t sched;
static Fiber* fibers;
static Fiber* cur;
static char* stacks;
static const size_t STACK = 64 * 1024;
static void (*body)(int);

float simd_sum(float x) { cur->val = x; cur->state = AT_SIMD; swapcontext(&cur->ctx, &sched); return cur->result; }
void threadgroup_barrier(mem_flags) { cur->state = AT_BARRIER; swapcontext(&cur->ctx, &sched); }
static void trampoline(int i) { body(i); fibers[i].state = DONE; }

// Run one threadgroup of n threads (n % 32 == 0); returns 0, or 1 on divergence / deadlock.
static int run_group(int n, void (*fn)(int)) {
  if (!fibers) { fibers = new Fiber[1024]; stacks = (char*)std::malloc(1024 * STACK); }
  body = fn;
  for (int i = 0; i < n; ++i) {
    getcontext(&fibers[i].ctx);
    fibers[i].ctx.uc_stack.ss_sp = stacks + i * STACK;
    fibers[i].ctx.uc_stack.ss_size = STACK;
    fibers[i].ctx.uc_link = &sched;
    makecontext(&fibers[i].ctx, (void (*)())trampoline, 1, i);
    fibers[i].state = RUNNING;
  }
  for (;;) {
    bool moved = false;
    for (int sg = 0; sg < n / 32; ++sg) {
      Fiber* f = fibers + sg * 32;
      if (f[0].state == AT_BARRIER || f[0].state == DONE) continue;
      for (int l = 0; l < 32; ++l) { cur = f + l; swapcontext(&sched, &f[l].ctx); }
      for (int l = 1; l < 32; ++l) if (f[l].state != f[0].state) return 1;  // divergent sync point
      if (f[0].state == AT_SIMD) {
        float s = 0; for (int l = 0; l < 32; ++l) s += f[l].val;
        for (int l = 0; l < 32; ++l) { f[l].result = s; f[l].state = RUNNING; }
      }
      moved = true;
    }
    if (moved) continue;
    int done = 0; for (int i = 0; i < n; ++i) done += fibers[i].state == DONE;
    if (done == n) return 0;
    if (done) return 1;  // some threads exited while others wait at a barrier
    for (int i = 0; i < n; ++i) fibers[i].state = RUNNING;  // everyone at the barrier
  }
}
"""

# Metal attributes MLX passes when the source mentions them -> their value in the emulator.
ATTRIBUTES = {
    "simdgroup_index_in_threadgroup": "tid / 32",
    "thread_index_in_simdgroup": "tid % 32",
    "thread_position_in_threadgroup": "uint3{tid, 0, 0}",
    "threadgroup_position_in_grid": "uint3{0, gy, gz}",
}


@contextlib.contextmanager
def stdout_fd_to(path):
    """Redirect file descriptor 1 (where MLX's C++ `verbose` printing goes) to a file."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(path, "wb") as f:
        os.dup2(f.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def mlx_generated_source(kernel, launch, tmp_dir) -> str:
    """The complete Metal source MLX generates for this call (signature included).

    Without Metal a kernel call raises before generating it, except while exporting
    a function: then MLX records the call, and verbose=True prints the source.
    """
    def call(*inputs):
        return kernel(**{**launch, "inputs": list(inputs)}, verbose=True)[0]

    log = tmp_dir / "verbose.txt"
    with stdout_fd_to(log):
        mx.export_function(str(tmp_dir / "kernel.mlxfn"), call, *launch["inputs"])
    return log.read_text().split("```\n", 1)[1].rsplit("\n```", 1)[0]


def without_instantiation(generated: str) -> str:
    """MLX's source without its closing explicit instantiation, `template [[host_name("...")]] [[kernel]]
    decltype(f<...>) f<...>;`: g++ ignores attributes there, clang++ (Apple's compiler) rejects them
    ("an attribute list cannot appear here"). The runner instantiates the template by calling it."""
    out = re.sub(r"\ntemplate \[\[host_name\(.*?;\n", "\n", generated)
    assert out != generated, "MLX no longer ends its source with an explicit instantiation"
    return out


def emulator_cpp(key, generated, names=ma.INPUT_NAMES) -> str:
    """MLX's generated kernel plus a runner `run_<key>` that calls it once per GPU thread
    (names: the kernel's input names, ma.QUANT_INPUT_NAMES for quantised pools)."""
    fn, params = re.search(r"\[\[kernel\]\] void (\w+)\(\n(.*?)\) \{\n", generated, re.S).groups()
    targs = re.search(rf"decltype\({fn}<([^>]*)>\)", generated).group(1)
    generated = without_instantiation(generated)
    call = []
    for param in params.split(",\n"):
        name = re.search(r"(\w+) \[\[", param).group(1)
        ctype = param.split(f" {name} [[")[0].replace("constant ", "").replace("device ", "").strip()
        if name in names:
            call.append(f"({ctype})g_in[{names.index(name)}]")
        elif name.endswith("_shape"):
            call.append(f"({ctype})g_shape[{names.index(name[:-6])}]")
        elif name == "out":
            call.append(f"({ctype})g_out")
        else:
            assert name in ATTRIBUTES, f"the emulator does not model the Metal attribute {name}"
            call.append(ATTRIBUTES[name])
    nsg = int(targs.split(",")[3])
    return f"""
namespace {key} {{
{generated}
static void** g_in; static int** g_shape; static void* g_out; static uint gy, gz;
static void thread(int i) {{ uint tid = i; {fn}<{targs}>({", ".join(call)}); }}
}}
extern "C" int run_{key}(void** in, int** shape, void* out, int groups_y, int groups_z) {{
  using namespace {key};
  g_in = in; g_shape = shape; g_out = out;
  for (gz = 0; gz < (uint)groups_z; ++gz)
    for (gy = 0; gy < (uint)groups_y; ++gy)
      if (run_group({32 * nsg}, thread)) return 1;
  return 0;
}}
"""


WINDOW_BUG = ma.METAL_SOURCE.replace("p - W + 1", "p - W")  # an off-by-one the self-check must catch
CHUNK_BUG = ma.METAL_SOURCE.replace("(p / CH) * CH", "(p / CH) * CH + 1")  # a chunk's first key lost
QUANT_CHUNK_BUG = ma.QUANT_METAL_SOURCE.replace("(p / CH) * CH", "(p / CH) * CH + 1")
assert WINDOW_BUG != ma.METAL_SOURCE != CHUNK_BUG and QUANT_CHUNK_BUG != ma.QUANT_METAL_SOURCE
BUGS = (WINDOW_BUG, CHUNK_BUG, QUANT_CHUNK_BUG)
# What the emulator is built for: key -> (source, dtype, head_dim, block_size, n_simdgroups, kv_bits).
CONFIGS = {
    "f32_d32_b8_n3": (ma.METAL_SOURCE, mx.float32, 32, 8, 3, None),
    "f32_d32_b16_n1": (ma.METAL_SOURCE, mx.float32, 32, 16, 1, None),
    "f32_d40_b32_n2": (ma.METAL_SOURCE, mx.float32, 40, 32, 2, None),
    "f16_d64_b16_n8": (ma.METAL_SOURCE, mx.float16, 64, 16, 8, None),
    "bf16_d64_b16_n8": (ma.METAL_SOURCE, mx.bfloat16, 64, 16, 8, None),
    "bug_d64_b16_n8": (WINDOW_BUG, mx.float32, 64, 16, 8, None),
    "chunkbug_d64_b16_n8": (CHUNK_BUG, mx.float32, 64, 16, 8, None),
    "q8chunkbug_d64_b16_n8": (QUANT_CHUNK_BUG, mx.float32, 64, 16, 8, 8),
    "q8_f32_d64_b8_n3": (ma.QUANT_METAL_SOURCE, mx.float32, 64, 8, 3, 8),
    "q4_f32_d64_b8_n2": (ma.QUANT_METAL_SOURCE, mx.float32, 64, 8, 2, 4),
    "q8_f16_d64_b16_n8": (ma.QUANT_METAL_SOURCE, mx.float16, 64, 16, 8, 8),
    **{f"f32_d{d}_b16_n8": (ma.METAL_SOURCE, mx.float32, d, 16, 8, None) for d in (64, 80, 96, 128, 256)},
    **{f"q8_f32_d{d}_b16_n8": (ma.QUANT_METAL_SOURCE, mx.float32, d, 16, 8, 8) for d in (64, 96, 128, 256)},
}


def _kernel_for(key, source, quantized):
    if source is ma.METAL_SOURCE or source is ma.QUANT_METAL_SOURCE:
        return ma.build_kernel(quantized)
    names = ma.QUANT_INPUT_NAMES if quantized else ma.INPUT_NAMES
    return mx.fast.metal_kernel(name=key, input_names=list(names), output_names=["out"], source=source)


def _compile_flags():
    flags = ["-std=c++20", "-O1", "-shared", "-fPIC", "-Wall", "-Wno-attributes", "-Wno-unused-variable"]
    return flags + (["-Wno-deprecated-declarations"] if sys.platform == "darwin" else [])  # ucontext on macOS


@pytest.fixture(scope="session")
def emulator(tmp_path_factory):
    """emulator(args, n_simdgroups=None, key=None) -> output of METAL_SOURCE (or QUANT_METAL_SOURCE) run on the CPU."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++ to build the Metal-source emulator")
    d = tmp_path_factory.mktemp("metal_emulator")
    code = [SHIM]
    for key, (source, dtype, D, BS, NSG, bits) in CONFIGS.items():
        sample = ma.random_problem(0, context_lens=[3], head_dim=D, block_size=BS, dtype=dtype, kv_bits=bits)
        generated = mlx_generated_source(_kernel_for(key, source, bits is not None),
                                         ma.kernel_launch(**sample, n_simdgroups=NSG), d)
        code.append(emulator_cpp(key, generated, ma.QUANT_INPUT_NAMES if bits else ma.INPUT_NAMES))
    (d / "kernels.cpp").write_text("".join(code))
    build = subprocess.run(["g++", *_compile_flags(), "-o", str(d / "kernels.so"), str(d / "kernels.cpp")],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    lib = ctypes.CDLL(str(d / "kernels.so"))
    by_config = {cfg[1:]: key for key, cfg in CONFIGS.items() if all(cfg[0] is not bug for bug in BUGS)}
    as_bits = {mx.float16: mx.uint16, mx.bfloat16: mx.uint16}

    def run(args, n_simdgroups=None, key=None):
        launch = ma.kernel_launch(**args, n_simdgroups=n_simdgroups)
        t = dict(launch["template"])
        key = key or by_config[(t["T"], t["D"], t["BS"], t["NSG"], t.get("BITS"))]
        ins = [np.ascontiguousarray(np.array(a.view(as_bits[a.dtype]) if a.dtype in as_bits else a))
               for a in launch["inputs"]]
        shapes = [np.array(a.shape, np.int32) for a in ins]
        out = np.zeros(launch["output_shapes"][0], ins[0].dtype)
        int_p = ctypes.POINTER(ctypes.c_int)
        gx, gy, gz = (math.ceil(g / t) for g, t in zip(launch["grid"], launch["threadgroup"]))
        assert gx == 1
        rc = getattr(lib, f"run_{key}")(
            (ctypes.c_void_p * len(ins))(*[a.ctypes.data for a in ins]),
            (int_p * len(ins))(*[s.ctypes.data_as(int_p) for s in shapes]),
            ctypes.c_void_p(out.ctypes.data), gy, gz)
        assert rc == 0, "divergent simd_sum or barrier in the kernel"
        dtype = launch["output_dtypes"][0]
        return mx.array(out).view(dtype) if dtype in as_bits else mx.array(out)

    return run


@pytest.mark.parametrize("n_simdgroups,block_size,head_dim", [(3, 8, 32), (1, 16, 32), (2, 32, 40)])
@pytest.mark.parametrize("q_len,gqa,window,chunk", [(1, 1, None, None), (3, 3, None, None), (2, 4, 11, None),
                                                    (4, 2, 40, None), (3, 2, None, 13), (1, 1, None, 16)])
def test_metal_source_matches_reference_in_emulator(emulator, n_simdgroups, block_size, head_dim, q_len, gqa, window,
                                                    chunk):
    args = ma.random_problem(
        q_len * 7 + gqa, context_lens=lengths(block_size, q_len), q_len=q_len, n_heads=2 * gqa,
        n_kv_heads=2, head_dim=head_dim, block_size=block_size, window=window, chunk=chunk)
    args = poison_unused_slots(args)
    got = emulator(args, n_simdgroups=n_simdgroups)
    assert_close(got, ma.paged_attention_online(**args, n_partitions=n_simdgroups), tol=2e-6)
    assert_close(got, gather_sdpa(**args))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_metal_source_half_types_in_emulator(emulator, dtype):
    args = ma.random_problem(3, context_lens=[700, 33], q_len=2, n_heads=4, n_kv_heads=2, dtype=dtype)
    got = emulator(args)
    assert got.dtype == dtype
    assert_close(got, ma.paged_attention_online(**args), tol=ma.TOLERANCE[dtype])


@pytest.mark.parametrize("bits,dtype,key", [(8, mx.float32, "q8_f32_d64_b8_n3"), (4, mx.float32, "q4_f32_d64_b8_n2"),
                                          (8, mx.float16, "q8_f16_d64_b16_n8")])
@pytest.mark.parametrize("masking", ["window", "chunk"])
def test_quantized_source_matches_reference_in_emulator(emulator, bits, dtype, key, masking):
    """8-bit (and 4-bit) KV read by the kernel, each key and value dequantised as it is read;
    a sliding window or chunks (llama4) that start mid-block."""
    source, _, D, BS, NSG, _ = CONFIGS[key]
    args = poison_unused_slots(ma.random_problem(
        bits, context_lens=[3 * BS + 2, BS, 7], q_len=3, n_heads=4, n_kv_heads=2, head_dim=D, block_size=BS,
        dtype=dtype, kv_bits=bits, **{masking: 2 * BS + 1 if masking == "window" else BS + 3}))
    got = emulator(args, n_simdgroups=NSG)
    tol = 1e-5 if dtype == mx.float32 else ma.TOLERANCE[dtype]
    assert_close(got, ma.paged_attention_online(**args, n_partitions=NSG), tol=tol)
    assert_close(got, gather_sdpa(**args), tol=tol)  # gather + mx.dequantize + SDPA


@pytest.mark.parametrize("bits", [4, 8])
def test_numpy_dequantize_is_mlx_dequantize(bits):
    pool = ma.random_problem(0, context_lens=[20], head_dim=64, block_size=8, kv_bits=bits)["k_pool"]
    slots = np.array([3, 9, 17, 40])
    want = mx.dequantize(*(x[1][mx.array(slots)] for x in (pool.codes, pool.scales, pool.biases)),
                         group_size=32, bits=bits)
    np.testing.assert_allclose(ma.np_dequantize(pool, 1, slots), np.array(want), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- property tests (fixed seeds)


def random_args(rng, head_dim, *, block_size=None, kv_bits=None, max_rows=4, max_len=6):
    """A random problem: 1..max_rows rows of ragged lengths, some right-padded (a prefill chunk
    shorter than the batch's q_len: its table covers only its real tokens), GQA 1-3, q_len 1-16,
    a window, a soft-cap, sinks or chunks, shuffled blocks; unused pool slots poisoned with NaN."""
    BS = block_size or int(rng.choice([8, 16]))
    B, QL = int(rng.integers(1, max_rows + 1)), int(rng.integers(1, 17))
    kvh, gqa = int(rng.integers(1, 3)), int(rng.integers(1, 4))
    lens = [int(rng.integers(QL, max_len * BS)) for _ in range(B)]
    extra = [{}, {"window": int(rng.integers(1, 3 * BS))}, {"softcap": 4.0}, {"sinks": True}][int(rng.integers(4))]
    if rng.random() < 0.3:  # chunked attention (llama4), alone or beside the above
        extra["chunk"] = int(rng.integers(1, 3 * BS))
    args = ma.random_problem(int(rng.integers(1 << 30)), context_lens=lens, q_len=QL, n_heads=kvh * gqa,
                             n_kv_heads=kvh, head_dim=head_dim, block_size=BS, kv_bits=kv_bits, **extra)
    args["queries"] = args["queries"] * 3  # peakier softmax: a wrong key shows
    tables = [list(map(int, row)) for row in np.asarray(args["block_tables"])]
    if B > 1 and QL > 1 and rng.random() < 0.5:  # row 0 is padded: fewer real tokens than its context
        real = lens[0] - int(rng.integers(1, QL))
        tables[0] = tables[0][: -(-real // BS)]
    args["block_tables"] = ma.padded_tables(tables, lens, BS)
    return poison_unused_slots(args)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_property_reference_matches_gather_sdpa(seed, head_dim):
    rng = np.random.default_rng([seed, head_dim])
    bits = 8 if head_dim % 32 == 0 and seed % 2 else None
    args = random_args(rng, head_dim, kv_bits=bits)
    assert_close(ma.paged_attention_online(**args), gather_sdpa(**args))


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_property_metal_source_matches_reference_in_emulator(emulator, seed, head_dim):
    rng = np.random.default_rng([seed, head_dim, 1])
    bits = 8 if head_dim != 80 and seed else None  # MLX groups 32 / 64 / 128 do not divide 80
    args = random_args(rng, head_dim, block_size=16, kv_bits=bits, max_rows=3, max_len=4)
    got = emulator(args)
    assert_close(got, ma.paged_attention_online(**args), tol=1e-5)
    assert_close(got, gather_sdpa(**args), tol=1e-5)


# ---------------------------------------------------------------- selection


@pytest.fixture
def no_kernel_calls(monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("the kernel must not be built or called here")

    monkeypatch.setattr(ma, "build_kernel", forbidden)
    monkeypatch.setattr(ma, "paged_attention_metal", forbidden)


def test_reference_mode_never_touches_the_kernel(no_kernel_calls, monkeypatch):
    monkeypatch.setattr(ma, "metal_available", lambda: True)
    assert kd.select_attention("reference", gather_sdpa) == (gather_sdpa, "reference")


def test_no_metal_means_reference_without_warning(no_kernel_calls, monkeypatch):
    monkeypatch.setattr(ma, "metal_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kd.select_attention("auto", gather_sdpa) == (gather_sdpa, "reference")
    with pytest.raises(MacinferError, match="needs Metal"):
        kd.select_attention("metal", gather_sdpa)


def test_this_host_selects_reference():
    if mx.metal.is_available():
        pytest.skip("Metal host")
    assert kd.select_attention("auto", gather_sdpa) == (gather_sdpa, "reference")


def test_bad_mode():
    with pytest.raises(ValueError, match="reference, metal, auto"):
        kd.select_attention("fast", gather_sdpa)


def _select_with_one_warning(match):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn, backend = kd.select_attention("auto", gather_sdpa)
    assert (fn, backend) == (gather_sdpa, "reference")
    assert len(caught) == 1 and caught[0].category is kd.MetalAttentionWarning
    assert match in str(caught[0].message)
    return str(caught[0].message)


def test_compile_failure_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(ma, "metal_available", lambda: True)

    def broken(*a, **k):
        raise RuntimeError("program_source:12:5: error: use of undeclared identifier 'qv'")

    monkeypatch.setattr(ma, "paged_attention_metal", broken)
    msg = _select_with_one_warning("failed to compile or run")
    assert "undeclared identifier" in msg
    with pytest.raises(MacinferError, match="failed to compile"):
        kd.select_attention("metal", gather_sdpa)


def test_run_failure_of_real_kernel_falls_back(monkeypatch):
    """Pretend Metal exists: the real kernel builds, then raises when evaluated here."""
    if mx.metal.is_available():
        pytest.skip("Metal host")
    monkeypatch.setattr(ma, "metal_available", lambda: True)
    _select_with_one_warning("No Metal back-end")


def test_mismatch_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(ma, "metal_available", lambda: True)
    calls = []

    def slightly_wrong(queries, *a, **k):
        calls.append(queries.dtype)
        return ma.paged_attention_online(queries, *a, n_partitions=k.pop("n_simdgroups"), **k) * 1.01

    monkeypatch.setattr(ma, "paged_attention_metal", slightly_wrong)
    _select_with_one_warning("disagrees with the reference")
    assert calls == [mx.float32]  # float32 goes first and the check stops at the first mismatch


def emulated_kernel(emulator, key=None):
    def paged_attention_metal(queries, k_pool, v_pool, block_tables, context_lens, *, block_size, scale, window=None,
                              softcap=None, sinks=None, chunk=None, n_simdgroups=None):
        return emulator(dict(queries=queries, k_pool=k_pool, v_pool=v_pool, block_tables=block_tables,
                             context_lens=context_lens, block_size=block_size, scale=scale, window=window,
                             softcap=softcap, sinks=sinks, chunk=chunk), n_simdgroups=n_simdgroups, key=key)

    return paged_attention_metal


def test_emulated_metal_source_passes_self_check_and_is_selected(emulator, monkeypatch):
    """The full self-check (float16, bfloat16, float32) run on METAL_SOURCE itself."""
    monkeypatch.setattr(ma, "metal_available", lambda: True)
    monkeypatch.setattr(ma, "build_kernel", lambda quantized=False: object())
    monkeypatch.setattr(ma, "paged_attention_metal", emulated_kernel(emulator))
    reference_calls = []

    def reference(*a, **k):
        reference_calls.append(k)
        return gather_sdpa(*a, **k)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn, backend = kd.select_attention("auto", reference)
    assert backend == "metal" and isinstance(fn, kd.KernelDispatch)
    assert len(reference_calls) == 3 * len(ma.self_check_cases(16, 64))
    reference_calls.clear()
    args = ma.random_problem(9, context_lens=[20, 9], q_len=2, sinks=True)
    assert_close(fn(**args), gather_sdpa(**args))
    assert reference_calls == []


def test_emulated_buggy_source_is_rejected(emulator):
    """The self-check has teeth: a window off by one key fails it, in the windowed case; a chunk's
    first key dropped (float or quantised source), in the chunked case."""
    buggy = emulated_kernel(emulator, key="bug_d64_b16_n8")
    failure = ma.self_check(buggy, gather_sdpa, dtypes=(mx.float32,))
    assert failure and "disagrees" in failure and "case 2" in failure
    # The chunked case is the last one.
    chunked = f"case {len(ma.self_check_cases(16, 64)) - 1}"
    failure = ma.self_check(emulated_kernel(emulator, key="chunkbug_d64_b16_n8"), gather_sdpa, dtypes=(mx.float32,))
    assert failure and chunked in failure
    failure = ma.self_check(emulated_kernel(emulator, key="q8chunkbug_d64_b16_n8"), gather_sdpa, dtypes=(mx.float32,),
                            kv_bits=8)  # the quantised variant's chunk too
    assert failure and chunked in failure


def test_emulated_kernel_passes_self_check_against_engine_reference(emulator):
    engine = pytest.importorskip("macinfer.kv.paged_attention")
    assert ma.self_check(emulated_kernel(emulator), engine.paged_attention, dtypes=(mx.float32,)) is None


def test_bench_script_runs_without_metal(capsys):
    if mx.metal.is_available():
        pytest.skip("Metal host")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "scripts" / "bench/attention.py"
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--contexts", "64,100", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "no Metal" in out and "timing the reference path only" in out
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[-3:-1]] == ["64", "100"]
    assert lines[-1].startswith("end-to-end decode: skipped (no Metal")


def test_bench_script_end_to_end_decode(capsys, tiny_models):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "scripts" / "bench/attention.py"
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--contexts", "64", "--repeats", "1", "--e2e", str(tiny_models("llama")),
                "--e2e-contexts", "100,600", "--e2e-tokens", "4"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].split()[:2] == ["100", "tokens:"] and "reference" in lines[-2] and "tok/s" in lines[-2]
    assert "beyond" in lines[-1] and "skipped" in lines[-1]  # 600 > the tiny model's 512-token context


@pytest.mark.skipif(mx.metal.is_available(), reason="asserts the engine's choice without Metal")
def test_engine_selects_reference_without_metal_and_refuses_metal(tiny_models):
    """Wired into the engine: auto -> reference here, metal -> one clear error."""
    from macinfer.engine.llm_engine import LLMEngine
    from macinfer.modelio.loader import load_model

    model, tok, info = load_model(str(tiny_models("llama")))
    engine = LLMEngine(model, tok, info, num_blocks=16)
    assert engine.attention_backend == "reference" and "attention: reference" in engine.describe()
    assert engine.runner.ctx.attention_fn is None
    with pytest.raises(MacinferError, match="needs Metal"):
        LLMEngine(model, tok, info, num_blocks=16, attention="metal")


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal: the real kernel in the engine")
def test_engine_on_metal_decodes_like_the_reference(tiny_models):
    """On a Mac: the engine with the kernel forced gives the reference engine's greedy tokens."""
    from macinfer.core.sampling import SamplingParams
    from macinfer.engine.llm_engine import LLMEngine
    from macinfer.modelio.loader import load_model

    model, tok, info = load_model(str(tiny_models("llama")))
    outs = []
    for attention in ("reference", "metal"):
        engine = LLMEngine(model, tok, info, num_blocks=64, attention=attention)
        assert engine.attention_backend == attention
        ids = [engine.add_request(tok.encode(p), SamplingParams(max_tokens=8, ignore_eos=True))
               for p in ("hello world", "the paged kernel reads blocks")]
        got = {}
        while engine.has_unfinished():
            for d in engine.step():
                if d.output is not None:
                    got[d.request_id] = d.output.token_ids
        outs.append([got[i] for i in ids])
    assert outs[0] == outs[1]


def test_engine_calls_the_kernel_hook_for_decode_rows_only(tiny_models):
    """A kernel set on the runner is what every layer calls for decode rows, with tables built once per forward."""
    from macinfer.engine.llm_engine import LLMEngine
    from macinfer.modelio.loader import load_model
    from macinfer.kv.paged_attention import paged_attention

    model, tok, info = load_model(str(tiny_models("llama")))
    engine = LLMEngine(model, tok, info, num_blocks=16, attention="reference")
    # A selected kernel is what every layer calls: count the calls through the hook.
    calls, tables = [], []

    def spy(*args, **kw):
        calls.append(1)
        tables.append(args[3])  # the padded int32 tables, built once per forward
        return paged_attention(*args, **kw)

    engine.runner.ctx.attention_fn = spy
    from macinfer.core.sampling import SamplingParams

    engine.add_request(tok.encode("hello world")[:4], SamplingParams(max_tokens=2))  # a 4-token prefill
    while engine.has_unfinished():
        engine.step()
    assert len(calls) == 2 * len(model.layers)  # prefill + one decode, every layer
    L = len(model.layers)
    assert all(isinstance(t, mx.array) for t in tables) and all(tables[i] is tables[i - i % L] for i in range(len(tables)))
    # A prefill chunk longer than KERNEL_MAX_Q_LEN goes to MLX's SDPA, never the decode kernel.
    from macinfer.kv.paged_cache import KERNEL_MAX_Q_LEN

    calls.clear()
    engine.add_request(list(range(5, 5 + 3 * KERNEL_MAX_Q_LEN)), SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    assert len(calls) == len(model.layers)  # the decode step only
