"""Which paged attention a decode forward runs on Metal: the fused kernel or the reference, per shape class.

`select_attention` (the engine's `--attention reference|metal|auto`) checks the kernel at
start-up and returns a `KernelDispatch`. ForwardContext.attend asks it `use_kernel` for
every decode or verify call (q_len <= 8; prefill never comes here), and it decides once per
*shape class*:

    class = (dtype, head_dim, block_size, KV bits and group, n_heads, n_kv_heads, q_len,
             window, chunk, soft-cap, sinks?, table width and batch, each rounded up to a power of 2)

1. Checked before use: the first call in a class runs the kernel against the reference on a
   random problem of that class (its widest table and largest batch), evaluated. That compiles
   and dispatches the class's pipeline, so a compile error or a refused threadgroup shows up
   here, not inside a forward. A class that fails uses the reference (one warning per class).
2. Threadgroup size: 256 threads (metal_attention.default_simdgroups). MLX refuses a dispatch
   above the pipeline's maxTotalThreadsPerThreadgroup ("... greater than the maximum allowed
   threads per threadgroup (M)"): the check then retries with M / 32 simdgroups, kept for
   that pipeline.
3. auto chooses by speed: kernel and reference are timed on the call's own inputs (`timer`,
   injected in tests), once per class, and the faster is kept. A single row whose blocks are
   a contiguous run never gets here: ForwardContext reads it as one slice into MLX's SDPA,
   mlx-lm's own zero-copy path (`prefers_slice`). "metal" skips the timing.
4. A kernel error at a call: the reference from then on, with one warning.

NOTE: MLX evaluates lazily, so a kernel that fails inside a forward fails at the engine's
evaluation, where nothing can fall back; step 1 is what keeps that from happening: no class
reaches a forward before its pipeline ran, evaluated, and matched the reference.
"""

from __future__ import annotations

import re
import warnings

import mlx.core as mx

from macinfer.errors import MacinferError
from macinfer.kv import metal_attention as ma
from macinfer.kv.paged_attention import QuantPool
from macinfer.timing import median_ms

MODES = ("reference", "metal", "auto")
_THREAD_LIMIT = re.compile(r"maximum allowed threads per threadgroup \((\d+)\)")


class MetalAttentionWarning(RuntimeWarning):
    """The Metal kernel failed to compile or run, or disagreed with the reference; the reference is used."""


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def median_seconds(fn) -> float:
    """The default timer: median seconds of mx.eval(fn()) over 5 runs after a warm-up."""
    return median_ms(fn, 5) / 1e3


def kernel_supports(queries, k_pool, v_pool, *, sinks=None, softcap=None) -> bool:
    """Whether the kernel computes this call: the dtypes it is checked in, one head_dim for Q, K and V,
    float pools or quantised pools of one bits and group (and not sinks with soft-capping,
    which the reference refuses too)."""
    D = queries.shape[-1]
    quantized = isinstance(k_pool, QuantPool)
    return (queries.dtype in ma.SUPPORTED_DTYPES and k_pool.shape[-1] == D and v_pool.shape[-1] == D
            and quantized == isinstance(v_pool, QuantPool)
            and (not quantized or k_pool[3:] == v_pool[3:])
            and not (sinks is not None and softcap is not None))


class KernelDispatch:
    """The kernel behind the reference's signature, with per-class checks, timing and fallback (module docstring).

    Args:
        mode: "auto" (kernel or reference by speed) or "metal" (the kernel wherever it passes).
        kernel_fn: fn(..., n_simdgroups=None), `metal_attention.paged_attention_metal`'s signature.
        reference_fn: the reference (macinfer.kv.paged_attention.paged_attention).
        timer: timer(fn) -> seconds of evaluating fn() (default `median_seconds`).
    """

    def __init__(self, mode: str, kernel_fn, reference_fn, timer=None):
        self.mode, self.kernel_fn, self.reference_fn = mode, kernel_fn, reference_fn
        self.timer = timer or median_seconds
        self.prefers_slice = mode == "auto"  # ForwardContext: one contiguous row -> the reference's slice
        self.simdgroups: dict[tuple, int] = {}  # pipeline -> simdgroups per threadgroup
        self.choices: dict[tuple, str] = {}  # shape class -> "kernel" | "reference"
        self.failed: str | None = None  # the run-time error that turned the kernel off

    # -- keys ---------------------------------------------------------------------------------
    @staticmethod
    def _pipeline(queries, k_pool, block_size) -> tuple:
        quant = k_pool[3:] if isinstance(k_pool, QuantPool) else None
        return (str(queries.dtype), queries.shape[-1], block_size, quant)

    def shape_class(self, queries, k_pool, tables, *, block_size, window=None, chunk=None, softcap=None,
                    sinks=None) -> tuple:
        B, H, QL, _ = queries.shape
        return (*self._pipeline(queries, k_pool, block_size), H, k_pool.shape[0], QL, window, chunk, softcap,
                sinks is not None, _pow2(tables.shape[1]), _pow2(B))

    # -- the decision -------------------------------------------------------------------------
    def use_kernel(self, args: dict, tables: mx.array) -> bool:
        """Whether this call goes to the kernel.

        Args:
            args: the reference's keyword arguments for the call (queries, k_pool, v_pool,
                block_tables as host lists, context_lens, block_size, scale, window, sinks[, softcap, chunk]).
            tables: the padded int32 (B, W) tables the kernel reads (metal_attention.padded_tables).
        """
        q, k, v = args["queries"], args["k_pool"], args["v_pool"]
        extra = {n: args.get(n) for n in ("window", "chunk", "softcap", "sinks")}
        if self.failed or not kernel_supports(q, k, v, sinks=extra["sinks"], softcap=extra["softcap"]):
            return False
        key = self.shape_class(q, k, tables, block_size=args["block_size"], **extra)
        if key not in self.choices:
            self.choices[key] = self._decide(key, args, tables)
        return self.choices[key] == "kernel"

    def _decide(self, key: tuple, args: dict, tables: mx.array) -> str:
        failure = self._check_class(key, args)
        if failure:
            warnings.warn(f"{failure}; this shape class uses the reference attention", MetalAttentionWarning,
                          stacklevel=4)
            return "reference"
        if self.mode != "auto":
            return "kernel"
        memo: dict = {}  # the reference's per-forward arrays, built once as in a real forward
        kernel_s = self.timer(lambda: self(**{**args, "block_tables": tables}))
        reference_s = self.timer(lambda: self.reference_fn(**args, memo=memo))
        return "kernel" if kernel_s < reference_s else "reference"

    def _check_class(self, key: tuple, args: dict) -> str | None:
        """Kernel vs reference on a random problem of this class. Returns None, or why the class cannot
        use the kernel."""
        problem = class_problem(key, args)
        failure = self.checked(key[:4], lambda fn: ma.check_case(fn, self.reference_fn, problem))
        return failure and f"the Metal paged-attention kernel disagrees with the reference or fails ({failure}; " \
                           f"class {key})"

    def checked(self, pipe: tuple, check) -> str | None:
        """check(kernel_fn) -> None or a failure, run at the pipeline's simdgroups: a dispatch refused
        over the pipeline's thread limit is retried once at that limit, kept for the pipeline.
        Returns check's answer, or the kernel's error as one line."""
        for _ in range(2):
            nsg = self.simdgroups.setdefault(pipe, ma.default_simdgroups(pipe[1]))
            try:
                return check(lambda *a, **k: self.kernel_fn(*a, **k, n_simdgroups=nsg))
            except Exception as e:
                limit = _THREAD_LIMIT.search(str(e))
                if not (limit and int(limit.group(1)) // ma.SIMD_WIDTH < nsg):
                    return f"{type(e).__name__}: {e}"
                self.simdgroups[pipe] = max(1, int(limit.group(1)) // ma.SIMD_WIDTH)
        return f"still over the thread limit at {nsg} simdgroups"

    # -- the call ----------------------------------------------------------------------------
    def __call__(self, queries, k_pool, v_pool, block_tables, context_lens, *, block_size, scale, window=None,
                 sinks=None, softcap=None, chunk=None):
        extra = {k: x for k, x in (("softcap", softcap), ("chunk", chunk)) if x is not None}
        pipe = self._pipeline(queries, k_pool, block_size)
        if not self.failed:
            try:
                return self.kernel_fn(queries, k_pool, v_pool, block_tables, context_lens, block_size=block_size,
                                      scale=scale, window=window, sinks=sinks, **extra,
                                      n_simdgroups=self.simdgroups.get(pipe))
            except Exception as e:
                self.failed = f"{type(e).__name__}: {e}"
                warnings.warn(f"the Metal paged-attention kernel failed at run time ({self.failed}); "
                              "using the reference attention from now on", MetalAttentionWarning, stacklevel=2)
        return self.reference_fn(queries, k_pool, v_pool, block_tables, context_lens, block_size=block_size,
                                 scale=scale, window=window, sinks=sinks, **extra)


def class_problem(key: tuple, args: dict) -> dict:
    """A random problem of a shape class: its widest table (one row) beside short ragged rows,
    up to its largest batch (the rounded-up sizes, so one check covers the whole class)."""
    dtype_name, D, BS, quant, H, KVH, QL, window, chunk, softcap, sinks, width, batch = key
    longest = width * BS - 1
    lens = [longest] + [min(longest, QL + (5 * b) % (3 * BS)) for b in range(1, batch)]
    return ma.random_problem(
        len(lens) + width, context_lens=lens, q_len=QL, n_heads=H, n_kv_heads=KVH, head_dim=D, block_size=BS,
        dtype=args["queries"].dtype, window=window, chunk=chunk, softcap=softcap, sinks=sinks,
        kv_bits=quant[0] if quant else None, kv_group=quant[1] if quant else 32)


def select_attention(mode: str, reference_fn, *, head_dim: int = 64, block_size: int = 16, timer=None):
    """Pick the attention implementation for `--attention reference|metal|auto`.

    "reference" returns reference_fn. Otherwise, on a host with Metal, the kernel is
    compiled and checked against reference_fn on `metal_attention.self_check_cases`
    (all three dtypes, the engine's head_dim and block_size); if it passes, a
    `KernelDispatch` takes over (each shape class is checked again before its first use).
    Without Metal the kernel is never called. Call it once per engine.

    Args:
        mode: "reference", "metal" (the kernel or an error) or "auto" (the kernel if it
            passes, else the reference with one `MetalAttentionWarning`; then by speed).
        reference_fn: the gather + SDPA path (macinfer.kv.paged_attention.paged_attention).
        head_dim, block_size: the engine's, so the start-up check runs its instantiation.
        timer: for KernelDispatch (tests).

    Returns:
        (fn, backend_name): fn has reference_fn's signature; backend_name is "metal" or "reference".

    Example:
        >>> fn, backend = select_attention("auto", paged_attention)  # on Linux:
        >>> backend
        'reference'
    """
    if mode not in MODES:
        raise ValueError(f"attention mode must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "reference":
        return reference_fn, "reference"
    if not ma.metal_available():
        if mode == "metal":
            raise MacinferError("--attention metal needs Metal (Apple silicon); use auto or reference here")
        return reference_fn, "reference"
    dispatch = KernelDispatch(mode, ma.paged_attention_metal, reference_fn, timer)
    pipe = (str(mx.float32), head_dim, block_size, None)  # the simdgroups found here serve every dtype's check
    try:
        ma.build_kernel()
        failure = dispatch.checked(pipe, lambda fn: ma.self_check(fn, reference_fn, head_dim=head_dim,
                                                                  block_size=block_size))
    except Exception as e:
        failure = f"{type(e).__name__}: {e}"
    if failure is not None and not failure.startswith("the Metal"):  # an error, not a disagreement
        failure = f"the Metal paged-attention kernel failed to compile or run ({failure})"
    if failure is None:
        return dispatch, "metal"
    if mode == "metal":
        raise MacinferError(failure)
    warnings.warn(f"{failure}; using the reference attention (gather + SDPA)", MetalAttentionWarning, stacklevel=2)
    return reference_fn, "reference"
