"""Which paged attention a decode forward runs on Metal: the fused kernel or the reference, per shape class.

`select_attention` (the engine's `--attention reference|metal|auto`) checks the kernel at
start-up and returns a `KernelDispatch`. ForwardContext.attend asks it `use_kernel` for
every decode or verify call (q_len <= 8; prefill never comes here): a dictionary lookup of
the call's *shape class*, which is what Metal compiles for it:

    class = (dtype, head_dim, block_size, KV bits and group, rows per simdgroup, split?)

(macinfer.kv.metal_attention.LaunchPlan: rows per simdgroup is 1, 2 or 4 from G * q_len;
split is whether the context is cut into splits and reduced by a second kernel; batch,
table width, heads, window, chunk, soft-cap and sinks are run-time values of the same
pipeline.) So a model meets at most 6 classes per layer dtype, whatever the batch, the
context or the speculation depth.

1. Checked at start-up, never inside a forward: `prepare` runs every class of the model's
   layers (`class_cases`: windows, chunks, soft-capping, sinks, GQA 1-8, lengths on and off
   block boundaries) against the reference, evaluated. That compiles and dispatches each
   pipeline, so a compile error or a refused threadgroup shows up there. Any failure: the
   reference everywhere (auto, one warning) or an error (metal). A call of a class nobody
   prepared (`misses`; none when the engine prepared its layers) uses the reference.
2. Threadgroup size: at most 256 threads (metal_attention.MAX_SIMDGROUPS). MLX refuses a
   dispatch above the pipeline's maxTotalThreadsPerThreadgroup ("... greater than the maximum
   allowed threads per threadgroup (M)"): the check then retries with M / 32 simdgroups, kept
   for that layer kind.
3. auto chooses by speed: kernel and reference are timed at start-up on one problem per class
   (`timer`, injected in tests), and the faster is kept. "metal" skips the timing. A single row
   whose blocks are a contiguous run never gets here in auto: ForwardContext reads it as one
   slice into MLX's SDPA, mlx-lm's own zero-copy path (`prefers_slice`; "metal" sends it to the
   kernel too).
4. An exception raised while a call is *built* (a kernel that cannot be set up) turns the kernel
   off: the reference from then on, with one warning.

NOTE: MLX evaluates lazily, so a kernel that fails while the GPU runs it fails at the engine's
evaluation, where nothing can fall back; step 1 is what keeps that from happening: every
pipeline a forward can dispatch ran, evaluated, and matched the reference before the first one.
"""

from __future__ import annotations

import re
import warnings

import mlx.core as mx

from macinfer.errors import MacinferError, MacinferWarning
from macinfer.kv import metal_attention as ma
from macinfer.kv.paged_attention import QuantPool
from macinfer.kv.quant import kv_group_size
from macinfer.timing import median_ms

MODES = ("reference", "metal", "auto")
_THREAD_LIMIT = re.compile(r"maximum allowed threads per threadgroup \((\d+)\)")
MAX_Q_LEN = 8  # decode and verify rows (1 + drafts): macinfer.kv.paged_cache.KERNEL_MAX_Q_LEN
# (G, q_len) pairs whose rows per simdgroup are 1, 2 and 4 (R = G * q_len <= 8, <= 16, <= 32).
_ROW_SHAPES = {1: ((1, 1), (3, 2), (4, 2)), 2: ((3, 4), (4, 3)), 4: ((4, 6), (8, 4))}


class MetalAttentionWarning(MacinferWarning):
    """The Metal kernel failed to compile or run, or disagreed with the reference; the reference is used."""


def median_seconds(fn) -> float:
    """The default timer: median seconds of mx.eval(fn()) over 5 runs after a warm-up."""
    return median_ms(fn, 5) / 1e3


def layer_kind(dtype, head_dim: int, kv_bits: int | None = None, kv_group: int | None = None) -> tuple:
    """What a layer fixes of its pipelines: (dtype name, head_dim, (bits, group) or None)."""
    quant = (kv_bits, kv_group_size(head_dim, kv_group)) if kv_bits else None
    return (str(dtype), head_dim, quant)


def attention_layers(specs, kv_bits: int | None = None, kv_group: int | None = None) -> list[tuple]:
    """The distinct `layer_kind`s of a model's paged layers (macinfer.kv.paged_cache.LayerSpec) the kernel can serve."""
    kinds = []
    for s in specs:
        if s.k_head_dim == s.v_head_dim and s.k_head_dim % 8 == 0:
            kind = layer_kind(s.dtype, s.k_head_dim, kv_bits, kv_group)
            if kind not in kinds and any(kind[0] == str(d) for d in ma.SUPPORTED_DTYPES):
                kinds.append(kind)
    return kinds


def _dtype(name: str):
    return next(d for d in ma.SUPPORTED_DTYPES if str(d) == name)


def class_cases(kind: tuple, block_size: int, rps: int, split: bool) -> list[dict]:
    """`random_problem` arguments that land in class (kind, rps, split): GQA and q_len that give rps,
    lengths ending inside and on block boundaries, a window, soft-capping, sinks, chunks; a split
    class has a row long enough to be cut (and a window and a chunk that span several splits)."""
    dtype, D, quant = kind
    BS = block_size
    long = 2 * ma.MIN_SPLIT_TOKENS + 3 * BS + 5 if split else None
    (g1, q1), (g2, q2) = (_ROW_SHAPES[rps] * 2)[:2]
    short = [1 + q1 * (rps > 1), BS, 3 * BS + 5]
    base = dict(head_dim=D, block_size=BS, dtype=_dtype(dtype), kv_bits=quant[0] if quant else None,
                kv_group=quant[1] if quant else 32)
    wide = ma.MIN_SPLIT_TOKENS + BS + 3 if split else 2 * BS + 3
    cases = [
        dict(context_lens=[long] if split else short, q_len=q1, n_heads=2 * g1, n_kv_heads=2, sinks=True),
        dict(context_lens=[long, 2 * BS + 1] if split else [2 * BS, 5 * BS - 1], q_len=q2, n_heads=g2, n_kv_heads=1,
             window=wide, softcap=None if quant else 2.0),
        dict(context_lens=[long + BS, 3 * BS + 2] if split else [3 * BS + 2, 2 * BS + 1], q_len=q1, n_heads=2 * g1,
             n_kv_heads=2, chunk=wide + 5),
    ]
    return [{**base, **c} for c in cases]


class KernelDispatch:
    """The kernel behind the reference's signature, with start-up checks, timing and fallback (module docstring).

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
        self.simdgroups: dict[tuple, int] = {}  # layer kind -> most simdgroups per threadgroup
        self.choices: dict[tuple, str] = {}  # shape class -> "kernel" | "reference"
        self.met: set[tuple] = set()  # classes calls asked for
        self.misses = 0  # calls of a class nobody prepared (they use the reference)
        self.failed: str | None = None  # the error that turned the kernel off
        self._forward: tuple | None = None  # (tables, lens, sinks by layer): the arrays of the current forward
        self.diffs: dict[str, float] = {}  # the checks' largest |kernel - reference| per dtype (macinfer doctor)

    # -- keys ---------------------------------------------------------------------------------
    @staticmethod
    def kind(queries, k_pool) -> tuple:
        quant = k_pool[3:] if isinstance(k_pool, QuantPool) else None
        return (str(queries.dtype), queries.shape[-1], quant)

    def shape_class(self, queries, k_pool, context_lens, *, block_size, window=None, chunk=None) -> tuple:
        kind = self.kind(queries, k_pool)
        B, H, QL, D = queries.shape
        plan = ma.launch_plan(B, H, QL, k_pool.shape[0], D, block_size, ma.context_blocks(context_lens, block_size),
                              window=window, chunk=chunk, max_simdgroups=self.simdgroups.get(kind, ma.MAX_SIMDGROUPS))
        return (*kind, block_size, plan.rows_per_simdgroup, plan.split)

    # -- start-up -----------------------------------------------------------------------------
    def prepare(self, kinds, block_size: int) -> list[str]:
        """Check (and in auto, time) every class of these layer kinds; returns the failures, one line each."""
        failures = []
        for kind in kinds:
            for rps in ma.ROWS_PER_SIMDGROUP:
                for split in (False, True):
                    key = (*kind, block_size, rps, split)
                    failure = self._check_class(key)
                    if failure:
                        failures.append(failure)
                    self.choices[key] = "reference" if failure else self._by_speed(key)
        return failures

    def _check_class(self, key: tuple) -> str | None:
        kind, BS, rps, split = key[:3], key[3], key[4], key[5]
        for i, case in enumerate(class_cases(kind, BS, rps, split)):
            args = ma.random_problem(i, **case)
            failure = self.checked(kind, lambda fn: ma.check_case(fn, self.reference_fn, args, self.diffs))
            if failure:
                verb = "disagrees with the reference" if failure.startswith(("max |diff|", "shape")) else \
                    "failed to compile or run"
                return f"the Metal paged-attention kernel {verb} (class {key}, case {i}: {failure})"
        return None

    def checked(self, kind: tuple, check) -> str | None:
        """check(kernel_fn) -> None or a failure, run at the layer kind's simdgroups: a dispatch refused over
        the pipeline's thread limit is retried at that limit, kept for the kind.
        Returns check's answer, or the kernel's error as one line."""
        for _ in range(2):
            nsg = self.simdgroups.setdefault(kind, ma.MAX_SIMDGROUPS)
            try:
                return check(lambda *a, **k: self.kernel_fn(*a, **k, n_simdgroups=nsg))
            except Exception as e:
                limit = _THREAD_LIMIT.search(str(e))
                if not (limit and int(limit.group(1)) // ma.SIMD_WIDTH < nsg):
                    return f"{type(e).__name__}: {e}"
                self.simdgroups[kind] = max(1, int(limit.group(1)) // ma.SIMD_WIDTH)
        return f"still over the thread limit at {nsg} simdgroups"

    def _by_speed(self, key: tuple) -> str:
        if self.mode != "auto":
            return "kernel"
        args = ma.random_problem(0, **class_cases(key[:3], key[3], key[4], key[5])[0])
        memo: dict = {}  # the reference's per-forward arrays, built once as in a real forward
        kernel_s = self.timer(lambda: self(**args))
        reference_s = self.timer(lambda: self.reference_fn(**args, memo=memo))
        return "kernel" if kernel_s < reference_s else "reference"

    # -- the decision -------------------------------------------------------------------------
    def use_kernel(self, args: dict, tables: mx.array) -> bool:
        """Whether this call goes to the kernel: a lookup, nothing evaluated.

        Args:
            args: the reference's keyword arguments for the call (queries, k_pool, v_pool,
                block_tables as host lists, context_lens, block_size, scale, window, sinks[, softcap, chunk]).
            tables: the padded int32 (B, W) tables the kernel reads (metal_attention.padded_tables).
        """
        q, k, v = args["queries"], args["k_pool"], args["v_pool"]
        if self.failed or not ma.kernel_supports(q, k, v, sinks=args.get("sinks"), softcap=args.get("softcap")):
            return False
        key = self.shape_class(q, k, args["context_lens"], block_size=args["block_size"], window=args.get("window"),
                               chunk=args.get("chunk"))
        self.met.add(key)
        choice = self.choices.get(key)
        if choice is None:
            self.misses += 1
        return choice == "kernel"

    # -- the call ----------------------------------------------------------------------------
    def _inputs(self, tables, context_lens, sinks, n_heads: int) -> tuple:
        """Lengths and sinks as the kernel reads them, built once per forward (per table array) and layer sinks."""
        if self._forward is None or self._forward[0] is not tables:
            self._forward = (tables, ma.padded_lens(context_lens), {})
        by_sinks = self._forward[2]
        key = (id(sinks), n_heads)
        if key not in by_sinks:
            by_sinks[key] = (sinks, ma.padded_sinks(sinks, n_heads))  # keeps sinks alive: its id stays unique
        return self._forward[1], by_sinks[key][1]

    def __call__(self, queries, k_pool, v_pool, block_tables, context_lens, *, block_size, scale, window=None,
                 sinks=None, softcap=None, chunk=None, memo=None):
        extra = {k: x for k, x in (("softcap", softcap), ("chunk", chunk)) if x is not None}
        if not self.failed:
            try:
                tables = block_tables if isinstance(block_tables, mx.array) else \
                    ma.padded_tables(block_tables, context_lens, block_size)
                lens, sink = self._inputs(tables, context_lens, sinks, queries.shape[1])
                return self.kernel_fn(queries, k_pool, v_pool, tables, context_lens, block_size=block_size,
                                      scale=scale, window=window, sinks=sinks, **extra,
                                      n_simdgroups=self.simdgroups.get(self.kind(queries, k_pool)),
                                      lens=lens, sink_array=sink)
            except Exception as e:
                self.failed = f"{type(e).__name__}: {e}"
                warnings.warn(f"the Metal paged-attention kernel failed while a call was built ({self.failed}); "
                              "using the reference attention from now on", MetalAttentionWarning, stacklevel=2)
        return self.reference_fn(queries, k_pool, v_pool, block_tables, context_lens, block_size=block_size,
                                 scale=scale, window=window, sinks=sinks, **extra)


def select_attention(mode: str, reference_fn, *, head_dim: int = 64, block_size: int = 16, timer=None,
                     layers: list[tuple] | None = None):
    """Pick the attention implementation for `--attention reference|metal|auto`.

    "reference" returns reference_fn. Otherwise, on a host with Metal, every shape class the
    engine can dispatch (`KernelDispatch.prepare`) is compiled and checked against reference_fn;
    if they all pass, a `KernelDispatch` takes over. Without Metal the kernel is never called.
    Call it once per engine.

    Args:
        mode: "reference", "metal" (the kernel or an error) or "auto" (the kernel if it
            passes, else the reference with one `MetalAttentionWarning`; then by speed).
        reference_fn: the gather + SDPA path (macinfer.kv.paged_attention.paged_attention).
        head_dim, block_size: the engine's; without `layers`, the kinds checked are head_dim
            in the three dtypes, float pools.
        timer: for KernelDispatch (tests).
        layers: the model's `layer_kind`s (`attention_layers(specs, kv_bits, kv_group)`).

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
    kinds = layers if layers is not None else [layer_kind(d, head_dim) for d in ma.SUPPORTED_DTYPES]
    if not kinds:
        if mode == "metal":
            raise MacinferError("--attention metal: the Metal kernel serves none of this model's attention layers "
                                "(head sizes differ for K and V, or are not a multiple of 8); use auto or reference")
        return reference_fn, "reference"
    dispatch = KernelDispatch(mode, ma.paged_attention_metal, reference_fn, timer)
    try:
        failures = dispatch.prepare(kinds, block_size)
    except Exception as e:
        failures = [f"the Metal paged-attention kernel failed to compile or run ({type(e).__name__}: {e})"]
    failure = failures[0] if failures else None
    if failure is None:
        return dispatch, "metal"
    if mode == "metal":
        raise MacinferError(failure)
    warnings.warn(f"{failure}; using the reference attention (gather + SDPA)", MetalAttentionWarning, stacklevel=2)
    return reference_fn, "reference"
