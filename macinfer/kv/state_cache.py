"""Recurrent state beside the paged KV cache: hybrid linear-attention / SSM models.

Models such as qwen3_next, qwen3_5, lfm2, granitemoehybrid, nemotron_h, falcon_h1 and mamba2
keep, in some (or all) layers, a fixed-size state per sequence in an mlx-lm `ArraysCache`
(a short convolution window, and for the SSM / gated-delta layers a recurrent matrix) instead
of K/V that grows with every token. That state cannot be paged: it is one array per sequence,
valid only for exactly the tokens it has consumed. So each running sequence owns a state
*slot* (macinfer.core.state_pool hands them out) and, for every forward:

    bind(seqs, counts, L)   the rows' states are gathered into one `SlotCache` per state layer
                            (an ArraysCache subclass: mamba and qwen3_next check isinstance),
                            with `lengths` = each row's real new-token count when rows are
                            right-padded to L (None when all rows have L tokens), so the layers
                            mask the padding out of their state exactly as mlx-lm's own
                            BatchGenerator asks them to;
    the model runs          each layer assigns its new states (`cache[k] = new`), which
                            SlotCache records as the batch the rows' slots now live in.

Storage. A slot is not a row of a preallocated pool array but a reference (batch, row) to
the arrays the forward that last ran the sequence produced. Nothing is written in place,
so there is no scatter into a pool and no chance of MLX copying a whole pool because a lazy
gather still aliases it (docs/platform.md, "MLX's CPU backend": in-place pool updates). A decode batch whose rows are the previous forward's rows in the same order
takes those arrays as they are (no op at all, and async scheduling can chain steps lazily);
other row sets take a gather (`a[idx]`) or, across batches, a concatenation of rows. A batch's
arrays are dropped once no slot refers to them, so the memory held is about the running
sequences' states (what the engine reserves in its budget: `bytes_per_slot` x max_num_seqs).

A fresh sequence has no state: when every row of a forward is fresh the layers get None, the
path mlx-lm takes for a new prompt (zeros for a token window, `token_windows`); fresh rows among
others get zeros, which the layers treat
the same (each layer starts from a zero conv window and a zero recurrent state when it has none).

Models whose state layers ignore `lengths` (mamba v1, nemotron_h, ...) are detected with a small
probe at start-up (`honours_lengths`); the runner then only batches rows with equal new-token counts.

Speculative verification: `rollback` points rows that rejected drafts back at the state they had
before the verify forward (kept alive until the next bind), and the runner feeds their accepted
tokens again (macinfer.core.model_runner.ModelRunner.refeed_rejected).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache

from macinfer.errors import MacinferError

_KV_TYPES = (KVCache, RotatingKVCache, ChunkedKVCache)  # attention layers the paged cache serves


@dataclass
class StateSpec:
    """What the probe learnt about one state layer: the shape (without batch) and dtype of each array."""

    shapes: list[tuple[int, ...]]
    dtypes: list[mx.Dtype]
    fresh_zeros: bool = False  # a fresh row starts from zeros, never None (a token window: token_windows)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * d.size for s, d in zip(self.shapes, self.dtypes))


class ModelSpecs(list):
    """inspect_model's result for a model with state layers: the attention LayerSpecs, in order (a list,
    as for any model), plus `states` (one StateSpec per state layer) and `layout`, one entry per
    mlx-lm cache entry: ("kv", i) attention spec i, ("state", j) state layer j, ("list", j, i) a
    CacheList(state j, attention i) (falcon_h1 runs both in every layer), ("kvlist", i, i', ...) a
    CacheList of paged caches (deepseek_v32: the MLA latent and its indexer's keys). `states` may be
    empty (a model whose only special layers are kvlists)."""

    def __init__(self, specs, states: list[StateSpec], layout: list[tuple]):
        super().__init__(specs)
        self.states = states
        self.layout = layout

    @property
    def bytes_per_slot(self) -> int:
        return sum(s.nbytes for s in self.states)


def split_caches(caches: list, model_type: str) -> tuple[list, list, list[tuple]]:
    """mlx-lm's cache list -> (attention caches, state caches, layout) or a MacinferError naming what cannot be paged."""
    kv, states, layout = [], [], []

    def refuse(c):
        raise MacinferError(
            f"{model_type}: layers with a {type(c).__name__} cannot use the paged KV cache yet; "
            "this architecture is not supported by the engine")

    for c in caches:
        if type(c) in _KV_TYPES:
            layout.append(("kv", len(kv)))
            kv.append(c)
        elif type(c) is ArraysCache:
            layout.append(("state", len(states)))
            states.append(c)
        elif type(c) is CacheList and len(c.caches) == 2 and type(c.caches[0]) is ArraysCache \
                and type(c.caches[1]) in _KV_TYPES:
            layout.append(("list", len(states), len(kv)))
            states.append(c.caches[0])
            kv.append(c.caches[1])
        elif type(c) is CacheList and all(type(x) in _KV_TYPES for x in c.caches):
            layout.append(("kvlist", *range(len(kv), len(kv) + len(c.caches))))  # deepseek_v32: latent, indexer
            kv.extend(c.caches)
        else:
            refuse(c if type(c) is not CacheList else next((x for x in c.caches if type(x) not in _KV_TYPES
                                                            and type(x) is not ArraysCache), c))
    return kv, states, layout


def state_specs(states: list, model_type: str, windows: dict | None = None) -> list[StateSpec]:
    """The StateSpecs of the state caches after the (lazy) probe forward filled them; `windows`
    (token_windows) marks the layers whose fresh rows start from zeros."""
    out = []
    for c in states:
        if not c.cache or any(a is None for a in c.cache):
            raise MacinferError(f"{model_type}: a recurrent layer left part of its ArraysCache empty after a forward; "
                                "cannot size its state")
        out.append(StateSpec([tuple(a.shape[1:]) for a in c.cache], [a.dtype for a in c.cache],
                             fresh_zeros=id(c) in (windows or {})))
    return out


def token_windows(model, states: list) -> dict[int, int]:
    """State layers that keep the last few token ids (longcat_flash_ngram's n-gram embedding): id(cache) -> width.

    Such a state holds up to n - 1 ids, fewer while a sequence has seen fewer tokens, so it has no
    fixed size as mlx-lm keeps it. Started from n - 1 zeros instead it always has n - 1, and the
    tokens come out the same: the embedding shifts its context right with zeros filled in
    (`_shift_right`), so a position before the sequence's start reads 0 either way, and only the
    last n - 1 ids are kept. (A position i of the new tokens, s ids of state before them, shifted
    by k <= n - 1: unpadded it reads context[s + i - k], or 0 where that index is negative; after
    n - 1 - s zeros it reads the same index of the same ids, or one of those zeros.)
    """
    body = getattr(model, "model", None)
    ngram = getattr(body, "ngram_embeddings", None)
    if type(ngram).__module__ != "mlx_lm.models.longcat_flash_ngram" or not states:
        return {}
    return {id(states[0]): int(ngram.n) - 1}  # cache[0] of its make_cache: the n-gram's ArraysCache(size=1)


class SlotCache(ArraysCache):
    """One state layer's cache for one forward: its rows' states, per-row `lengths`, and the recorder
    of the new states the layer assigns (StateStore)."""

    def __init__(self, store: "StateStore | None", layer: int, size: int):
        super().__init__(size)
        self.store, self.layer = store, layer

    def __setitem__(self, idx, value):
        if self.store is not None:
            value = self.store._record(self.layer, idx, value)
        self.cache[idx] = value

    def advance(self, N):
        # NOTE: a no-op. ArraysCache's `lengths -= N` updates the array in place, and every state
        # layer of a forward shares the one lengths array (and the mask built from it).
        pass

    @property
    def state(self):
        return [a for a in self.cache if a is not None]

    @property
    def nbytes(self) -> int:
        return 0  # counted by the engine per slot (StateStore.bytes_per_slot), not per layer object

    def is_trimmable(self) -> bool:
        return False


class StateCacheList(CacheList):
    """A per-layer CacheList (falcon_h1's state and attention, deepseek_v32's two paged caches)
    with a state property mx.eval can take."""

    @property
    def state(self):
        return [c.state for c in self.caches]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)


def layout_caches(layout: list[tuple], kv_caches: list, state_layers: list = ()) -> list:
    """The cache list a model is called with, one entry per ModelSpecs.layout entry."""
    out = []
    for entry in layout:
        if entry[0] == "kv":
            out.append(kv_caches[entry[1]])
        elif entry[0] == "state":
            out.append(state_layers[entry[1]])
        elif entry[0] == "kvlist":
            out.append(StateCacheList(*(kv_caches[i] for i in entry[1:])))
        else:
            out.append(StateCacheList(state_layers[entry[1]], kv_caches[entry[2]]))
    return out


class _Batch:
    """The new states of one forward's rows; alive while a slot refers to it."""

    __slots__ = ("arrays", "size")

    def __init__(self, num_layers_k: list[int], size: int):
        self.arrays = [[None] * n for n in num_layers_k]  # [layer][k], filled as the model assigns them
        self.size = size


class StateStore:
    """The per-slot states of every state layer, and the cache objects the model sees.

    Args:
        specs: the model's ModelSpecs (inspect_model); attention caches are built by the runner.
        slot_of: seq -> its state slot (macinfer.core.state_pool.StatePool.slot_of).
        honours_lengths: the state layers keep padding out of a row's state (`honours_lengths(model)`);
            False: the runner batches only rows with equal new-token counts.
    """

    def __init__(self, specs: ModelSpecs, slot_of=None, honours_lengths: bool = True):
        self.specs = specs.states
        self.layout = specs.layout
        self.bytes_per_slot = specs.bytes_per_slot
        self.slot_of = slot_of
        self.layers = [SlotCache(self, j, len(s.shapes)) for j, s in enumerate(self.specs)]
        self.honours_lengths = honours_lengths
        self._where: dict[int, tuple[_Batch, int]] = {}  # slot -> (batch, row) of its current state
        self._current: _Batch | None = None
        self._copy = False
        # The last forward's slots and where each one's state was before it (rollback); a slot
        # released since is no longer among them.
        self._before: tuple[list[int], list[tuple | None]] = ([], [])

    def model_caches(self, kv_caches: list) -> list:
        """The cache list the model is called with: the runner's attention caches and our SlotCaches, per layout."""
        return layout_caches(self.layout, kv_caches, self.layers)

    # -- per forward --------------------------------------------------------------------
    def bind(self, seqs: list, counts: list[int], L: int) -> None:
        """Set every state layer up for a forward of rows (seqs) with counts[b] real new tokens of L."""
        slots = [self.slot_of(s) for s in seqs]
        lengths = None if all(n == L for n in counts) else mx.array(counts, dtype=mx.int32)
        states = self._gather(slots)
        batch = _Batch([len(s.shapes) for s in self.specs], len(slots))
        # Lists, not a dict per forward: a dict of 16+ rows is a large malloc, dear on the engine
        # thread while a step evaluates (docs/platform.md#cpu-host).
        where = self._where
        self._before = (slots, [where.get(slot) for slot in slots])  # for rollback()
        for row, slot in enumerate(slots):
            where[slot] = (batch, row)
        self._current = batch
        # A prefill chunk's conv state is often a view into the chunk's whole (B, L + K - 1, C)
        # input: copy it so the slot does not hold that buffer until the sequence's next forward.
        self._copy = L > 1
        for c, arrays in zip(self.layers, states):
            c.cache = arrays
            c.lengths = lengths
            c.left_padding = None

    def forward_states(self) -> list[list]:
        """The bound forward's new states so far, [layer][k] (what its layers assigned)."""
        return [list(a) for a in self._current.arrays]

    def set_forward_states(self, states: list[list]) -> None:
        """Give the bound forward's rows these states, and its layers these caches (a compiled forward's
        outputs: macinfer.core.decode_graph)."""
        self._current.arrays = [list(a) for a in states]
        for c, arrays in zip(self.layers, states):
            c.cache = list(arrays)

    def _record(self, layer: int, k: int, value: mx.array) -> mx.array:
        if self._current is not None:
            if self._copy:
                value = value[mx.arange(value.shape[0])]  # a gather: a buffer of its own
            self._current.arrays[layer][k] = value
        return value

    def _gather(self, slots: list[int]) -> list[list]:
        where = [self._where.get(s) for s in slots]
        if all(w is None for w in where):  # all fresh: mlx-lm's path for a new prompt (None), or zeros
            return [[mx.zeros((len(slots), *shape), dtype) for shape, dtype in zip(s.shapes, s.dtypes)]
                    if s.fresh_zeros else [None] * len(s.shapes) for s in self.specs]
        first = where[0][0] if where[0] is not None else None
        if first is not None and all(w is not None and w[0] is first for w in where):
            rows = [w[1] for w in where]
            if rows == list(range(first.size)):
                return [list(a) for a in first.arrays]  # the same rows in the same order: as they are
            if rows == list(range(rows[0], rows[0] + len(rows))):
                return [[a[rows[0]: rows[0] + len(rows)] for a in layer] for layer in first.arrays]  # a view
            idx = mx.array(rows, dtype=mx.int32)
            return [[a[idx] for a in layer] for layer in first.arrays]
        # Rows from several batches (a sequence joining the decode batch): runs of consecutive rows of
        # one batch are one slice each (a fresh run is zeros), concatenated.
        runs: list[list] = []  # [batch or None, first row, count]
        for w in where:
            last = runs[-1] if runs else None
            if last is not None and ((w is None and last[0] is None)
                                     or (w is not None and last[0] is w[0] and last[1] + last[2] == w[1])):
                last[2] += 1
            else:
                runs.append([None, 0, 1] if w is None else [w[0], w[1], 1])
        out = []
        for j, spec in enumerate(self.specs):
            per_k = []
            for k, (shape, dtype) in enumerate(zip(spec.shapes, spec.dtypes)):
                parts = [b.arrays[j][k][r: r + n] if b is not None else mx.zeros((n, *shape), dtype) for b, r, n in runs]
                per_k.append(mx.concatenate(parts) if len(parts) > 1 else parts[0])
            out.append(per_k)
        return out

    def rollback(self, seqs: list) -> None:
        """Give these rows of the last forward back the states they had before it (speculative
        verification: the forward also consumed drafts that were rejected)."""
        slots, befores = self._before
        index = {slot: i for i, slot in enumerate(slots)}
        for seq in seqs:
            slot = self.slot_of(seq)
            before = befores[index[slot]]  # KeyError: not in the last forward, or released since
            if before is None:
                self._where.pop(slot, None)
            else:
                self._where[slot] = before

    def all_held(self, seqs: list) -> bool:
        """Whether every one of these sequences has a state, every array of it set (none fresh)."""
        for seq in seqs:
            where = self._where.get(self.slot_of(seq))
            if where is None or any(a is None for layer in where[0].arrays for a in layer):
                return False
        return True

    # -- snapshots (macinfer.core.state_snapshots) ----------------------------------------
    def snapshot(self, slot: int) -> list | None:
        """A copy of slot's state: [layer][k] arrays of shape (1, ...), each a buffer of its own.

        Lazy (the caller evaluates it). A gather, never a slice: a row slice of a contiguous
        batch array may stay a view of the whole batch's buffer. None for a fresh slot.
        """
        where = self._where.get(slot)
        if where is None:
            return None
        batch, row = where
        if any(a is None for layer in batch.arrays for a in layer):
            return None
        idx = mx.array([row], dtype=mx.int32)
        return [[mx.take(a, idx, axis=0) for a in layer] for layer in batch.arrays]

    def restore(self, slot: int, arrays: list) -> None:
        """Give slot the state of a snapshot (shared, not copied: nothing writes a state in place)."""
        self.release(slot)
        batch = _Batch([len(layer) for layer in arrays], 1)
        batch.arrays = [list(layer) for layer in arrays]
        self._where[slot] = (batch, 0)

    # -- slots ----------------------------------------------------------------------------
    def release(self, slot: int) -> None:
        """Forget slot's state (the sequence finished, was preempted, or is about to get a new one)."""
        self._where.pop(slot, None)  # a batch no slot refers to any more goes, arrays and all
        slots, befores = self._before
        if slot in slots:
            i = slots.index(slot)
            del slots[i], befores[i]

    @property
    def num_live_batches(self) -> int:
        return len({id(w[0]) for w in self._where.values()})


class _ProbeCache(SlotCache):
    def __init__(self, size, lengths):
        super().__init__(None, 0, size)
        self.lengths = lengths


def honours_lengths(model) -> bool:
    """Start-up probe: does a right-padded row, with `lengths`, end in the state of the same row unpadded?

    True for the layers that read `cache.lengths` (gated delta, mamba2's SSD, lfm2's conv); False for
    those that fold the padding into their state (mamba v1; nemotron_h in mlx-lm 0.32.2, which masks
    its conv but does not hand `lengths` to ssm_update), which must then run unpadded rows only.
    Runs two tiny forwards for real (mlx-lm's own caches for the attention layers).
    """
    from mlx_lm.models.cache import make_prompt_cache

    def run(tokens, lengths):
        probes = []

        def sub(c):
            if type(c) is ArraysCache:
                probes.append(_ProbeCache(len(c.cache), lengths))
                return probes[-1]
            if type(c) is CacheList:
                return CacheList(*[sub(x) for x in c.caches])
            return c

        caches = [sub(c) for c in make_prompt_cache(model)]
        model(mx.array(tokens), cache=caches)
        mx.eval([p.state for p in probes])
        return probes

    try:
        padded = run([[5, 7, 9], [3, 4, 0]], mx.array([3, 2], dtype=mx.int32))
        alone = run([[3, 4]], None)
    except Exception:  # noqa: BLE001 - cannot tell: unpadded rows only, which is always exact
        return False
    return all(x.shape == y.shape and mx.allclose(x.astype(mx.float32), y.astype(mx.float32), atol=1e-4).item()
               for a, b in zip(padded, alone) for k in range(len(a.cache)) for x, y in [(a.cache[k][1], b.cache[k][0])])
