"""LLMEngine: requests in, streamed deltas out, one scheduled step at a time.

    engine = LLMEngine(model, tokenizer, info, kv_memory="2GB")
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for delta in engine.step():          # StreamDelta per request that moved
            print(delta.text, end="")         # delta.output is set on the last one

A step is: schedule -> run the model -> append tokens, check stops -> free the
finished (nano-vllm's shape). The engine is single-threaded: one thread owns it
and calls step(); other threads hand it requests through that thread.

Async scheduling (vLLM's name for it; mlx-lm's generate_step does the same for one
stream): while every running sequence is plainly decoding, step n+1 is built from
step n's sampled ids while they are still being computed, and queued with
mx.async_eval before step n's ids are read back. Building a forward costs a few ms
of Python per step; this way it overlaps the model's compute instead of adding to
it, and so do the caller's handling of the deltas and detokenising. Stops are
therefore seen one step late: a sequence that finished at step n also computed one
row in step n+1, which is dropped (its K/V slot lies past the sequence's end and
its blocks are freed as usual). Anything else (admitting a request, a prefill
chunk, drafts, too few free blocks) first reads back the step in flight, then runs
a plain synchronous step.

KV budget: `kv_memory` (bytes or "2GB"; binary units) sets the pool size. By
default, on a Mac: the recommended Metal working set minus the weights minus a
margin; elsewhere 1 GiB. Either way it is capped at what max_num_seqs sequences
of full context length could use. `describe()` reports the resulting capacity.
Models with recurrent state layers (macinfer.kv.state_cache) take max_num_seqs state
slots out of the same budget first.
"""

from __future__ import annotations

import re
import sys
import time
import uuid
from dataclasses import dataclass

import mlx.core as mx

from macinfer.core.block_pool import BlockPool
from macinfer.errors import MacinferError
from macinfer.units import fmt_bytes
from macinfer.core.model_runner import ModelRunner
from macinfer.core.outputs import RequestOutput, StreamDelta
from macinfer.kv.paged_cache import inspect_model, supports_batched_offsets
from macinfer.core.prefix_cache import prefix_cache_stats, setup_prefix_cache
from macinfer.core.sampling import SamplingParams
from macinfer.core.scheduler import Scheduler, SchedulerConfig
from macinfer.core.sequence import Sequence, SequenceStatus
from macinfer.core.state_pool import StatePool, StateScheduler, check_drafter
from macinfer.spec.speculator import make_spec_decoder

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40}


def parse_memory(value: int | float | str) -> int:
    """'2GB' / '512MiB' / '1.5g' / 1000000 -> bytes (binary units: 1GB = 2**30).

    Example:
        >>> parse_memory("2GB")
        2147483648
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise MacinferError(f"cannot read '{value}' as a memory size: write e.g. 2GB, 512MB or a byte count")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise MacinferError(f"the KV memory budget must be positive, got {value}")
    return n


@dataclass
class _InFlight:
    """A decode step queued with mx.async_eval whose sampled ids are not read back yet."""

    seqs: list[Sequence]
    tokens: mx.array  # (B,) lazy sampled ids, one per seq


@dataclass
class EngineConfig:
    """Engine options (what `LLM(model, **engine_options)` and the CLI pass).

    Args:
        kv_memory: KV pool budget, bytes or a string like "2GB"; None for the default.
        num_blocks: exact pool size in blocks (overrides kv_memory; tests, benchmarks).
        block_size: token slots per KV block.
        max_num_seqs: sequences decoding at once.
        max_num_batched_tokens: tokens per step (prefill chunk size + decodes).
        max_model_len: longest sequence; None for the model's context length.
        verbose: print the KV budget and capacity at start-up.
        enable_prefix_cache: reuse the K/V of full blocks shared with earlier
            prompts (macinfer.core.prefix_cache); outputs are the same either way.
        persist_prefix_cache: also keep cached blocks on disk for later processes.
        prefix_cache_dir: root of the persistent tier (default $MACINFER_PREFIX_CACHE_DIR
            or cache_dir()/prefix); each model gets a subdirectory named by its identity.
        prefix_cache_disk_bytes: size limit of the persistent tier (all models together).
        draft: speculative decoding (macinfer.spec.decoder): "ngram" (prompt lookup), a
            draft model (shipped draft name, path, catalog name, repo id, or a loaded
            mlx-lm model sharing the tokenizer), "<draft model>+ngram" (lookup where the
            text repeats itself, the model elsewhere), "auto" (the draft shipped for this
            model, if any, with lookup), or None for none.
        num_speculative_tokens: the most tokens drafted per sequence per step.
        adaptive_speculation: pick k each step from measured acceptance and costs
            (False: always draft num_speculative_tokens).
        kv_bits: store K/V quantised to 8 (or 4) bits in the paged pool
            (macinfer.kv.quant); None keeps the activation dtype.
        kv_group_size: quantisation group along head_dim (default 32).
        attention: "auto" (the fused Metal kernel if it passes its start-up check
            against the reference, else the reference), "metal" or "reference".
        async_scheduling: overlap building each decode step with the previous
            step's compute (module docstring); outputs are the same either way.
    """

    kv_memory: int | str | None = None
    num_blocks: int | None = None
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    verbose: bool = False
    enable_prefix_cache: bool = True
    persist_prefix_cache: bool = False
    prefix_cache_dir: str | None = None
    prefix_cache_disk_bytes: int | str = "2GB"
    draft: object = None
    num_speculative_tokens: int = 12  # a ceiling: adaptive k goes this high on long copies (lookup)
    adaptive_speculation: bool = True
    kv_bits: int | None = None
    kv_group_size: int | None = None
    attention: str = "auto"
    async_scheduling: bool = True

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 2):
            raise ValueError(f"num_blocks must be an integer >= 2, got {self.num_blocks}")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True or False, got {self.async_scheduling!r}")
        if self.max_num_batched_tokens is None:
            # A chunk's forward blocks every decode of that step: keep it short where
            # prefill is slow (CPU, ~50 tok/s on a 135M model) and longer on Metal.
            self.max_num_batched_tokens = max(512 if mx.metal.is_available() else 128, self.max_num_seqs)


def default_kv_memory(weight_bytes: int) -> int:
    """The KV budget when none is given (see module docstring)."""
    if mx.metal.is_available():
        try:
            info = mx.device_info()
        except AttributeError:
            info = mx.metal.device_info()
        working_set = int(info.get("max_recommended_working_set_size", 0))
        if working_set:
            margin = max(1 << 30, working_set // 10)  # activations, other apps
            return max(256 << 20, working_set - weight_bytes - margin)
    return 1 << 30


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Args:
        model: an mlx-lm model.
        tokenizer: mlx-lm's TokenizerWrapper (for EOS ids and streaming text).
        info: macinfer.loader.ModelInfo, or None (context length then comes from
            max_model_len or the model's config).
        **options: EngineConfig fields.
    """

    def __init__(self, model, tokenizer, info=None, **options):
        self.config = config = EngineConfig(**options)
        self.model, self.tokenizer, self.info = model, tokenizer, info
        model_type = getattr(info, "model_type", None) or getattr(model, "model_type", "?")
        self.specs = inspect_model(model, model_type)
        self.max_model_len = config.max_model_len or (info.context_length if info is not None else
                                                      getattr(getattr(model, "args", None), "max_position_embeddings", None) or 4096)

        # KV capacity: budget -> blocks (block 0 is the null block).
        self.block_size = bs = config.block_size
        if config.kv_bits:
            from macinfer.kv.quant import quantized_bytes_per_token

            self.bytes_per_token = sum(quantized_bytes_per_token(s, config.kv_bits, config.kv_group_size)
                                       for s in self.specs)
        else:
            self.bytes_per_token = sum(s.bytes_per_token() for s in self.specs)
        self.bytes_per_block = self.bytes_per_token * bs
        # Recurrent layers (hybrid / SSM models): a state slot per sequence, max_num_seqs of them, out of
        # the same budget (macinfer.core.state_pool).
        states = getattr(self.specs, "states", None)
        self.state_bytes = config.max_num_seqs * self.specs.bytes_per_slot if states else 0
        weight_bytes = getattr(info, "weight_bytes", 0)
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
            self.kv_budget = num_blocks * self.bytes_per_block + self.state_bytes
        else:
            self.kv_budget = (parse_memory(config.kv_memory) if config.kv_memory is not None
                              else default_kv_memory(weight_bytes))
            if self.state_bytes >= self.kv_budget:
                raise MacinferError(
                    f"{model_type}: the recurrent state of {config.max_num_seqs} sequences takes "
                    f"{fmt_bytes(self.state_bytes, binary=True)}, more than the {fmt_bytes(self.kv_budget, binary=True)} "
                    "KV budget: raise kv_memory or lower max_num_seqs")
            # The null block counts against the budget; no point holding more than
            # max_num_seqs full-length sequences could fill.
            useful = (config.max_num_seqs * -(-self.max_model_len // bs) + 1) * self.bytes_per_block
            num_blocks = (min(self.kv_budget - self.state_bytes, useful) // self.bytes_per_block if self.bytes_per_block
                          else min(1 << 16, config.max_num_seqs * -(-self.max_model_len // bs) + 1))  # no attention: free
            if num_blocks < 2:
                raise MacinferError(
                    f"a KV budget of {fmt_bytes(self.kv_budget, binary=True)} holds no {bs}-token block "
                    f"({fmt_bytes(self.bytes_per_block, binary=True)} each): raise kv_memory")
        self.block_pool = BlockPool(num_blocks, bs)
        self.runner = ModelRunner(model, self.specs, num_blocks, bs, batch_decode=supports_batched_offsets(model),
                                  kv_bits=config.kv_bits, kv_group_size=config.kv_group_size)
        sched_config = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens)
        self.state_pool = None
        if states:
            self.state_pool = StatePool(config.max_num_seqs, self.specs.bytes_per_slot, release=self.runner.states.release)
            self.runner.states.slot_of = self.state_pool.slot_of
            self.scheduler = StateScheduler(sched_config, self.block_pool, self.state_pool)
        else:
            self.scheduler = Scheduler(sched_config, self.block_pool)
        from macinfer.kv.metal_attention import select_attention
        from macinfer.kv.paged_attention import paged_attention

        fn, self.attention_backend = select_attention(config.attention, paged_attention,
                                                      head_dim=self.specs[0].k_head_dim if self.specs else 0,
                                                      block_size=bs) if self.specs else (None, "none")
        if self.attention_backend != "reference":
            self.runner.ctx.attention_fn = fn
        # NOTE: no prefix cache for models with recurrent state layers yet: a cached KV block is no use
        # without the state after the same tokens (state snapshots at block boundaries are a follow-up).
        self.model_id = setup_prefix_cache(self, config) if not states else None  # None when off
        self.spec = make_spec_decoder(config, model, tokenizer, getattr(info, "name", None), num_blocks, bs,
                                      self.block_pool, self.runner)  # None: no draft
        if self.spec is not None:
            # Models with state layers verify drafts exactly: a row that rejects some gets its state back
            # and its accepted tokens fed again (macinfer.core.state_pool.refeed_rejected).
            check_drafter(self.spec.drafter, self.runner, model_type)
        self.eos_token_ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
        self.requests: dict[str, Sequence] = {}
        self._pending: list[StreamDelta] = []  # aborted/failed outputs not yet returned
        self._inflight: _InFlight | None = None  # a launched decode step not yet read back
        self._last_resolve: float | None = None  # when the previous queued step was read back
        if config.verbose:
            print(self.describe(), file=sys.stderr)

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
        }

    # -- requests -----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request.

        Args:
            prompt: token ids (or text, encoded with the tokenizer).
            params: sampling parameters (default: greedy, 256 tokens).
            request_id: unique id, or None to draw one.
            arrival_time: perf_counter() stamp for metrics (default: now).

        Returns:
            The request id.

        Raises:
            MacinferError: empty prompt, prompt longer than the context, or a
                prompt whose KV could never fit in the pool.
        """
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise MacinferError("the prompt is empty: give some text to complete")
        if len(ids) >= self.max_model_len:
            raise MacinferError(f"the prompt is {len(ids)} tokens but the model holds at most "
                                f"{self.max_model_len}: shorten it")
        if self.block_pool.num_blocks_for(len(ids)) > self.block_pool.num_usable_blocks:
            raise MacinferError(
                f"the prompt is {len(ids)} tokens but the KV cache holds {self.num_tokens_capacity} "
                f"({fmt_bytes(self.kv_budget, binary=True)}): raise kv_memory")
        request_id = request_id or uuid.uuid4().hex[:12]
        if request_id in self.requests:
            raise MacinferError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, ids, params, max_tokens=min(params.max_tokens, self.max_model_len - len(ids)),
                       detokenizer=self.tokenizer.detokenizer,
                       arrival_time=time.perf_counter() if arrival_time is None else arrival_time)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; its final delta comes with the next step()."""
        seq = self.requests.get(request_id)
        if seq is None or seq.is_finished:
            return
        self.scheduler.abort(request_id)
        if self.spec is not None:
            self.spec.remove(request_id)
        self._pending.append(self._finish(seq))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or self._inflight is not None

    # -- the step -----------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """Run one scheduling step.

        Returns:
            A StreamDelta for every request that produced text or finished (the
            finished ones carry `output`, the whole RequestOutput).
        """
        deltas, self._pending = self._pending, []
        if self._inflight is None:
            rows = self._decode_rows(None)
            if rows:
                self._inflight = self._launch(rows, None)
        if self._inflight is not None:
            prev = self._inflight
            rows = self._decode_rows(prev)
            self._inflight = self._launch(rows, prev) if rows else None
            deltas += self._resolve(prev)
            if self.spec is not None:
                # Read-back to read-back is one step's cost only while a step is queued behind
                # each. The last read-back before a synchronous step has none: where queueing
                # blocks until the step before is done (MLX on the CPU), it times only that
                # step's tail (~20 ms of ~160 at 8 rows), and the fit took decode for cheap.
                now = time.perf_counter()
                full = self._last_resolve is not None and self._inflight is not None
                self.spec.skip_step(self.scheduler.running, len(prev.seqs),
                                    now - self._last_resolve if full else None)
                self._last_resolve = now if self._inflight is not None else None
            return deltas
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
        for s, tok in zip(out.scheduled, tokens):
            for tok in [] if tok is None else tok if isinstance(tok, list) else [tok]:  # a list: verified drafts
                if s.seq.is_finished:
                    break
                delta = self._process_token(s.seq, tok)
                if delta is not None:
                    deltas.append(delta)
        if self.spec is not None:  # accepted drafts count as computed now; acceptance, costs
            self.spec.update_from_output(out.scheduled, tokens, time.perf_counter() - t0)
        return deltas

    # -- async scheduling ---------------------------------------------------------------
    def _decode_rows(self, prev: _InFlight | None) -> list[Sequence]:
        """The sequences the next step can decode without reading anything back, or [].

        Pipelining only covers the steady state: every running sequence decoding, nobody
        waiting who could be admitted, no drafts, a free slot for each row without preempting.
        With a step in flight, a sequence whose pending token is its last (max_tokens)
        is left out: it is certain to finish.
        """
        running = self.scheduler.running
        # A waiting request only blocks pipelining if it could be admitted now: a server whose
        # queue is longer than max_num_seqs still runs its full batch ahead.
        admissible = self.scheduler.waiting and len(running) < self.config.max_num_seqs
        if (not self.config.async_scheduling or admissible
                or not running or (len(running) > 1 and not self.runner.batch_decode)):
            return []
        if prev is None:
            if any(s.num_uncomputed_tokens != 1 for s in running):
                return []
            rows = list(running)
        else:
            launched = {id(s) for s in prev.seqs}
            if any(id(s) not in launched for s in running):
                return []
            rows = [s for s in running if s.num_output_tokens + 1 < s.max_tokens]
        pool = self.block_pool
        if sum(pool.num_new_blocks(s, 1) for s in rows) > pool.get_num_free_blocks():
            return []
        if self.spec is not None and rows and self.spec.wants_sync(rows, pending=prev is not None):
            return []  # worth drafting: that needs the tokens read back, then a synchronous step
        return rows

    def _launch(self, rows: list[Sequence], prev: _InFlight | None) -> _InFlight:
        """Queue a decode step for rows; their input ids are prev's lazy outputs."""
        if prev is None:
            tokens = mx.array([s.token_ids[-1] for s in rows], dtype=mx.uint32)
        else:
            index = {id(s): i for i, s in enumerate(prev.seqs)}
            idx = [index[id(s)] for s in rows]
            tokens = prev.tokens if idx == list(range(len(prev.seqs))) else prev.tokens[mx.array(idx)]
        now = time.perf_counter()
        for s in rows:
            ok = self.block_pool.allocate_slots(s, 1)
            assert ok, s  # _decode_rows counted the free blocks
            if s.metrics.first_scheduled_time is None:
                s.metrics.first_scheduled_time = now
        sampled = self.runner.launch_decode(rows, tokens)
        for s in rows:
            s.num_computed_tokens += 1  # the row's K/V is queued; its token comes with _resolve
        return _InFlight(rows, sampled)

    def _resolve(self, step: _InFlight) -> list[StreamDelta]:
        """Read a launched step's tokens back and process them like a synchronous step."""
        deltas = []
        for seq, tok in zip(step.seqs, step.tokens.tolist()):
            if seq.is_finished:  # stopped a step earlier, or aborted: the row is dropped
                continue
            delta = self._process_token(seq, tok)
            if delta is not None:
                deltas.append(delta)
            if not seq.is_finished:
                self.block_pool.cache_full_blocks(seq)  # now that its token ids are known
            elif self.spec is not None:
                self.spec.remove(seq.request_id)  # what the drafter held for it (a sync step's update would)
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
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            status = SequenceStatus.FINISHED_STOPPED  # the stop token is not part of the output
        else:
            seq.append_token(tok)
            if p.stop and self._truncate_at_stop(seq):
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
        new_ids = seq.output_token_ids[seq.num_emitted_tokens:]
        if not text and not new_ids:
            return None
        seq.num_emitted_chars = max(seq.num_emitted_chars, end)
        seq.num_emitted_tokens = seq.num_output_tokens
        return StreamDelta(seq.request_id, text, new_ids)

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
        )
        self.block_pool.persist(seq.token_ids)  # its cached blocks to disk (persistent tier only)
        self.requests.pop(seq.request_id, None)
        return delta
