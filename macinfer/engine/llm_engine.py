"""LLMEngine: requests in, streamed deltas out, one scheduled step at a time.

    engine = LLMEngine(model, tokenizer, info, kv_memory="2GB")
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for delta in engine.step():          # StreamDelta per request that moved
            print(delta.text, end="")         # delta.output is set on the last one

A step is: schedule -> run the model -> append tokens, check stops -> free the
finished (nano-vllm's shape). The engine is single-threaded: one thread owns it
and calls step(); other threads hand it requests through that thread.

Async scheduling (macinfer.engine.pipeline): while every running sequence is plainly
decoding, step n+1 is queued before step n's tokens are read back.

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
from functools import partial

import mlx.core as mx

from macinfer.core.block_pool import BlockPool
from macinfer.core.decode_graph import DecodeGraph, pays_off as decode_graph_pays_off
from macinfer.core.evaluator import StepEvaluator, threads_pay_off
from macinfer.core.grammar import GrammarCompiler, advance
from macinfer.errors import MacinferError
from macinfer.units import fmt_bytes
from macinfer.core.model_runner import ModelRunner
from macinfer.core.outputs import RequestOutput, StreamDelta
from macinfer.kv.model_probe import forward_evaluates, inspect_model, supports_batched_offsets
from macinfer.prefix_cache.keys import prefix_cache_stats
from macinfer.engine.distributed import LeaderRunner, check_model
from macinfer.engine.config import EngineConfig, plan_memory, setup_prefix_cache, wire_memory
from macinfer.engine.pipeline import InFlight, PipelinedSteps
from macinfer.core.sampling import SamplingParams
from macinfer.core.scheduler import Scheduler, SchedulerConfig
from macinfer.core.sequence import Sequence, SequenceStatus
from macinfer.core.state_pool import StatePool, StateScheduler, check_drafter
from macinfer.core.state_snapshots import StateSnapshots
from macinfer.spec_decode.speculator import make_spec_decoder

class LLMEngine(PipelinedSteps):
    """Continuous-batching engine over a paged KV cache.

    Args:
        model: an mlx-lm model.
        tokenizer: mlx-lm's TokenizerWrapper (for EOS ids and streaming text).
        info: macinfer.loader.ModelInfo, or None (context length then comes from
            max_model_len or the model's config).
        ranks: macinfer.engine.distributed.Ranks when the model is split across processes
            (the leader's runner sends each forward's plan; a follower's only runs them), else None.
        **options: EngineConfig fields.
    """

    def __init__(self, model, tokenizer, info=None, ranks=None, **options):
        self.config = config = EngineConfig(**options)
        self.model, self.tokenizer, self.info, self.ranks = model, tokenizer, info, ranks
        model_type = getattr(info, "model_type", None) or getattr(model, "model_type", "?")
        self.specs = inspect_model(model, model_type)
        if ranks is not None:
            check_model(ranks, self.specs, model_type)
        self.max_model_len = config.max_model_len or (info.context_length if info is not None else
                                                      getattr(getattr(model, "args", None), "max_position_embeddings", None) or 4096)

        # KV capacity: budget -> blocks (block 0 is the null block), state slots and snapshots.
        self.block_size = bs = config.block_size
        plan = plan_memory(config, self.specs, self.max_model_len, getattr(info, "weight_bytes", 0), model_type)
        self.bytes_per_token, self.bytes_per_block = plan.bytes_per_token, plan.bytes_per_block
        self.state_bytes, self.snapshot_bytes, self.kv_budget = plan.state_bytes, plan.snapshot_bytes, plan.kv_budget
        num_blocks = plan.num_blocks if ranks is None else ranks.agree_min(plan.num_blocks)  # each rank's pools fit
        states = getattr(self.specs, "states", None)
        snapshots = bool(states) and config.enable_prefix_cache
        wire_memory()
        self.block_pool = BlockPool(num_blocks, bs)
        runner = ModelRunner if ranks is None or not ranks.is_leader else partial(LeaderRunner, ranks=ranks)
        self.runner = runner(model, self.specs, num_blocks, bs, batch_decode=supports_batched_offsets(model),
                             kv_bits=config.kv_bits, kv_group_size=config.kv_group_size)
        # The CPU-backend defaults below hold for one process and a forward built lazily (read from source once).
        cpu_lazy = ranks is None and threads_pay_off() and not forward_evaluates(model)
        self.runner.evaluator = _evaluator(config, cpu_lazy)
        if _compiles_decode(config, ranks, model, cpu_lazy, self.runner.evaluator.threaded):
            self.runner.decode_graph = DecodeGraph(self.runner)
        self.scheduler = self._make_scheduler(states, snapshots)
        from macinfer.kv.kernel_dispatch import select_attention
        from macinfer.kv.paged_attention import paged_attention

        fn, self.attention_backend = select_attention(config.attention, paged_attention,
                                                      head_dim=self.specs[0].k_head_dim if self.specs else 0,
                                                      block_size=bs) if self.specs else (None, "none")
        if self.attention_backend != "reference":
            self.runner.ctx.attention_fn = fn
        # NOTE: models with recurrent state layers use a cached block only with a snapshot of the state
        # after it (macinfer.core.state_snapshots), and those stay in memory: no disk tier for them.
        self.model_id = setup_prefix_cache(self, config, persist=not states)  # None when off
        if self.snapshots is not None:
            self.block_pool.on_evict = self.snapshots.drop  # a snapshot lives as long as its block's hash
        self.spec = make_spec_decoder(config, model, tokenizer, getattr(info, "name", None), num_blocks, bs,
                                      self.block_pool, self.runner)  # None: no draft
        if self.spec is not None:
            # Models with state layers verify drafts exactly: a row that rejects some gets its state back
            # and its accepted tokens fed again (macinfer.core.state_pool.refeed_rejected).
            check_drafter(self.spec.drafter, self.runner, model_type)
        self.eos_token_ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
        self.grammars = GrammarCompiler(getattr(tokenizer, "_tokenizer", tokenizer), _logits_width(model, tokenizer),
                                        list(self.eos_token_ids))
        self.runner.fill_masks = self.grammars.fill_masks
        self.requests: dict[str, Sequence] = {}
        self._pending: list[StreamDelta] = []  # aborted/failed outputs not yet returned
        self._inflight: InFlight | None = None  # a launched decode step not yet read back
        self._last_resolve: float | None = None  # when the previous queued step was read back
        if config.verbose:
            print(self.describe(), file=sys.stderr)

    def _make_scheduler(self, states, snapshots: bool) -> Scheduler:
        """The scheduler; with state layers, their slot pool (and snapshots) beside the block pool."""
        config = self.config
        sched_config = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens)
        self.state_pool = self.snapshots = None
        if not states:
            return Scheduler(sched_config, self.block_pool)
        self.state_pool = StatePool(config.max_num_seqs, self.specs.bytes_per_slot, release=self.runner.states.release)
        self.runner.states.slot_of = self.state_pool.slot_of
        if snapshots:
            self.snapshots = StateSnapshots(self.snapshot_bytes, self.specs.bytes_per_slot)
        return StateScheduler(sched_config, self.block_pool, self.state_pool, self.runner.states, self.snapshots)

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
            f"max {self.config.max_num_seqs} sequences, {self.config.max_num_batched_tokens} tokens/step; "
            f"attention: {self.attention_backend}"
            + (f"; recurrent state: {self.state_pool.num_slots} slots x "
               f"{fmt_bytes(self.state_pool.bytes_per_slot, binary=True)} = {fmt_bytes(self.state_bytes, binary=True)} "
               f"({len(self.specs.states)} state layers)" if self.state_pool is not None else "")
            + (f"; state snapshots: {fmt_bytes(self.snapshot_bytes, binary=True)}" if self.snapshots is not None else "")
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
            "usage": pool.usage,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            **prefix_cache_stats(self.block_pool),
            **(self.state_pool.stats() if self.state_pool is not None else {}),
            **(self.snapshots.stats_dict() if self.snapshots is not None else {}),
            **(self.ranks.stats() if self.ranks is not None else {}),
        }

    # -- requests -----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    fork_of: str | None = None) -> str:
        """Queue a request.

        Args:
            prompt: token ids (or text, encoded with the tokenizer).
            params: sampling parameters (default: greedy, 256 tokens).
            request_id: unique id, or None to draw one.
            arrival_time: perf_counter() stamp for metrics (default: now).
            fork_of: the id of an unfinished request with the same prompt (n > 1 samples):
                this one shares its prompt's KV blocks (macinfer.core.scheduler, forks).

        Returns:
            The request id.

        Raises:
            MacinferError: empty prompt, prompt longer than the context, a prompt whose KV
                could never fit in the pool, or a structured output grammar that is invalid.
        """
        with self.runner.evaluator.context():  # a sampler's arrays on the stream the steps use
            seq = self._new_sequence(prompt, params, request_id, arrival_time)
        n = len(seq.prompt_token_ids)
        if self.block_pool.num_blocks_for(n) > self.block_pool.num_usable_blocks:
            raise MacinferError(
                f"the prompt is {n} tokens but the KV cache holds {self.num_tokens_capacity} "
                f"({fmt_bytes(self.kv_budget, binary=True)}): raise kv_memory")
        parent = self.requests.get(fork_of) if fork_of is not None else None
        if parent is not None and parent.prompt_token_ids == seq.prompt_token_ids and not parent.is_finished:
            seq.fork_of = parent
        if seq.params.structured is not None:
            try:
                seq.grammar = self.grammars.matcher(seq.params.structured)
            except ValueError as e:
                raise MacinferError(str(e)) from None
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def _new_sequence(self, prompt, params: SamplingParams | None, request_id: str | None,
                      arrival_time: float | None) -> Sequence:
        """A checked, not yet queued Sequence: encoded, non-empty, within the context, a fresh id."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise MacinferError("the prompt is empty: give some text to complete")
        if len(ids) >= self.max_model_len:
            raise MacinferError(f"the prompt is {len(ids)} tokens but the model holds at most "
                                f"{self.max_model_len}: shorten it")
        vocab = getattr(getattr(self.model, "args", None), "vocab_size", None)
        if vocab and any(t >= vocab for t in params.logit_bias):  # an index past the logits: refused
            raise MacinferError(f"logit_bias names token {max(params.logit_bias)}, but the model's vocabulary "
                                f"has {vocab} tokens (ids 0 to {vocab - 1})")
        request_id = request_id or uuid.uuid4().hex[:12]
        if request_id in self.requests:
            raise MacinferError(f"request id {request_id!r} is already in use")
        return Sequence(request_id, ids, params, max_tokens=min(params.max_tokens, self.max_model_len - len(ids)),
                        detokenizer=self.tokenizer.detokenizer,
                        arrival_time=time.perf_counter() if arrival_time is None else arrival_time)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; its final delta comes with the next step()."""
        seq = self.requests.get(request_id)
        if seq is None or seq.is_finished:
            return
        self.scheduler.abort(request_id)
        if self.spec is not None:
            self.spec.remove(request_id)
        self._pending.append(self._finish(seq))

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
        return self.scheduler.has_unfinished() or bool(self._pending) or self._inflight is not None

    # -- the step -----------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """Run one scheduling step: schedule -> run the model -> append tokens and check stops.

        While every running sequence is plainly decoding, the pipelined variant runs
        instead (macinfer.engine.pipeline): it returns the step before's tokens.

        Returns:
            A StreamDelta for every request that produced text or finished (the
            finished ones carry `output`, the whole RequestOutput).
        """
        with self.runner.evaluator.context():
            return self._step()

    def _step(self) -> list[StreamDelta]:
        deltas, self._pending = self._pending, []
        if self._inflight is None and (rows := self._decode_rows(None)):
            self._inflight = self._launch(rows, None)
        if self._inflight is not None:
            return deltas + self._step_pipelined()
        t0 = time.perf_counter()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)  # drafts for the decode rows
        out = self.scheduler.schedule()
        for seq in out.finished:  # could not fit in the KV cache any more
            deltas.append(self._finish(seq))
            if self.spec is not None:
                self.spec.remove(seq.request_id)  # what the drafter held for it
        if out.is_empty:
            return deltas
        now = time.perf_counter()
        for s in out.scheduled:
            if s.seq.metrics.first_scheduled_time is None:
                s.seq.metrics.first_scheduled_time = now
        tokens = self.runner.execute_model(out.scheduled)
        self.scheduler.update_from_output(out)
        if self.snapshots is not None:  # states at block boundaries, before a finishing row's slot goes
            self.scheduler.take_snapshots([s.seq for s in out.scheduled if not s.num_spec_tokens])
        deltas += self._append_tokens(out.scheduled, tokens)
        if self.spec is not None:  # accepted drafts count as computed now; acceptance, costs
            self.spec.update_from_output(out.scheduled, tokens, time.perf_counter() - t0)
            if self.snapshots is not None:  # rows that verified drafts: their state is at num_computed_tokens now
                self.scheduler.take_snapshots([s.seq for s in out.scheduled if s.num_spec_tokens and not s.seq.is_finished])
        return deltas

    def _append_tokens(self, scheduled: list, tokens: list) -> list[StreamDelta]:
        """Each row's new tokens (None: mid-prefill; a list: accepted drafts + the target's own)."""
        deltas = []
        for s, toks in zip(scheduled, tokens):
            for tok in [] if toks is None else toks if isinstance(toks, list) else [toks]:
                if s.seq.is_finished:
                    break
                delta = self._process_token(s.seq, tok)
                if delta is not None:
                    deltas.append(delta)
        return deltas

    def _process_token(self, seq: Sequence, tok: int) -> StreamDelta | None:
        m = seq.metrics
        now = time.perf_counter()
        if m.first_token_time is None:
            m.first_token_time = now
        else:
            m.decode_steps += 1
            m.kv_tokens_sum += seq.num_tokens
        p = seq.params
        status = None
        logprob, seq.pending_logprob = seq.pending_logprob, None
        complete = seq.grammar is not None and advance(seq.grammar, tok)  # nothing but EOS may follow
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            status = SequenceStatus.FINISHED_STOPPED  # the stop token is not part of the output
        elif complete and tok in self.eos_token_ids:  # ignore_eos: the grammar still ends here
            status = SequenceStatus.FINISHED_STOPPED
        else:
            seq.append_token(tok, logprob)
            if p.stop and self._truncate_at_stop(seq):
                status = SequenceStatus.FINISHED_STOPPED
            elif complete:
                status = SequenceStatus.FINISHED_STOPPED
            elif seq.num_output_tokens >= seq.max_tokens:
                status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish(seq, status)
            return self._finish(seq)
        # Hold back the tail that could still become a stop string.
        hold = max((len(s) for s in p.stop), default=1) - 1
        end = max(seq.num_emitted_chars, len(seq.text) - hold)
        return self._delta(seq, end)

    @staticmethod
    def _truncate_at_stop(seq: Sequence) -> bool:
        # Only the new tail can hold a new match: earlier text was checked already.
        longest = max(len(s) for s in seq.params.stop)
        start = max(0, seq.num_emitted_chars - longest)
        hits = [i for i in (seq.text.find(s, start) for s in seq.params.stop if s) if i >= 0]
        if not hits:
            return False
        seq.text = seq.text[: min(hits)]
        seq.detokenizer = None  # freeze the text
        return True

    def _delta(self, seq: Sequence, end: int) -> StreamDelta | None:
        text = seq.text[seq.num_emitted_chars: end]
        new_ids = seq.token_ids[seq.num_prompt_tokens + seq.num_emitted_tokens:]  # not output_token_ids[...]: two copies
        if not text and not new_ids:
            return None
        logprobs = None if seq.logprobs is None else seq.logprobs[seq.num_emitted_tokens:]
        seq.num_emitted_chars = max(seq.num_emitted_chars, end)
        seq.num_emitted_tokens = seq.num_output_tokens
        return StreamDelta(seq.request_id, text, new_ids, logprobs=logprobs)

    def _finish(self, seq: Sequence) -> StreamDelta:
        """The final delta of a finished sequence, with its RequestOutput."""
        seq.finalize_text()
        seq.metrics.finish_time = time.perf_counter()
        seq.metrics.generation_tokens = seq.num_output_tokens
        delta = self._delta(seq, len(seq.text)) or StreamDelta(seq.request_id, "", [])
        delta.finish_reason = seq.finish_reason
        delta.output = RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=seq.text,
            finish_reason=seq.finish_reason,
            metrics=seq.metrics,
            logprobs=seq.logprobs,
        )
        if self.block_pool.store is not None:  # its cached blocks to disk: reads the pools, so after the worker
            self.runner.evaluator.drain()
            self.block_pool.persist(seq.token_ids)
        self.requests.pop(seq.request_id, None)
        seq.grammar = None  # its matcher's memory goes now, not when the last reference to seq does
        return delta


def _evaluator(config: EngineConfig, cpu_lazy: bool) -> StepEvaluator:
    """Launched steps on a worker thread where async_eval cannot overlap them (macinfer.core.evaluator):
    by default one process, MLX without Metal, and a lazy forward (the engine thread builds it beside the
    worker): `cpu_lazy`."""
    threaded = cpu_lazy if config.eval_thread is None else config.eval_thread
    return StepEvaluator(threaded and config.async_scheduling)


def _compiles_decode(config: EngineConfig, ranks, model, cpu_lazy: bool, threaded: bool) -> bool:
    """Decode forwards as compiled graphs (macinfer.core.decode_graph): asked for, or by default where
    `cpu_lazy` holds, for a small model; never for a forward that evaluates as it is built (tracing must
    not evaluate) or across ranks, and only with the threaded evaluator.

    NOTE: with mx.async_eval pipelining instead (no eval thread), a compiled step was seen to find
    the previous step's pool still referenced now and then, and to copy the whole KV pool.
    """
    if config.compile_decode is False or not config.async_scheduling:
        return False
    if not threaded:
        if config.compile_decode:
            print("note: compile_decode is off: it needs the eval thread (eval_thread=True)", file=sys.stderr)
        return False
    if config.compile_decode:
        return ranks is None and not forward_evaluates(model)
    return cpu_lazy and decode_graph_pays_off(model)


def _logits_width(model, tokenizer) -> int:
    """The number of columns of the model's logits: its config's vocab_size, else the tokenizer's."""
    width = getattr(getattr(model, "args", None), "vocab_size", None)
    return int(width) if isinstance(width, int) and width > 0 else len(getattr(tokenizer, "_tokenizer", tokenizer))
