"""The batched decode forward, and a verify forward of a few rows, as one compiled MLX graph, traced
once per shape (CPU backend).

On MLX's CPU backend every op of a step costs a few microseconds of dispatch whatever its
size, and a small model's decode step is mostly that: hundreds of ops, most of them elementwise
chains, broadcasts and reshapes, many from the fallbacks MLX uses for `mx.fast` ops without
Metal (RMSNorm, RoPE, SDPA). `mx.compile` fuses
those chains into single ops and drops the views, much as vLLM captures a CUDA graph of its
decode step: traced once for a shape, replayed every step after.

What a replay may depend on must be an input of the compiled function, never a value baked in
while tracing. So everything a paged forward derives from the host's block tables is built
before the call and handed in: the rows' rope offsets, their write slots, the padded block tables
and the masks (`batch_tables`, `batch_mask`); the KV pools and the rows' recurrent states go
in as inputs and come back as outputs. The batch is padded to `batch_bucket` rows (padding rows
read and write the null block) and the slot table to `block_bucket` blocks, so that the shapes,
and with them the trace, change rarely: a trace costs several eager builds.

    host (each step)                       compiled (once per shape)
    ─────────────────────────────────      ───────────────────────────────────────────
    set_context / states.bind              model(tokens, cache=caches)  -> logits
    offsets, write slots, slot table,      pools' writes, states' new values
    masks, pools, states  ───inputs──▶     ───outputs──▶ set back on the caches

A verify forward (speculative decoding: rows of 1 + k tokens, `verify_logits`) returns every
position's logits, and the final hidden states where a feature draft reads them. It compiles for a
model of any size while rows x hidden size stay within VERIFY_MAX_ELEMENTS: a step that drafts is
synchronous (the draft needs the step before's tokens), so the host builds its graph while nothing
computes, 3.4 ms a step eagerly on SmolLM2-135M, and the fused chains dispatch fewer ops.

Guards, since a wrong replay would be silent:
- Only models whose every paged cache is a plain PagedKVCache (decode: state layers' SlotCache too;
  verify: no state layers), with no kernel dispatch; a decode with no hidden-state sink. A lone
  decode row is padded to two: one row would take paged attention's slice path, sized by host ints
  that a trace would bake in; a verify forward's lone row takes the batch path instead (the
  host's tables in the memo say so), at no measured cost.
- A trace that adds a memo entry the host did not build (the forward built an array from host
  data: a prompt window, a kernel's tables) is discarded, and the model runs eagerly for good.
- The first replay (not the tracing call, which computes what the eager forward would) is checked
  against the eager forward on the same inputs, bit for bit (logits, pools and states); any
  difference turns compiling off for the runner, with one log line. Fused elementwise kernels compute what the separate ops do here (MLX builds them without
  -march, so no contracted multiply-adds), so the check passes where nothing was baked in.
"""

from __future__ import annotations

import logging

import mlx.core as mx
from mlx.utils import tree_flatten

from macinfer.kv.paged_attention import batch_mask, batch_tables
from macinfer.kv.paged_cache import PagedKVCache

log = logging.getLogger("macinfer.core.decode_graph")

# Left to `auto`, only models up to this many bytes of weights compile: the fused CPU kernels are
# scalar loops, so what the fusion saves in dispatch is lost again on wide activations
# (docs/platform.md#cpu-compile has the crossover as measured).
SMALL_MODEL_BYTES = 48 << 20
MAX_GRAPHS = 32  # compiled shapes kept (least recently used dropped): each holds a traced graph
# A verify forward (1 + k tokens a row) compiles while its rows x hidden size stay this small, where
# dispatch outweighs the fused kernels' scalar loops (docs/platform.md#cpu-compile).
VERIFY_MAX_ELEMENTS = 4096
_POOLS = ("k_pool", "v_pool")
# Memo entries a traced forward may add itself: built from its inputs or from constants only.
_PURE_MEMO = ("rope", "rope_full", "rope_perm", "cpu", "head_blocks")


def pays_off(model) -> bool:
    """Whether compiling the decode forward is expected to pay: a small model (SMALL_MODEL_BYTES)."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters())) <= SMALL_MODEL_BYTES


class DecodeGraph:
    """Runs a ModelRunner's batched decode forward through mx.compile where that is exact.

    Args:
        runner: the ModelRunner whose model, caches and ForwardContext the forward uses.
    """

    def __init__(self, runner, decode: bool = True, verify: bool = False):
        self.runner = runner
        self.enabled = all(type(c) is PagedKVCache for c in runner.pool_caches)
        self.decode, self.verify = decode, verify  # which forwards run compiled
        self._fns: dict[tuple, object] = {}
        self._checked: set[str] = set()  # the kinds whose first replay matched the eager forward
        self.num_traces = 0  # how many shapes were traced (tests; a steady batch traces once per bucket)
        self.num_setups = 0  # forwards that traced or were checked against the eager one: slower than their kind

    def release(self) -> None:
        """Drop the compiled graphs (LLMEngine.release_thread: before the thread that traced them ends).

        A compiled function erases its traces from the cache of the thread that created it; called
        from another thread, it would leave traces there. The next step traces again, on its thread.
        """
        self._fns.clear()

    def usable(self, seqs: list) -> bool:
        """Whether this decode batch may run compiled: a model that takes a batch's offsets as an array
        (a lone row is padded to two), each row with a state to pad beside, if the model has state layers."""
        r = self.runner
        return (self.enabled and self.decode and r.batch_decode and r.ctx.attention_fn is None
                and r.hidden_sink is None and (r.states is None or r.states.all_held(seqs)))

    def verifies(self, rows: int, L: int) -> bool:
        """Whether a verify forward of `rows` rows of L tokens may run compiled: a model without state
        layers or image inputs whose offsets may be an array, a few rows of narrow activations."""
        r = self.runner
        width = getattr(getattr(r.model, "args", None), "hidden_size", None)
        return (self.enabled and self.verify and r.batch_decode and r.ctx.attention_fn is None
                and r.states is None and r.images is None and width is not None
                and rows * L * width <= VERIFY_MAX_ELEMENTS)

    def logits(self, seqs: list, tokens: mx.array) -> mx.array:
        """The next-token logits (B, V) of one decode row per sequence; `tokens` (B,) are their input ids.

        Sets the forward's context itself (ModelRunner.set_context, states.bind), with the batch padded
        to `batch_bucket(B)` rows that read and write the null block only. The caches hold the
        forward's pools and states afterwards, as an eager forward leaves them.
        """
        B = len(seqs)
        pad = batch_bucket(B) - B
        args, memo = self._inputs(seqs, tokens, pad)
        out = self._run(args, memo)
        self.runner.ctx.offsets, self.runner.ctx.memo = args[1], {}  # nothing after may read the trace's arrays
        logits, pools, states = out
        if pad:
            logits, states = logits[:B], [[a[:B] for a in layer] for layer in states]
        self._set(pools, states)
        return logits

    def verify_logits(self, tables: list[list[int]], starts: list[int], tokens: list[list[int]],
                      prompt_lens: list[int] | None, hidden: bool) -> tuple[mx.array, mx.array | None]:
        """A forward holding drafts (ModelRunner.run_forward's plan, all logits): (logits (B, L, V), the
        final hidden states (B, L, D) if `hidden`, else None). No rows are padded: a lone row reads its
        context through the batch path (whole blocks, masked), as every compiled forward does."""
        r = self.runner
        L = r.set_context(tables, starts, [len(t) for t in tokens], prompt_lens)
        r.ctx.offsets = mx.array(starts, dtype=mx.int32)  # an input: a host int would be a constant of the trace
        memo = self._host_memo(L)
        pools = [[getattr(c, a) for a in _POOLS] for c in r.pool_caches]
        inputs = mx.array([t + [0] * (L - len(t)) for t in tokens], dtype=mx.int32)
        args = (inputs, r.ctx.offsets, list(memo.values()), pools, [])
        out = self._run(args, memo, "hidden" if hidden else "logits")
        r.ctx.memo = {}  # nothing after may read the trace's arrays
        result, pools, _ = out
        self._set(pools, [])
        return result[0], (result[1] if hidden else None)

    def _inputs(self, seqs: list, tokens: mx.array, pad: int) -> tuple[tuple, dict]:
        """The compiled function's arguments for these rows plus `pad` null rows, and the memo they came from."""
        r = self.runner
        B = len(seqs)
        r.set_context([s.block_table for s in seqs] + [[0]] * pad, [s.num_computed_tokens for s in seqs] + [0] * pad,
                      [1] * (B + pad), [s.num_prompt_tokens for s in seqs] + [1] * pad)
        if r.states is not None:
            r.states.bind(seqs, [1] * B, 1)
        memo = self._host_memo()
        pools = [[getattr(c, a) for a in _POOLS] for c in r.pool_caches]
        states = [] if r.states is None else [[_pad_rows(a, pad) for a in c.cache] for c in r.states.layers]
        if tokens.dtype != mx.uint32:  # one dtype, one trace (argmax and the samplers give uint32)
            tokens = tokens.astype(mx.uint32)
        if pad:
            tokens = mx.concatenate([tokens, mx.zeros((pad,), tokens.dtype)])
        return (tokens.reshape(-1, 1), r.ctx.offsets, list(memo.values()), pools, states), memo

    def _run(self, args: tuple, memo: dict, kind: str = "last") -> tuple:
        """(result, pools, states) from the compiled graph of these shapes, or eagerly where it is not exact.

        kind: what the forward returns (`_compute`): the last position's logits (a decode step), every
        position's logits, or those and the final hidden states (a verify step, for a feature draft)."""
        keys = tuple(memo)
        key = (kind, keys, args[0].shape, memo["tables"].shape[1])
        fn = self._fns.pop(key, None) or mx.compile(self._traced(keys, kind))
        self._fns[key] = fn  # most recently used last
        while len(self._fns) > MAX_GRAPHS:
            self._fns.pop(next(iter(self._fns)))
        traces = self.num_traces
        try:
            out = fn(*args)
        except _NotPure:
            self.num_setups += 1
            self.enabled = False
            log.info("decode forward not compiled: it builds arrays from host data while tracing")
            return self._eager(args, memo, kind)
        if kind not in self._checked and self.num_traces == traces:  # a replay: a baked host value would show now
            out = self._check(out, args, memo, kind)
        elif self.num_traces != traces:
            self.num_setups += 1
        return out

    # -- the traced function -----------------------------------------------------------
    def _traced(self, keys: tuple, kind: str):
        r = self.runner

        def forward(tokens, offsets, memo_values, pools, states):
            self.num_traces += 1  # runs while tracing only
            ctx = r.ctx
            ctx.offsets = offsets
            memo = dict(zip(keys, memo_values))
            self._restore(memo, pools, states)
            result = self._compute(tokens, kind)
            if any(k not in keys and (k[0] if isinstance(k, tuple) else k) not in _PURE_MEMO for k in ctx.memo):
                raise _NotPure
            return result, *self._outputs()

        return forward

    def _compute(self, tokens: mx.array, kind: str):
        """The forward itself: "last" -> logits (B, V); "logits" -> [logits (B, L, V)]; "hidden" ->
        [logits, final hidden states (B, L, D)] (ModelRunner.body and .lm_head: the model split where a
        feature draft reads it)."""
        r = self.runner
        if kind == "last":
            return r.model(tokens, cache=r.caches)[:, -1, :]
        if kind == "logits":
            return [r.model(tokens, cache=r.caches)]
        h = r.body(tokens, cache=r.caches)
        return [r.lm_head(h), h]

    def _host_memo(self, q_len: int = 1) -> dict:
        """What the forward would build from host data: write slots, the padded block tables, their masks.

        NOTE: the tables in the memo send a lone row through paged attention's batch path too
        (macinfer.kv.paged_attention), whose one-row path slices by host ints."""
        r, ctx = self.runner, self.runner.ctx
        bs = r.block_size
        memo: dict = {}
        memo[("write_slots", bs)] = ctx.write_slots(bs)  # slot ids (T,): array offsets never take the one-slice path
        need = max(-(-c // bs) for c in ctx.context_lens)
        batch_tables(memo, ctx.block_tables, ctx.context_lens, bs, min_blocks=block_bucket(need))
        for c in r.pool_caches:
            batch_mask(memo, ctx.context_lens, bs, q_len, c.window, c.chunk)
        return memo

    # -- cache state in and out --------------------------------------------------------
    def _outputs(self) -> tuple[list, list]:
        r = self.runner
        pools = [[getattr(c, a) for a in _POOLS] for c in r.pool_caches]
        states = [] if r.states is None else r.states.forward_states()
        return pools, states

    def _set(self, pools: list, states: list) -> None:
        """Pools and states into the caches (and the states into the forward's batch: StateStore)."""
        r = self.runner
        for c, arrays in zip(r.pool_caches, pools):
            for a, x in zip(_POOLS, arrays):
                setattr(c, a, x)
        if r.states is not None:
            r.states.set_forward_states(states)

    def _restore(self, memo: dict, pools: list, states: list) -> None:
        """The caches as they were before a call (a trace that failed left tracers in them)."""
        self.runner.ctx.memo = dict(memo)
        self._set(pools, states)

    def _eager(self, args: tuple, memo: dict, kind: str = "last") -> tuple:
        """The same forward without compiling: (result, pools, states)."""
        r = self.runner
        tokens, r.ctx.offsets, _, pools, states = args
        self._restore(memo, pools, states)
        return self._compute(tokens, kind), *self._outputs()

    def _check(self, out: tuple, args: tuple, memo: dict, kind: str) -> tuple:
        """The first compiled forward of a kind against the eager one on the same inputs: equal, or
        compiling stops."""
        self.num_setups += 1
        eager = self._eager(args, memo, kind)
        a, b = list(_leaves(out)), list(_leaves(eager))
        self.runner.evaluator.drain()  # nothing may evaluate beside a launched step (macinfer.core.evaluator)
        mx.eval(a, b)
        self._checked.add(kind)
        if len(a) == len(b) and all(mx.array_equal(x, y).item() for x, y in zip(a, b)):
            return out
        self.enabled = False
        log.info("forwards not compiled: the compiled graph differs from the eager one on this model")
        return eager


def batch_bucket(n: int) -> int:
    """Rows a decode batch of n is padded to: a power of two from 2 up to 8, then a multiple of 8.

    A request joining or leaving then retraces only when the count crosses a bucket. A lone row is
    padded too (the module docstring says why).
    """
    if n <= 8:
        return max(2, 1 << (n - 1).bit_length())
    return -(-n // 8) * 8


def block_bucket(n: int) -> int:
    """Blocks a slot table of n is padded to: a multiple of 8 up to 64, then of an eighth of the power of two
    below n (at most 12.5% more keys read, and a few traces per doubling of the context)."""
    if n <= 64:
        return max(8, -(-n // 8) * 8)
    step = (1 << (n.bit_length() - 1)) // 8
    return -(-n // step) * step


def _pad_rows(a: mx.array, pad: int) -> mx.array:
    return mx.concatenate([a, mx.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a


class _NotPure(Exception):
    """A traced forward added a memo entry built from host data (see the module docstring)."""


def _leaves(tree):
    if isinstance(tree, mx.array):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _leaves(x)

