"""The models one server serves: each loaded on the first request naming it, the least recently
used unloaded when a budget (models loaded, or bytes) would be exceeded.

    request "model": B ──▶ ModelPool.acquire("B") ── B loaded? ── yes ─▶ hold B, serve
                                                         │ no
                             one load at a time: make room (unload the least recently used
                             idle models; a busy one is drained first), load B on a worker
                             thread, start its AsyncEngine, take its lease
    response sent ───────▶ ModelPool.release(B)

Design choices:
- The default model (the first one given) is pinned: loaded before the server starts and never
  unloaded, so a server of one model behaves as it always did. The budgets count the others
  (`max_loaded`) or every loaded model's weights and KV pool (`memory`).
- Names: a model is found by the name it is served as and, once loaded, by its directory (as the
  one-model server always accepted); with `discover`, any model `macinfer ls` lists as
  downloaded is served under the name `ls` gives it.
- NOTE: the pool's state changes on the event loop only, so it needs no locks; MLX work (loading,
  freeing) runs on a worker thread. A request holds its model from `acquire` until `release`,
  and a model with holds or streams is never unloaded: a model chosen for unloading takes no new
  request until it is gone (it is drained), and requests for it then load it again.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from macinfer.engine.config import default_kv_memory
from macinfer.modelio.leases import Lease, take
from macinfer.modelio.registry import find_model, list_models
from macinfer.paths import cache_dir
from macinfer.serve.async_engine import AsyncEngine
from macinfer.serve.schemas import APIError
from macinfer.units import fmt_bytes, parse_bytes

log = logging.getLogger("macinfer.serve.server")

POLL_SECONDS = 0.02  # how often a drain (or a request waiting for one) looks again


@dataclass(eq=False)
class ServedModel:
    """One model a server can serve; `llm` and `engine` are set while it is loaded."""

    name: str  # what clients send as "model" (and see in responses)
    spec: str | None  # what the loader takes (a path, catalog name, repo id, `ls` name)
    pinned: bool = False
    context_length: int | None = None  # known before loading when `ls` says it
    llm: Any = None
    engine: AsyncEngine | None = None
    lease: Lease | None = None
    nbytes: int = 0  # weights + KV pool, measured once loaded
    holds: int = 0  # requests between acquire and release
    draining: bool = False
    loading: asyncio.Future | None = None
    last_used: float = 0.0

    @property
    def loaded(self) -> bool:
        return self.engine is not None

    @property
    def busy(self) -> bool:
        return self.holds > 0 or (self.engine is not None and self.engine.num_active > 0)

    def card(self, created: int) -> dict:
        """Its entry in GET /v1/models."""
        ctx = self.llm.info.context_length if self.llm is not None else self.context_length
        card = {"id": self.name, "object": "model", "created": created, "owned_by": "macinfer", "loaded": self.loaded}
        if self.llm is not None:  # the drafter speculative decoding uses (`--draft auto` picks one), or None
            card["draft"] = self.llm.engine.features.drafter
        return card | ({"max_model_len": ctx} if ctx is not None else {})


@dataclass
class PoolOptions:
    """What a server serves besides its default model, and the budget it loads them under.

    Args:
        others: {name: spec} of further models to serve (each loaded by `load(spec)`).
        load: an LLM from a model's spec (run on a worker thread).
        discover: {name: context length or None} of the models `macinfer ls` lists, or None.
        max_loaded: models loaded at once besides the default; None: no limit; 0: the default model
            only (then there are no others to serve or discover: ValueError for `others`).
        memory: bytes the loaded models (the default's included) may take; None: no limit.
        estimate: bytes a model will take once loaded, from its spec (before loading it).
        lease_what: with it, a lease on each loaded model's directory (`macinfer rm` refuses it).
    """

    others: dict[str, str] = field(default_factory=dict)
    load: Callable[[str], Any] | None = None
    discover: Callable[[], dict[str, int | None]] | None = None
    max_loaded: int | None = 1
    memory: int | None = None
    estimate: Callable[[str], int] | None = None
    lease_what: str | None = None

    def __post_init__(self):
        if self.max_loaded == 0:
            if self.others:
                raise ValueError(f"--max-loaded-models 0 serves the default model only, but other models were "
                                 f"given ({', '.join(self.others)}): leave them out or allow 1 or more")
            self.discover = None  # nothing besides the default can be loaded: list nothing else


class ModelPool:
    """{name -> ServedModel}: which models are loaded, under which budget.

    Args:
        default: the pinned model, loaded (`llm` and `engine` set, the engine not yet started).
        start_engine: an LLM's started AsyncEngine, given the model's name (metrics per model).
        options: the other models and the budget (PoolOptions).
    """

    def __init__(self, default: ServedModel, start_engine: Callable[[str, Any], AsyncEngine] | None = None,
                 options: PoolOptions | None = None):
        self.default, self.start_engine = default, start_engine
        o = self.options = options or PoolOptions()
        default.pinned = True
        self.models: dict[str, ServedModel] = {default.name: default}
        for name, spec in o.others.items():
            self.models.setdefault(name, ServedModel(name, spec))
        self.num_loads = self.num_unloads = 0
        self._lock: asyncio.Lock | None = None  # made on the event loop, at the first load

    @property
    def several(self) -> bool:
        """More than one model may be served (metrics then carry a model label)."""
        return len(self.models) > 1 or self.options.discover is not None

    def start(self) -> None:
        """Start the default model's engine and take its lease (the server's start-up)."""
        self.default.engine.start()
        self.default.nbytes = _nbytes(self.default)
        if self.options.lease_what and self.default.llm.info.path is not None:
            self.default.lease = take(self.default.llm.info.path, self.options.lease_what)

    def shutdown(self) -> None:
        for m in self.models.values():
            if m.engine is not None:
                m.engine.shutdown()

    def loaded(self) -> list[ServedModel]:
        return [m for m in self.models.values() if m.loaded]

    # -- finding a model --------------------------------------------------------------
    def find(self, name: str | None) -> ServedModel | None:
        """The model a request's "model" names (None: the default), among those known so far."""
        if name is None:
            return self.default
        for m in self.models.values():
            if name == m.name or (m.llm is not None and name == str(m.llm.info.path)):
                return m
        return None

    async def listing(self) -> list[ServedModel]:
        """Every model this server can serve: the ones known, then the others `ls` lists."""
        if self.options.discover is not None:
            found = await asyncio.to_thread(self.options.discover)
            for name, ctx in found.items():
                if self.find(name) is None and not self._loaded_as(name):
                    self.models[name] = ServedModel(name, name, context_length=ctx)
            # NOTE: a discovered model removed from the disk since (`macinfer rm`, Ollama's delete) is
            # forgotten, unless in use: listed, a request for it would download it again.
            for m in [m for m in self.models.values() if m.name not in found and self._forgettable(m)]:
                del self.models[m.name]
        return list(self.models.values())

    def _forgettable(self, m: ServedModel) -> bool:
        """A discovered model (not the default, not named by --model) that nothing is using."""
        return not (m.pinned or m.name in self.options.others or m.loaded or m.loading is not None or m.holds
                    or m.draining)

    def _loaded_as(self, name: str) -> ServedModel | None:
        """The loaded model `name` resolved to (`--served-model-name` hides the catalog name)."""
        return next((m for m in self.loaded() if m.llm.info.name == name), None)

    async def lookup(self, name: str | None) -> ServedModel:
        m = self.find(name)
        if m is None and self.options.discover is not None:
            m = self._loaded_as(name) or next((x for x in await self.listing() if x.name == name), None)
        if m is None:
            served = ", ".join(f"'{x}'" for x in list(self.models)[:4]) + (", ..." if len(self.models) > 4 else "")
            raise APIError(404, f"the model '{name}' does not exist: this server serves {served} "
                                "(GET /v1/models lists them)", "model", "model_not_found")
        return m

    # -- holding one ------------------------------------------------------------------
    async def acquire(self, name: str | None) -> ServedModel:
        """The model `name` names, loaded and held until `release`.

        Raises:
            APIError: 404 for a model this server does not serve; 503 when it cannot be loaded.
        """
        m = await self.lookup(name)
        while m.draining:  # being unloaded: wait, then load it again
            await asyncio.sleep(POLL_SECONDS)
        m.holds += 1
        try:
            # NOTE: once held, a loaded model is served even if another load chose it for
            # unloading meanwhile: that unload waits for this hold, so waiting for it would deadlock.
            while not m.loaded:
                if m.loading is None:
                    m.loading = asyncio.ensure_future(self._load(m))
                await asyncio.shield(m.loading)
        except BaseException:
            m.holds -= 1
            raise
        m.last_used = time.monotonic()
        return m

    def release(self, m: ServedModel) -> None:
        m.holds -= 1
        m.last_used = time.monotonic()

    # -- loading and unloading --------------------------------------------------------
    async def _load(self, m: ServedModel) -> None:
        self._lock = self._lock or asyncio.Lock()
        try:
            async with self._lock:  # one load (and its unloads) at a time
                if m.loaded:
                    return
                o = self.options
                need = await asyncio.to_thread(o.estimate, m.spec) if o.memory and o.estimate else 0
                await self._make_room(m, need)
                try:
                    llm = await asyncio.to_thread(o.load, m.spec)
                except Exception as e:  # MacinferError or a loader bug: this request fails, the server serves on
                    raise APIError(503, f"could not load the model '{m.name}': {e}", "model",
                                   "model_load_failed", "server_error") from None
                m.llm, m.engine = llm, self.start_engine(m.name, llm)
                m.nbytes, m.last_used = _nbytes(m), time.monotonic()
                if o.lease_what and llm.info.path is not None:
                    m.lease = take(llm.info.path, o.lease_what)
                self.num_loads += 1
                log.info("loaded %s (%s)", m.name, fmt_bytes(m.nbytes))
                await self._make_room(m, 0)  # now with its measured size
        finally:
            m.loading = None

    def _over(self, keep: ServedModel, need: int) -> str | None:
        """Why the loaded models with `keep` (`need` bytes if not loaded yet) exceed the budget, or None."""
        others, o = [x for x in self.loaded() if x is not keep], self.options
        if o.max_loaded is not None and sum(not x.pinned for x in others) + 1 > o.max_loaded:
            return f"at most {o.max_loaded} models besides the default are loaded at once (--max-loaded-models)"
        total = sum(x.nbytes for x in others) + (keep.nbytes if keep.loaded else need)
        if o.memory is not None and total > o.memory:
            return f"the loaded models would take {fmt_bytes(total)}, more than --models-memory {fmt_bytes(o.memory)}"
        return None

    async def _make_room(self, keep: ServedModel, need: int) -> None:
        """Unload the least recently used models other than `keep` (idle ones first) until it fits.

        Raises:
            APIError: 503 when only pinned models are left and `keep` still does not fit (before
                its load; after it, a warning: the measured size was larger than the estimate).
        """
        while (why := self._over(keep, need)) is not None:
            victims = sorted((x for x in self.loaded() if x is not keep and not x.pinned),
                             key=lambda x: (x.busy, x.last_used))  # idle ones first, then least recently used
            if not victims:
                if keep.loaded:
                    log.warning("%s is loaded although %s", keep.name, why)
                    return
                raise APIError(503, f"the model '{keep.name}' cannot be loaded: {why}", "model",
                               "model_too_large", "server_error")
            await self._unload(victims[0])

    async def unload(self, m: ServedModel) -> bool:
        """Unload `m` now, once its running requests have finished (Ollama's keep_alive).

        Returns:
            False when nothing was unloaded: `m` is the pinned default, or not loaded.
        """
        if m.pinned or not m.loaded:
            return False
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:  # not during a load, which may be making room already
            if not m.loaded:
                return False
            await self._unload(m)
        return True

    async def _unload(self, m: ServedModel) -> None:
        """Drain `m` (no new requests; the running ones finish), then free it."""
        m.draining = True
        try:
            while m.busy:
                await asyncio.sleep(POLL_SECONDS)
            engine, m.engine, m.llm, m.nbytes = m.engine, None, None, 0
            try:  # NOTE: once its engine is taken, a cancelled unload (a keep_alive timer) still frees it
                await asyncio.shield(asyncio.to_thread(_free, engine))
            finally:
                if m.lease is not None:
                    m.lease.release()
                    m.lease = None
                self.num_unloads += 1
                log.info("unloaded %s", m.name)
        finally:
            m.draining = False


def _nbytes(m: ServedModel) -> int:
    """A loaded model's weights and KV pool, and its drafter's (weights and KV pool) if it has one."""
    stats = m.llm.engine.kv_stats()
    return m.llm.info.weight_bytes + int(stats.get("pool_bytes") or 0) + int(stats.get("draft_bytes") or 0)


def _free(engine: AsyncEngine) -> None:
    """Stop a model's engine thread and give its arrays' memory back (MLX keeps freed buffers cached)."""
    engine.shutdown()
    gc.collect()
    mx.clear_cache()


def local_models() -> dict[str, int | None]:
    """{name: context length} of the models `macinfer ls` lists as downloaded (PoolOptions.discover).

    A converted GGUF (a directory under cache_dir()/models) is a cache of its GGUF file, not a model
    of its own: it is served under its source's name (the embedded model's is `smollm2-135m`), so
    listing it too would list one model twice.
    """
    conversions = cache_dir() / "models"
    return {m.name: m.context_length for m in list_models(include_catalog=False)
            if m.downloaded and not (m.kind == "home" and m.path is not None and Path(m.path).parent == conversions)}


def estimate_bytes(spec: str, kv_memory: str | int | None) -> int:
    """A model's bytes once loaded, before loading it: its weight files and its KV budget.

    Quantised weights loaded as float take more than their files: the pool measures each model
    once loaded and unloads more if the estimate was short.
    """
    weights = find_model(spec).size_bytes or 0
    return weights + (parse_bytes(kv_memory, "the KV memory budget") if kv_memory else default_kv_memory(weights))
