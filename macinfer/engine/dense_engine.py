"""DenseEngine: the last-resort engine, mlx-lm's own BatchGenerator behind LLMEngine's API.

A model the paged engine refuses (macinfer.kv.model_probe.inspect_model raises:
recurrent or hybrid layers, attention that does not go through mlx-lm's SDPA once
per layer, ...) still runs here, continuously batched by mlx-lm with one dense
cache per request, the way `mlx_lm.server` runs it:

    engine = DenseEngine(model, tokenizer, info, max_num_seqs=8)
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for delta in engine.step():           # StreamDelta per request that moved
            print(delta.text, end="")          # delta.output is set on the last one

What is the same as LLMEngine: the Engine protocol (macinfer.engine.protocol); stop tokens,
EOS, stop strings, max_tokens, streamed text and the final RequestOutput with its metrics come
from the same StopChecker (macinfer.core.stop_checker) and OutputProcessor
(macinfer.engine.output_processor), so both engines stop and stream identically. Greedy rows are
sampled in one batched argmax;
a sampled row gets its own macinfer Sampler (its request's RNG key, seeded or not),
so a seeded request is reproducible whatever else is batched.

What BatchGenerator does not allow, so this engine does not do:
- no paging: each request's K/V is a dense, growing cache, so memory is not bounded
  by a budget (kv_memory, num_blocks, block_size are ignored) and nothing is preempted;
  admission is by max_num_seqs only;
- no prefix cache, no speculative decoding (draft), no quantised KV (kv_bits), no
  attention backend choice: those options are ignored (the `auto` selection in
  macinfer.llm says so on stderr);
- prefill: requests joining together are prefilled together, in chunks of
  max_num_batched_tokens, and a step that prefills also decodes the running batch (not
  under one shared token budget as in the paged scheduler); a model with recurrent
  layers prefills one prompt at a time (mlx-lm's padded joint prefill is not exact there);
- the first tokens of a step are computed one step ahead (mlx-lm pipelines its decode),
  so a request stopped by a stop string or EOS costs one more row before it leaves;
- penalties, logit_bias and logprobs are BatchGenerator's own (per-row logits processors,
  its logprobs), the same mlx-lm functions the paged engine applies.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from macinfer.core.logprobs import from_vector
from macinfer.core.outputs import StreamDelta
from macinfer.core.sampling import SamplingParams
from macinfer.core.sequence import Sequence, SequenceStatus
from macinfer.core.stop_checker import StopChecker
from macinfer.engine.config import EngineConfig
from macinfer.engine.llm_engine import new_sequence
from macinfer.engine.output_processor import OutputProcessor, RequestTable
from macinfer.engine.protocol import EngineFeatures
from macinfer.errors import MacinferError

# Options that only mean something to the paged engine, and the feature each belongs to.
PAGED_ONLY = {"kv_memory": "paging", "num_blocks": "paging", "block_size": "paging",
              "enable_prefix_cache": "prefix cache", "persist_prefix_cache": "prefix cache",
              "prefix_cache_dir": "prefix cache", "prefix_cache_disk_bytes": "prefix cache",
              "draft": "speculation", "num_speculative_tokens": "speculation",
              "adaptive_speculation": "speculation", "kv_bits": "quantised KV", "kv_group_size": "quantised KV",
              "attention": "paged attention", "async_scheduling": "async scheduling"}
OFF_FEATURES = ("paging", "prefix cache", "speculation", "quantised KV", "structured output")


@dataclass
class DenseConfig:
    """What DenseEngine uses of the engine options (EngineConfig validates them all).

    It has no `enable_prefix_cache` or `draft`: the chat UI reads that as "not available".
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    verbose: bool


def batchable(model, model_type: str = "?") -> bool:
    """Whether every cache is plain K/V (True) or some hold a recurrent state (False).

    Raises:
        MacinferError: mlx-lm's BatchGenerator cannot batch this model's caches.
    """
    from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache, make_prompt_cache

    def leaves(c):
        return [x for sub in c.caches for x in leaves(sub)] if isinstance(c, CacheList) else [c]

    plain = True
    for c in make_prompt_cache(model):
        for leaf in leaves(c):
            if not hasattr(leaf, "merge"):
                raise MacinferError(f"{model_type}: mlx-lm's BatchGenerator cannot batch its "
                                    f"{type(leaf).__name__} layers either")
            plain &= type(leaf) in (KVCache, RotatingKVCache)
    return plain


class _DenseRequests:
    """The requests DenseEngine tracks, and their BatchGenerator uids (the engine's scheduler).

    It is the one writer of its sequences' statuses and computed tokens, as the paged Scheduler is.
    """

    def __init__(self, gen, stop_checker: StopChecker):
        self.gen = gen
        self.stop_checker = stop_checker
        self.waiting: list[Sequence] = []   # inserted, prompt not started
        self.running: list[Sequence] = []   # prefilling or decoding
        self.by_uid: dict[int, Sequence] = {}
        self.uid_of: dict[str, int] = {}

    def add(self, seq: Sequence) -> None:
        p = seq.params
        (uid,) = self.gen.insert([seq.prompt_token_ids], max_tokens=[seq.max_tokens],
                                 samplers=[None if p.greedy else seq.sampler],  # None: batched argmax
                                 logits_processors=[list(seq.sampler.processors)])
        self.by_uid[uid], self.uid_of[seq.request_id] = seq, uid
        self.waiting.append(seq)

    def start(self, seq: Sequence, now: float) -> None:
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = now
        if seq in self.waiting:
            self.waiting.remove(seq)
            self.running.append(seq)
            seq.status = SequenceStatus.RUNNING

    def update(self, seq: Sequence, token: int, length_done: bool) -> None:
        """seq sampled token: the cache holds every token before it; append it (checking stops).

        length_done: the generator has no more tokens for seq (its own max_tokens).
        """
        seq.num_computed_tokens = seq.num_tokens
        status = self.stop_checker.append(seq, token)
        if status is None and length_done:
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            self.finish(seq, status)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End seq: drop it from the generator."""
        seq.status = status
        uid = self.uid_of.pop(seq.request_id, None)
        if uid is not None:
            self.by_uid.pop(uid, None)
            self.gen.remove([uid])  # a uid the generator already finished is ignored
        for q in (self.waiting, self.running):
            if seq in q:
                q.remove(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)


class DenseEngine(RequestTable):
    """mlx-lm's BatchGenerator (dense caches, continuous batching) behind the Engine protocol.

    Args:
        model: an mlx-lm model.
        tokenizer: mlx-lm's TokenizerWrapper.
        info: macinfer.modelio.loader.ModelInfo, or None.
        serial: serve one request at a time (macinfer.llm sets it for a model whose attention
            the paged engine could not see: macinfer.kv.model_probe.UnseenAttention).
        fallback_reason: why the paged engine refused the model (macinfer.llm), or None.
        **options: EngineConfig fields; only max_num_seqs, max_num_batched_tokens (the
            prefill chunk), max_model_len and verbose are used (module docstring).

    Raises:
        MacinferError: BatchGenerator cannot batch the model's caches either.
    """

    attention_backend = "mlx-lm"
    spec = None
    features = EngineFeatures(paged=False, prefix_cache=None, speculation=None, structured_output=False)

    def __init__(self, model, tokenizer, info=None, serial: bool = False, fallback_reason: str | None = None,
                 **options):
        from mlx_lm.generate import BatchGenerator

        full = EngineConfig(**options)  # same validation (and TypeError on unknown options) as LLMEngine
        self.model, self.tokenizer, self.info = model, tokenizer, info
        self.model_type = getattr(info, "model_type", None) or getattr(model, "model_type", "?")
        self.fallback_reason = fallback_reason
        # NOTE: mlx-lm prefills prompts that join together as one right-padded batch; with a
        # recurrent state (ArraysCache: SSM, RWKV, linear attention) the padding leaks into the
        # state (BatchGenerator alone then differs from generate_step: rwkv7, mamba, ... in
        # scripts/arch_census.py), so such models prefill one prompt at a time.
        plain_kv = batchable(model, self.model_type)
        # serial: one request at a time, for a model whose attention is its own code (the paged
        # engine's UnseenAttention refusal): mlx-lm builds its batch masks for its own sdpa, and such a
        # layer may broadcast them wrongly (phi3small's block-sparse layers line the mask's rows up
        # with their kv heads: an error, or with as many rows as kv heads, masks on the wrong rows).
        self.serial = serial
        rows = 1 if serial else full.max_num_seqs
        self.config = DenseConfig(rows, full.max_num_batched_tokens, full.max_model_len, full.verbose)
        self.max_num_seqs = rows
        self.max_model_len = full.max_model_len or (info.context_length if info is not None else
                                                    getattr(getattr(model, "args", None), "max_position_embeddings", None) or 4096)
        self.gen = BatchGenerator(model, max_tokens=256, completion_batch_size=rows,
                                  prefill_batch_size=min(8, rows) if plain_kv else 1,
                                  prefill_step_size=full.max_num_batched_tokens)
        self.scheduler = _DenseRequests(self.gen, StopChecker(getattr(tokenizer, "eos_token_ids", None)))
        self.output = OutputProcessor()
        if full.verbose:
            print(self.describe(), file=sys.stderr)

    def describe(self) -> str:
        rows = "one request at a time (its attention is its own code)" if self.serial else \
            f"max {self.config.max_num_seqs} sequences"
        return (f"KV cache: dense, per request (mlx-lm BatchGenerator; off: {', '.join(OFF_FEATURES)}); "
                f"{rows}, prefill chunks of {self.config.max_num_batched_tokens} "
                f"tokens; attention: {self.attention_backend}")

    def kv_stats(self) -> dict:
        """KV usage now. There are no blocks (None); bytes are what the dense caches hold."""
        running = self.scheduler.running
        live = sum(s.num_computed_tokens for s in running)
        nbytes = self.gen.prompt_cache_nbytes
        return {
            "num_blocks": None, "block_size": None, "used_blocks": None, "free_blocks": None,
            "capacity_tokens": None, "usage": None,
            "live_tokens": live,
            "reserved_bytes": nbytes, "live_bytes": nbytes, "pool_bytes": nbytes, "draft_bytes": None,
            "running": len(running), "waiting": len(self.scheduler.waiting),
        }

    def prepare(self) -> None:
        """Nothing to build ahead: no structured output here."""

    def release_thread(self) -> None:
        """Nothing kept per thread beyond what mlx-lm's generator frees itself."""

    # -- requests -----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    fork_of: str | None = None, mm=None) -> str:
        """Queue a request (as LLMEngine.add_request; no KV-capacity check: caches are dense,
        so a fork (`fork_of`) shares nothing and runs as a request of its own). No images (`mm`)."""
        if mm is not None:
            raise MacinferError(f"images need the paged engine; {self.model_type} runs on mlx-lm's fallback engine")
        if params is not None and params.structured is not None:
            raise MacinferError(f"structured output needs the paged engine; {self.model_type} runs on mlx-lm's "
                                "fallback engine, which cannot constrain sampling")
        seq = new_sequence(self, prompt, params, request_id, arrival_time)
        self.output.add(seq)
        self.scheduler.add(seq)
        return seq.request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its final delta comes with the next step()."""
        seq = self.output.get(request_id)
        if seq is None or seq.is_finished:
            return
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self.output.aborted(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.output.has_pending

    # -- the step -----------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """One BatchGenerator step (a prefill chunk and/or one decode of the batch).

        Returns:
            A StreamDelta for every request that produced text or finished.
        """
        deltas = self.output.take_pending()
        if not self.scheduler.has_unfinished():
            return deltas
        t0 = time.perf_counter()
        prompt_resps, gen_resps = self.gen.next()
        by_uid = self.scheduler.by_uid
        for r in prompt_resps:
            seq = by_uid.get(r.uid)
            if seq is not None:
                self.scheduler.start(seq, t0)
        moved = []
        for r in gen_resps:
            seq = by_uid.get(r.uid)
            if seq is None or seq.is_finished:
                continue  # stopped (or aborted) by us a step ago: the generator's extra row
            self.scheduler.start(seq, t0)
            if seq.logprobs is not None:  # BatchGenerator's logprobs are mlx-lm's: after the processors
                seq.pending_logprob = from_vector(r.logprobs, int(r.token), seq.params.logprobs)
            self.scheduler.update(seq, int(r.token), length_done=r.finish_reason is not None)
            moved.append(seq)
        return deltas + self.output.deltas(moved)

    def close(self) -> None:
        self.gen.close()
