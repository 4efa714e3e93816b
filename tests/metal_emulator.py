"""Run MLX-generated Metal kernel source on the CPU: a C++ shim of the Metal built-ins and a SIMT emulator.

MLX writes a custom kernel's complete source (signature included) from `mx.fast.metal_kernel`'s
body; `generated_source` captures it without Metal. `Emulator` compiles it as C++ (clang++ or
g++) against `SHIM`: address spaces vanish, `threadgroup` arrays become function statics (one
threadgroup runs at a time), each GPU thread is a fiber (ucontext) that yields at simd_sum,
simd_max and threadgroup_barrier, and a divergent sync point is an error. The K/V pool inputs
are `counted` pointers: every load through the kernel's kv_vec4 / kv_one (or an index) adds
its bytes, so a test can measure what a kernel reads from device memory.

A check of the source's logic and index arithmetic, not of the Metal compiler or the GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

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
#include <type_traits>
#include <csetjmp>
#include <setjmp.h>
#include <ucontext.h>
#define device
#define constant
#define threadgroup static
typedef unsigned int uint;
struct uint3 { uint x, y, z; };
// half as a 16-bit struct: _Float16 is missing on x86 in clang < 15 (and __fp16 in g++).
static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, e = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (e == 0 && man == 0) u = sign;
  else if (e == 0) { e = 113; while (!(man & 0x400)) { man <<= 1; --e; } u = sign | (e << 23) | ((man & 0x3ff) << 13); }
  else if (e == 31) u = sign | 0x7f800000 | (man << 13);
  else u = sign | ((e + 112) << 23) | (man << 13);
  float f; std::memcpy(&f, &u, 4); return f;
}
static inline uint16_t f32_to_f16(float f) {  // round to nearest even
  uint32_t u; std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000, man = u & 0x7fffff; int e = int((u >> 23) & 0xff) - 112;
  if (((u >> 23) & 0xff) == 0xff) return sign | 0x7c00 | (man ? 0x200 : 0);
  if (e >= 31) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    man |= 0x800000; uint32_t shift = 14 - e, h = man >> shift, rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
    return sign | (h + (rem > mid || (rem == mid && (h & 1))));
  }
  uint32_t h = sign | (uint32_t(e) << 10) | (man >> 13), rem = man & 0x1fff;
  return h + (rem > 0x1000 || (rem == 0x1000 && (h & 1)));
}
struct float16_t {
  uint16_t bits;
  float16_t() = default;
  float16_t(float f) : bits(f32_to_f16(f)) {}
  operator float() const { return f16_to_f32(bits); }
};
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) { uint32_t u; std::memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); bits = u >> 16; }
  operator float() const { uint32_t u = uint32_t(bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
template <typename T, int N> struct vec { T v[N]; T operator[](int i) const { return v[i]; } };
namespace metal {
using std::max;
using std::min;
inline float exp(float x) { return std::exp(x); }
namespace precise { inline float tanh(float x) { return std::tanh(x); } }
}
enum class mem_flags { mem_none, mem_device, mem_threadgroup };

// A K/V pool input: reads add their bytes to a counter.
template <typename P> struct counted {
  P* p; unsigned long long* bytes;
  P operator[](int64_t i) const { *bytes += sizeof(P); return p[i]; }
};
template <typename P> vec<std::remove_const_t<P>, 4> kv_vec4(counted<P> c, int64_t i) {
  *c.bytes += 4 * sizeof(P); vec<std::remove_const_t<P>, 4> v; std::memcpy(&v, c.p + i, sizeof v); return v;
}
template <typename P> std::remove_const_t<P> kv_one(counted<P> c, int64_t i) { *c.bytes += sizeof(P); return c.p[i]; }

enum { RUNNING, AT_SUM, AT_MAX, AT_BARRIER, DONE };
// Fibers start on their own stack with makecontext / swapcontext, then switch with _setjmp / _longjmp,
// which (unlike swapcontext) do not save the signal mask with a system call at every switch.
struct Fiber { ucontext_t ctx; jmp_buf jb; int state, started; float val, result; };
static ucontext_t sched_ctx;
static jmp_buf sched_jb;
static Fiber* fibers;
static Fiber* cur;
static char* stacks;
static const size_t STACK = 64 * 1024;
static void (*body)(int);

static void yield_to_scheduler() { if (!_setjmp(cur->jb)) _longjmp(sched_jb, 1); }
float simd_sum(float x) { cur->val = x; cur->state = AT_SUM; yield_to_scheduler(); return cur->result; }
float simd_max(float x) { cur->val = x; cur->state = AT_MAX; yield_to_scheduler(); return cur->result; }
void threadgroup_barrier(mem_flags) { cur->state = AT_BARRIER; yield_to_scheduler(); }
static void trampoline(int i) { body(i); fibers[i].state = DONE; _longjmp(sched_jb, 1); }
static void resume(Fiber* f) {
  cur = f;
  if (_setjmp(sched_jb)) return;
  if (f->started) _longjmp(f->jb, 1);
  f->started = 1;
  swapcontext(&sched_ctx, &f->ctx);
}

// Run one threadgroup of n threads (n % 32 == 0); returns 0, or 1 on divergence / deadlock.
static int run_group(int n, void (*fn)(int)) {
  if (!fibers) { fibers = new Fiber[1024]; stacks = (char*)std::malloc(1024 * STACK); }
  body = fn;
  for (int i = 0; i < n; ++i) {
    getcontext(&fibers[i].ctx);
    fibers[i].ctx.uc_stack.ss_sp = stacks + i * STACK;
    fibers[i].ctx.uc_stack.ss_size = STACK;
    fibers[i].ctx.uc_link = &sched_ctx;
    makecontext(&fibers[i].ctx, (void (*)())trampoline, 1, i);
    fibers[i].state = RUNNING;
    fibers[i].started = 0;
  }
  for (;;) {
    bool moved = false;
    for (int sg = 0; sg < n / 32; ++sg) {
      Fiber* f = fibers + sg * 32;
      if (f[0].state == AT_BARRIER || f[0].state == DONE) continue;
      for (int l = 0; l < 32; ++l) resume(f + l);
      for (int l = 1; l < 32; ++l) if (f[l].state != f[0].state) return 1;  // divergent sync point
      if (f[0].state == AT_SUM || f[0].state == AT_MAX) {
        float r = f[0].val;
        for (int l = 1; l < 32; ++l) r = f[0].state == AT_SUM ? r + f[l].val : std::max(r, f[l].val);
        for (int l = 0; l < 32; ++l) { f[l].result = r; f[l].state = RUNNING; }
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
    "thread_index_in_threadgroup": "tid",
    "thread_position_in_threadgroup": "uint3{tid, 0, 0}",
    "threads_per_threadgroup": "uint3{g_threads, 1, 1}",
    "threadgroup_position_in_grid": "uint3{0, gy, gz}",
}
POOL_NAMES = ("k_pool", "v_pool", "k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases")


def compiler() -> str | None:
    """The C++ compiler the emulator is built with: $EMU_CXX, else clang++ (Apple's compiler), else g++."""
    return os.environ.get("EMU_CXX") or shutil.which("clang++") or shutil.which("g++")


def compile_flags(cxx: str) -> list[str]:
    flags = ["-std=c++20", "-O1", "-shared", "-fPIC", "-fno-strict-aliasing", "-Wall", "-Wno-unused-variable"]
    flags += ["-Wno-attributes"] if "clang" not in Path(cxx).name else ["-Wno-unknown-attributes"]
    return flags + (["-Wno-deprecated-declarations"] if sys.platform == "darwin" else [])  # ucontext on macOS


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


def generated_source(kernel, launch: dict, tmp_dir: Path) -> str:
    """The complete Metal source MLX generates for this call (header and signature included).

    Without Metal a kernel call raises before generating it, except while exporting
    a function: then MLX records the call, and verbose=True prints the source.
    """
    def call(*inputs):
        return kernel(**{**launch, "inputs": list(inputs)}, verbose=True)[0]

    tmp_dir.mkdir(parents=True, exist_ok=True)
    log = tmp_dir / "verbose.txt"
    with stdout_fd_to(log):
        mx.export_function(str(tmp_dir / "kernel.mlxfn"), call, *launch["inputs"])
    return log.read_text().split("```\n", 1)[1].rsplit("\n```", 1)[0]


def kernel_name(generated: str) -> str:
    return re.search(r"\[\[kernel\]\] void (\w+)\(", generated).group(1)


def without_instantiation(generated: str) -> str:
    """MLX's source without its closing explicit instantiation, `template [[host_name("...")]] [[kernel]]
    decltype(f<...>) f<...>;`: g++ ignores attributes there, clang++ (Apple's compiler) rejects them
    ("an attribute list cannot appear here"). The runner instantiates the template by calling it."""
    out = re.sub(r"\ntemplate \[\[host_name\(.*?;\n", "\n", generated)
    assert out != generated, "MLX no longer ends its source with an explicit instantiation"
    return out


def emulator_cpp(key: str, generated: str, names) -> str:
    """MLX's generated kernel plus a runner `run_<key>` that calls it once per GPU thread
    (names: the kernel's input names, in order)."""
    fn, params = re.search(r"\[\[kernel\]\] void (\w+)\(\n(.*?)\) \{\n", generated, re.S).groups()
    targs = re.search(rf"decltype\({fn}<(.*?)>\)", generated).group(1)
    call = []
    for param in params.split(",\n"):
        name = re.search(r"(\w+) \[\[", param).group(1)
        ctype = param.split(f" {name} [[")[0].replace("constant ", "").replace("device ", "").strip()
        if name in POOL_NAMES:
            call.append(f"counted<{ctype.rstrip('*').strip()}>{{({ctype})g_in[{names.index(name)}], "
                        f"&g_bytes[{names.index(name)}]}}")
        elif name in names:
            call.append(f"({ctype})g_in[{names.index(name)}]")
        elif name.endswith("_shape"):
            call.append(f"({ctype})g_shape[{names.index(name[:-6])}]")
        elif name == "out":
            call.append(f"({ctype})g_out")
        else:
            assert name in ATTRIBUTES, f"the emulator does not model the Metal attribute {name}"
            call.append(ATTRIBUTES[name])
    signature = re.sub(r"(const device \w+\*) (\w+) \[\[", lambda m: (
        f"counted<const {m.group(1).split()[2].rstrip('*')}> {m.group(2)} [[" if m.group(2) in POOL_NAMES
        else m.group(0)), generated)
    return f"""
namespace {key} {{
{without_instantiation(signature)}
static void** g_in; static int** g_shape; static void* g_out; static unsigned long long* g_bytes;
static uint gy, gz, g_threads;
static void thread(int i) {{ uint tid = i; {fn}<{targs}>({", ".join(call)}); }}
}}
extern "C" int run_{key}(void** in, int** shape, void* out, unsigned long long* bytes, int threads, int groups_y,
                         int groups_z) {{
  using namespace {key};
  g_in = in; g_shape = shape; g_out = out; g_bytes = bytes; g_threads = threads;
  for (gz = 0; gz < (uint)groups_z; ++gz)
    for (gy = 0; gy < (uint)groups_y; ++gy)
      if (run_group(threads, thread)) return 1;
  return 0;
}}
"""


_AS_BITS = {mx.float16: mx.uint16, mx.bfloat16: mx.uint16}


class Emulator:
    """Kernels built on demand, one shared library per batch of new pipelines, cached on disk by source.

    `add(kernel, launch, names)` registers the pipeline of a launch (built at the next `build()`);
    `run(kernel, launch, names)` runs one launch: (output as an mx.array, {input name: bytes read}).
    """

    def __init__(self, work_dir: Path, cxx: str | None = None):
        self.dir, self.cxx = Path(work_dir), cxx or compiler()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.pending: dict[str, str] = {}  # key -> C++ of pipelines not built yet
        self.libs: dict[str, ctypes.CDLL] = {}  # key -> the library that has run_<key>
        self.sources: dict[str, str] = {}  # key -> MLX's generated source
        self._keys: dict[tuple, str] = {}  # what MLX names a kernel by -> key (saves generating the source again)

    def key(self, kernel, launch: dict, names) -> str:
        """The pipeline of a launch (registered to be built if new): what MLX's kernel name depends on."""
        sig = (id(kernel), tuple(map(str, launch["template"])), tuple(launch["output_dtypes"]),
               tuple((a.dtype, a.ndim == 0, a.size < 8) for a in launch["inputs"]))
        if sig not in self._keys:
            generated = generated_source(kernel, launch, self.dir / "gen")
            key = "k" + hashlib.sha1(generated.encode()).hexdigest()[:16]
            if key not in self.libs and key not in self.pending:
                self.sources[key] = generated
                self.pending[key] = emulator_cpp(key, generated, list(names))
            self._keys[sig] = (key, kernel)  # the kernel kept alive: its id stays unique
        return self._keys[sig][0]

    def build(self, jobs: int = 2) -> None:
        """Compile the pending pipelines, in `jobs` libraries built side by side (the CI host has 2 cores)."""
        keys = sorted(self.pending)
        if not keys:
            return
        procs = []
        for part in (keys[i::jobs] for i in range(min(jobs, len(keys)))):
            code = SHIM + "".join(self.pending[k] for k in part)
            digest = hashlib.sha1((code + self.cxx + " ".join(compile_flags(self.cxx))).encode()).hexdigest()[:16]
            lib_path = self.dir / f"kernels_{digest}.so"
            proc = None
            if not lib_path.exists():
                cpp = self.dir / f"kernels_{digest}.cpp"
                cpp.write_text(code)
                proc = subprocess.Popen([self.cxx, *compile_flags(self.cxx), "-o", f"{lib_path}.tmp", str(cpp)],
                                        stderr=subprocess.PIPE, text=True)
            procs.append((part, lib_path, proc))
        for part, lib_path, proc in procs:
            if proc is not None:
                err = proc.communicate()[1]
                assert proc.returncode == 0, err[-4000:]
                os.replace(f"{lib_path}.tmp", lib_path)
            lib = ctypes.CDLL(str(lib_path))
            for k in part:
                self.libs[k] = lib
        self.pending.clear()

    def run(self, kernel, launch: dict, names) -> tuple[mx.array, dict]:
        key = self.key(kernel, launch, names)
        self.build()
        ins = [np.ascontiguousarray(np.array(a.view(_AS_BITS[a.dtype]) if a.dtype in _AS_BITS else a))
               for a in launch["inputs"]]
        shapes = [np.array(a.shape, np.int32) for a in ins]
        dtype = launch["output_dtypes"][0]
        out = np.zeros(launch["output_shapes"][0], np.uint16 if dtype in _AS_BITS else np.dtype(str(dtype).split(".")[-1]))
        counts = np.zeros(len(ins), np.uint64)
        int_p = ctypes.POINTER(ctypes.c_int)
        (tx, ty, tz), (gx, gy, gz) = launch["threadgroup"], launch["grid"]
        assert math.ceil(gx / tx) == 1 and ty == tz == 1
        rc = getattr(self.libs[key], f"run_{key}")(
            (ctypes.c_void_p * len(ins))(*[a.ctypes.data for a in ins]),
            (int_p * len(ins))(*[s.ctypes.data_as(int_p) for s in shapes]),
            ctypes.c_void_p(out.ctypes.data), counts.ctypes.data_as(ctypes.POINTER(ctypes.c_ulonglong)), tx, gy, gz)
        assert rc == 0, "divergent simd_sum or barrier in the kernel"
        result = mx.array(out).view(dtype) if dtype in _AS_BITS else mx.array(out)
        return result, {n: int(c) for n, c in zip(names, counts) if c}
