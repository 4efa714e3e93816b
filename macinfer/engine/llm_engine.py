"""LLMEngine: requests in, streamed deltas out, one scheduled step at a time.

    engine = LLMEngine(model, tokenizer, info, kv_memory="2GB")
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for delta in engine.step():          # StreamDelta per request that moved
            print(delta.text, end="")         # delta.output is set on the last one

A step is schedule -> run -> update -> output (nano-vllm's and vLLM's shape): the scheduler
picks the rows (macinfer.core.scheduler), the runner computes and samples them
(macinfer.core.model_runner), the scheduler appends the tokens, stops what they end and frees it
(`update_from_output`), and the output processor streams the deltas
(macinfer.engine.output_processor). With a drafter, drafts are proposed before scheduling and
acceptance recorded after. The engine is single-threaded: one thread owns it and calls step();
other threads hand it requests through that thread.

Async scheduling (macinfer.engine.pipeline, macinfer.core.async_scheduler): while every running
sequence is plainly decoding, step n+1 is queued before step n's tokens are read back.

Everything the engine uses is built in `__init__`, in dependency order, and handed to what uses
it: nothing is attached afterwards.

KV budget: `kv_memory` (bytes, or "2GB" = 2e9 / "2GiB" = 2**30: macinfer.units) sets the pool size. By
default, on a Mac: the recommended Metal working set minus the weights minus a
margin, at most an eighth of memory (engine/config.py default_kv_memory); elsewhere 1 GiB. Either way it is capped at what max_num_seqs sequences
of full context length could use. `describe()` reports the resulting capacity.
Models with recurrent state layers (macinfer.kv.state_cache) take max_num_seqs state
slots out of the same budget first, and with the prefix cache on their state snapshots
(macinfer.core.state_snapshots; state_snapshot_memory).
"""

from __future__ import annotations

import contextlib
import sys
import time
import uuid

import mlx.core as mx

from macinfer.core.async_scheduler import AsyncScheduler, AsyncStateScheduler
from macinfer.core.block_pool import BlockPool
from macinfer.core.decode_graph import pays_off as decode_graph_pays_off
from macinfer.core.evaluator import StepEvaluator, threads_pay_off
from macinfer.core.grammar import GrammarCompiler
from macinfer.core.model_runner import ModelRunner
from macinfer.core.outputs import StreamDelta
from macinfer.core.sampling import SamplingParams
from macinfer.core.scheduler import Scheduler, SchedulerConfig
from macinfer.core.sequence import Sequence
from macinfer.core.state_pool import StatePool, StateScheduler
from macinfer.core.state_snapshots import StateSnapshots
from macinfer.core.stop_checker import StopChecker
from macinfer.engine.config import EngineConfig, plan_memory, prefix_store, wire_memory
from macinfer.engine.distributed import LeaderRunner, check_model
from macinfer.engine.output_processor import OutputProcessor, RequestTable
from macinfer.engine.pipeline import Pipeline
from macinfer.engine.protocol import EngineFeatures
from macinfer.errors import InvalidGrammar, MacinferError
from macinfer.kv.kernel_dispatch import attention_layers, select_attention
from macinfer.kv.model_probe import forward_evaluates, inspect_model, supports_batched_offsets
from macinfer.kv.paged_attention import paged_attention
from macinfer.modelio.multimodal import MultiModalInputs
from macinfer.prefix_cache.keys import model_identity, prefix_cache_stats
from macinfer.spec_decode.decoder import verify_rows
from macinfer.spec_decode.drafter import drafter_bytes
from macinfer.spec_decode.eagle3 import tapped
from macinfer.spec_decode.speculator import check_exact, make_spec_decoder
from macinfer.units import fmt_bytes


class LLMEngine(RequestTable):
    """Continuous-batching engine over a paged KV cache (macinfer.engine.protocol.Engine).

    Args:
        model: an mlx-lm model.
        tokenizer: mlx-lm's TokenizerWrapper (for EOS ids and streaming text).
        info: macinfer.modelio.loader.ModelInfo, or None (context length then comes from
            max_model_len or the model's config).
        ranks: macinfer.engine.distributed.Ranks when the model is split across processes
            (the leader's runner sends each forward's plan; a follower's only runs them), else None.
        images: a vision-language model's image encoder (macinfer.modelio.vision.ImageEncoder), or None:
            requests may then carry images (add_request's `mm`).
        **options: EngineConfig fields.
    """

    def __init__(self, model, tokenizer, info=None, ranks=None, images=None, **options):
        self.config = config = EngineConfig(**options)
        self.model, self.tokenizer, self.info, self.ranks = model, tokenizer, info, ranks
        if images is not None and ranks is not None:
            raise MacinferError("images are not supported across ranks: run the model in one process")
        self.images = images
        model_type = getattr(info, "model_type", None) or getattr(model, "model_type", "?")
        self.specs = inspect_model(model, model_type)
        if ranks is not None:
            check_model(ranks, self.specs, model_type)
        self.max_model_len = config.max_model_len or (info.context_length if info is not None else
                                                      getattr(getattr(model, "args", None), "max_position_embeddings", None) or 4096)

        # 1. KV capacity: budget -> blocks (block 0 is the null block), state slots and snapshots.
        self.block_size = bs = config.block_size
        plan = plan_memory(config, self.specs, self.max_model_len, getattr(info, "weight_bytes", 0), model_type)
        self.bytes_per_token, self.bytes_per_block = plan.bytes_per_token, plan.bytes_per_block
        self.state_bytes, self.snapshot_bytes, self.kv_budget = plan.state_bytes, plan.snapshot_bytes, plan.kv_budget
        num_blocks = plan.num_blocks if ranks is None else ranks.agree_min(plan.num_blocks)  # each rank's pools fit
        self.max_num_seqs = plan.max_num_seqs  # fewer than config.max_num_seqs where state slots would not fit
        states = bool(getattr(self.specs, "states", None))
        wire_memory()

        # 2. What the runner uses: where launched steps run, attention, grammars, the drafter, state slots.
        cpu_lazy = ranks is None and threads_pay_off() and not forward_evaluates(model)  # one process, lazy forward
        evaluator = _evaluator(config, cpu_lazy)
        attention_fn, self.attention_backend = (
            # every kernel pipeline the model's layers can dispatch, checked here, never inside a forward
            select_attention(config.attention, paged_attention, block_size=bs,
                             layers=attention_layers(self.specs, config.kv_bits, config.kv_group_size))
            if self.specs else (None, "none"))
        self.eos_token_ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
        self.grammars = GrammarCompiler(_hf_tokenizer(tokenizer), _logits_width(model, tokenizer),
                                        list(self.eos_token_ids))
        # draft="auto" says what it found (draft_choice: the -v line, the chat panel, /v1/models).
        self.spec_decoder, self.draft_choice = make_spec_decoder(config, model, tokenizer, info, num_blocks, bs)
        if self.spec_decoder is not None:
            check_exact(self.spec_decoder.drafter, states, model_type)
        # What the drafter holds beyond the model (its weights, its KV pool): fixed once built.
        self.draft_bytes = drafter_bytes(self.spec_decoder.drafter, model) if self.spec_decoder is not None else 0
        self.state_pool = StatePool(self.max_num_seqs, self.specs.bytes_per_slot) if states else None

        # 3. The runner: the KV pools and the model's forwards.
        runner_cls = ModelRunner if ranks is None or not ranks.is_leader else LeaderRunner
        self.runner = runner_cls(
            model, self.specs, num_blocks, bs, batch_decode=supports_batched_offsets(model),
            kv_bits=config.kv_bits, kv_group_size=config.kv_group_size, evaluator=evaluator,
            attention_fn=attention_fn if self.attention_backend != "reference" else None,
            fill_masks=self.grammars.fill_masks, hidden_sink=self.spec_decoder.drafter.hidden_sink if self.spec_decoder else None,
            verifier=verify_rows if self.spec_decoder else None,
            compile_decode=_compiles_decode(config, ranks, model, cpu_lazy, evaluator.threaded),
            compile_verify=self.spec_decoder is not None and _compiles_verify(config, ranks, model, cpu_lazy,
                                                                              evaluator.threaded),
            slot_of=self.state_pool.slot_of if states else None, images=images,
            **({"ranks": ranks} if runner_cls is LeaderRunner else {}))

        # 4. The block pool and its prefix cache. NOTE: models with recurrent state layers use a cached
        # block only with a snapshot of the state after it (macinfer.core.state_snapshots), and those
        # stay in memory: no disk tier for them.
        self.snapshots = (StateSnapshots(self.snapshot_bytes, self.specs.bytes_per_slot)
                          if states and config.enable_prefix_cache else None)
        self.model_id = model_identity(model, info, self.specs, bs) if config.enable_prefix_cache else None
        store = None if self.model_id is None or states else prefix_store(
            config, self.model_id, self.runner.pool_caches, bs, evaluator.drain,
            getattr(info, "name", None), getattr(info, "path", None))
        self.block_pool = BlockPool(num_blocks, bs, enable_caching=self.model_id is not None,
                                    cache_root=bytes.fromhex(self.model_id) if self.model_id else b"", store=store,
                                    on_evict=self.snapshots.drop if self.snapshots is not None else None)

        # 5. The scheduler, the output side and the pipelined step.
        self.scheduler = self._make_scheduler(StopChecker(self.eos_token_ids))
        self.output = OutputProcessor()
        self.pipeline = (Pipeline(self.scheduler, self.runner, self.output, self.spec_decoder)
                         if config.async_scheduling else None)
        self.features = EngineFeatures(
            paged=True, prefix_cache=config.enable_prefix_cache, speculation=self.spec_decoder is not None,
            structured_output=True, drafter=self.spec_decoder.drafter.name if self.spec_decoder is not None else None)
        if config.verbose:
            print(self.describe(), file=sys.stderr)

    def _make_scheduler(self, stop_checker: StopChecker) -> Scheduler:
        """The scheduler, async or not; with state layers, their slot pool (and snapshots) beside the block pool."""
        config = self.config
        sched_config = SchedulerConfig(self.max_num_seqs, config.max_num_batched_tokens, self.runner.batch_decode)
        if self.state_pool is None:
            cls = AsyncScheduler if config.async_scheduling else Scheduler
            return cls(sched_config, self.block_pool, stop_checker)
        cls = AsyncStateScheduler if config.async_scheduling else StateScheduler
        return cls(sched_config, self.block_pool, stop_checker, self.state_pool, self.runner.states, self.snapshots,
                   launch=self.runner.evaluator.launch)

    # -- capacity ---------------------------------------------------------------------
    @property
    def num_tokens_capacity(self) -> int:
        return self.block_pool.num_usable_blocks * self.block_size

    def describe(self) -> str:
        """One line: the KV budget and what it buys."""
        windows = sorted({s.window for s in self.specs if s.window})
        return (
            f"KV cache: {fmt_bytes(self.runner.kv_bytes, binary=True)} of a {fmt_bytes(self.kv_budget, binary=True)} budget -> "
            f"{self.block_pool.num_usable_blocks} blocks x {self.block_size} tokens = {self.num_tokens_capacity} tokens "
            f"({fmt_bytes(self.bytes_per_token, binary=True)}/token, {len(self.specs)} layers"
            + (f", sliding windows {windows}" if windows else "") + f"); "
            f"max {self.max_num_seqs} sequences, {self.config.max_num_batched_tokens} tokens/step; "
            f"attention: {self.attention_backend}"
            + (f"; recurrent state: {self.state_pool.num_slots} slots x "
               f"{fmt_bytes(self.state_pool.bytes_per_slot, binary=True)} = {fmt_bytes(self.state_bytes, binary=True)} "
               f"({len(self.specs.states)} state layers)" if self.state_pool is not None else "")
            + (f"; state snapshots: {fmt_bytes(self.snapshot_bytes, binary=True)}" if self.snapshots is not None else "")
            + (f"; {self.draft_choice.line()}" if self.draft_choice is not None else
               f"; draft: {self.spec_decoder.drafter.name}" if self.spec_decoder is not None else "")
        )

    def kv_stats(self) -> dict:
        """KV usage now: blocks, tokens and bytes reserved vs holding live tokens."""
        pool = self.block_pool
        used = pool.num_usable_blocks - pool.get_num_free_blocks()
        live = sum(s.num_computed_tokens for s in self.scheduler.running)
        return {
            "num_blocks": pool.num_usable_blocks,
            "block_size": self.block_size,
            "used_blocks": used,
            "free_blocks": pool.get_num_free_blocks(),
            "capacity_tokens": self.num_tokens_capacity,
            "live_tokens": live,
            "reserved_bytes": used * self.bytes_per_block,
            "live_bytes": live * self.bytes_per_token,
            "pool_bytes": self.runner.kv_bytes,
            "draft_bytes": self.draft_bytes,
            "usage": pool.usage,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            **prefix_cache_stats(self.block_pool),
            **(self.state_pool.stats() if self.state_pool is not None else {}),
            **(self.snapshots.stats_dict() if self.snapshots is not None else {}),
            **(self.ranks.stats() if self.ranks is not None else {}),
        }

    def prepare(self) -> None:
        """Build the structured-output tokenizer now: on the first request with a schema it would stall
        every stream for a second (macinfer.core.grammar.GrammarCompiler.prepare)."""
        self.grammars.prepare()

    # -- requests -----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    fork_of: str | None = None, mm: MultiModalInputs | None = None) -> str:
        """Queue a request.

        Args:
            prompt: token ids (or text, encoded with the tokenizer).
            params: sampling parameters (default: greedy, 256 tokens).
            request_id: unique id, or None to draw one.
            arrival_time: perf_counter() stamp for metrics (default: now).
            fork_of: the id of an unfinished request with the same prompt (n > 1 samples):
                this one shares its prompt's KV blocks (macinfer.core.scheduler, forks).
            mm: the prompt's images (macinfer.modelio.vision.ImageEncoder.process made it and the ids).

        Returns:
            The request id.

        Raises:
            MacinferError: empty prompt, prompt longer than the context, a prompt whose KV
                could never fit in the pool, a structured output grammar that is invalid, or
                images for a model that does not see.
        """
        params = params or SamplingParams()
        if mm is not None and self.images is None:
            raise MacinferError("this model does not take images: send text only, or a vision-language model")
        grammar = None
        if params.structured is not None:
            try:
                grammar = self.grammars.matcher(params.structured)
            except ValueError as e:
                raise InvalidGrammar(str(e)) from None
        parent = self.output.get(fork_of) if fork_of is not None else None
        with self.runner.evaluator.context():  # a sampler's arrays on the stream the steps use
            seq = new_sequence(self, prompt, params, request_id, arrival_time, grammar=grammar, parent=parent, mm=mm)
        n = len(seq.prompt_token_ids)
        if self.block_pool.num_blocks_for(n) > self.block_pool.num_usable_blocks:
            raise MacinferError(
                f"the prompt is {n} tokens but the KV cache holds {self.num_tokens_capacity} "
                f"({fmt_bytes(self.kv_budget, binary=True)}): raise kv_memory")
        self.output.add(seq)
        self.scheduler.add(seq)
        return seq.request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; its final delta comes with the next step()."""
        seq = self.output.get(request_id)
        if seq is None or seq.is_finished:
            return
        self.scheduler.abort(request_id)
        if self.spec_decoder is not None:
            self.spec_decoder.remove(request_id)
        self.output.aborted(seq)

    def release_thread(self) -> None:
        """Called by a thread that stepped this engine, just before it ends.

        MLX keeps per thread what a thread's forwards made (compiled traces, mlx-lm's @mx.compile
        functions among them, and the random key), holding Python objects. Left to the thread's end,
        they are freed after Python has let go of the thread; if the interpreter is exiting by then,
        their destructor cannot take the GIL and the process aborts ("terminate called without an
        active exception"). mx.clear_streams frees them now, as MLX's own threaded tests do; our
        compiled graphs are dropped first, so another thread traces its own
        (macinfer.core.decode_graph.DecodeGraph.release).
        """
        with contextlib.suppress(Exception):  # a launched step failed that nobody will read: we are ending
            self.runner.evaluator.drain()  # no launched step may still run inside MLX when the thread ends
        if self.runner.decode_graph is not None:
            self.runner.decode_graph.release()
        mx.clear_streams()  # this thread's streams, compile cache and random key; the evaluator's stream is global

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or self.output.has_pending
                or (self.pipeline is not None and self.pipeline.inflight is not None))

    # -- the step -----------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """Run one scheduling step: schedule -> run -> update -> output.

        While every running sequence is plainly decoding, the pipelined variant runs
        instead (macinfer.engine.pipeline): it returns the step before's tokens.

        Returns:
            A StreamDelta for every request that produced text or finished (the
            finished ones carry `output`, the whole RequestOutput).
        """
        with self.runner.evaluator.context():
            deltas = self.output.take_pending()
            if self.pipeline is not None and (self.pipeline.inflight is not None or self.pipeline.start()):
                return deltas + self.pipeline.step()
            return deltas + self._step()

    def _step(self) -> list[StreamDelta]:
        """The synchronous step."""
        t0, setups = time.perf_counter(), self.runner.num_setups
        if self.spec_decoder is not None:
            self.spec_decoder.propose(self.scheduler.running)  # drafts for the decode rows
        out = self.scheduler.schedule()
        sampled = self.runner.execute_model(out.scheduled) if out.scheduled else []
        moved = self.scheduler.update_from_output(out, sampled)
        if self.spec_decoder is not None:  # acceptance and costs; what the drafter held for finished requests
            for seq in out.finished:
                self.spec_decoder.remove(seq.request_id)
            if out.scheduled:
                # A step that traced (a new shape) or checked a compiled forward says nothing about what steps cost.
                took = time.perf_counter() - t0 if self.runner.num_setups == setups else None
                self.spec_decoder.update_from_output(out.scheduled, sampled, took)
        return self.output.deltas(moved)


def new_sequence(engine, prompt, params: SamplingParams | None, request_id: str | None,
                 arrival_time: float | None, grammar=None, parent: Sequence | None = None,
                 mm: MultiModalInputs | None = None) -> Sequence:
    """A checked, not yet queued Sequence for either engine: encoded, non-empty, within the
    engine's context, logit_bias inside the vocabulary, a fresh id.

    Args:
        grammar: its structured output's matcher, or None.
        parent: an unfinished request it forks (n > 1): kept only if the prompts (and images) are the same.
        mm: the prompt's images, or None.
    """
    params = params or SamplingParams()
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise MacinferError("the prompt is empty: give some text to complete")
    if len(ids) >= engine.max_model_len:
        raise MacinferError(f"the prompt is {len(ids)} tokens but the model holds at most "
                            f"{engine.max_model_len}: shorten it")
    vocab = getattr(getattr(engine.model, "args", None), "vocab_size", None)
    if vocab and any(t >= vocab for t in params.logit_bias):  # an index past the logits: refused
        raise MacinferError(f"logit_bias names token {max(params.logit_bias)}, but the model's vocabulary "
                            f"has {vocab} tokens (ids 0 to {vocab - 1})")
    request_id = request_id or uuid.uuid4().hex[:12]
    if engine.output.get(request_id) is not None:
        raise MacinferError(f"request id {request_id!r} is already in use")
    if mm is not None and len(ids) < mm.end:
        raise MacinferError(f"the images' tokens end at {mm.end} but the prompt is {len(ids)} tokens")
    if parent is not None and (parent.prompt_token_ids != ids or parent.is_finished
                               or (mm is not None and not mm.same_images(parent.mm)) or (mm is None) != (parent.mm is None)):
        parent = None
    return Sequence(request_id, ids, params, max_tokens=min(params.max_tokens, engine.max_model_len - len(ids)),
                    detokenizer=engine.tokenizer.detokenizer,
                    arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
                    grammar=grammar, fork_of=parent, mm=mm)


def _evaluator(config: EngineConfig, cpu_lazy: bool) -> StepEvaluator:
    """Launched steps on a worker thread where async_eval cannot overlap them (macinfer.core.evaluator):
    by default one process, MLX without Metal, and a lazy forward (the engine thread builds it beside the
    worker): `cpu_lazy`."""
    threaded = cpu_lazy if config.eval_thread is None else config.eval_thread
    return StepEvaluator(threaded and config.async_scheduling)


def _may_compile(config: EngineConfig, threaded: bool) -> bool:
    """Any forward compiled at all: not switched off, async scheduling on, and the eval thread (the NOTE
    in `_compiles_decode`)."""
    return config.compile_decode is not False and config.async_scheduling and threaded


def _compiles_decode(config: EngineConfig, ranks, model, cpu_lazy: bool, threaded: bool) -> bool:
    """Decode forwards as compiled graphs (macinfer.core.decode_graph): asked for, or by default where
    `cpu_lazy` holds, for a small model; never for a forward that evaluates as it is built (tracing must
    not evaluate) or across ranks, and only with the threaded evaluator.

    NOTE: with mx.async_eval pipelining instead (no eval thread), a compiled step was seen to find
    the previous step's pool still referenced now and then, and to copy the whole KV pool.
    """
    if config.compile_decode and config.async_scheduling and not threaded:
        print("note: compile_decode is off: it needs the eval thread (eval_thread=True)", file=sys.stderr)
    if not _may_compile(config, threaded):
        return False
    if config.compile_decode:
        return ranks is None and not forward_evaluates(model)
    return cpu_lazy and decode_graph_pays_off(model)


def _compiles_verify(config: EngineConfig, ranks, model, cpu_lazy: bool, threaded: bool) -> bool:
    """Forwards holding drafts as compiled graphs (DecodeGraph.verifies says which: a few narrow rows): as
    decode forwards are (`_compiles_decode`), but for a model of any size, and never through tapped layers
    (an EAGLE-3 draft's). A synchronous step waits for its forward's graph to be built; compiled, that
    is one call, and the fused elementwise chains dispatch fewer ops."""
    if not _may_compile(config, threaded) or ranks is not None:
        return False
    return (bool(config.compile_decode) or cpu_lazy) and not forward_evaluates(model) and not tapped(model)


def _hf_tokenizer(tokenizer):
    """The Hugging Face tokenizer inside mlx-lm's TokenizerWrapper (or the tokenizer itself).

    NOTE: llguidance checks the tokenizer's type, so the wrapper's attribute forwarding is not
    enough; the wrapper has no public accessor, and `_tokenizer` is the one it forwards to.
    """
    return getattr(tokenizer, "_tokenizer", tokenizer)


def _logits_width(model, tokenizer) -> int:
    """The number of columns of the model's logits: its config's vocab_size, else the tokenizer's."""
    width = getattr(getattr(model, "args", None), "vocab_size", None)
    return int(width) if isinstance(width, int) and width > 0 else len(_hf_tokenizer(tokenizer))
