"""Runs one scheduled step through the model and samples the next tokens.

Batch shapes. mlx-lm models take (B, L) token arrays with one rope offset per row,
so a step is cut into a few forwards:

  - every row with 1 new token (decodes, and a 1-token prefill tail) goes into ONE
    forward of shape (B, 1), rows at different positions (per-row rope offsets,
    per-row context lengths in attention);
  - prefill chunks go into (B, L) forwards padded at the end to the longest,
    grouped so that padding stays under 25% of the rows computed.

Padding a long chunk and 31 decodes into one (32, L) batch would compute
31 * (L - 1) wasted rows, so the split is the cheaper "mixed batch". The forwards of a step
are evaluated one after the other (see the NOTE in execute_model).

Sampling is per request (each Sequence owns a Sampler with its own RNG key), so
a seeded request draws the same tokens whatever else is in the batch. Greedy
rows share one argmax, except `per_row` ones (penalties, logit_bias, logprobs:
`sample_row`), which never carry drafts. Rows with structured output sample from logits masked by
their grammar (macinfer.core.grammar); the masks are computed while MLX runs the forward. In a
launched (pipelined) decode they are held back and sampled by `launch_held` once their matchers
have the step before's tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from macinfer.kv.model_probe import install_attention_patch
from macinfer.kv.paged_cache import ForwardContext, LayerSpec, PagedKVCache
from macinfer.kv.rope import install_shared_rope
from macinfer.kv.state_cache import StateStore, honours_lengths, layout_caches
from macinfer.core.grammar import apply_masks
from macinfer.core.decode_graph import DecodeGraph
from macinfer.core.evaluator import StepEvaluator
from macinfer.core.lm_head import split_head
from macinfer.core.logprobs import LogprobRows
from macinfer.core.scheduler import ScheduledSequence


class HeldRows(NamedTuple):
    """The rows of a launched decode that are sampled later (structured output: ModelRunner.launch_held)."""

    index: list[int]  # their rows in the step
    logits: mx.array  # (G, V), evaluated with the step


class ModelRunner:
    """Owns the KV pools of every layer and executes scheduled steps.

    Args:
        model: an mlx-lm model (already probed by `inspect_model`).
        specs: one LayerSpec per layer.
        num_blocks: blocks per pool (block 0 is the null block).
        block_size: token slots per block.
        batch_decode: False if the model cannot take per-row rope offsets; decodes
            then run one row per forward.
        kv_bits, kv_group_size: quantised K/V pools (macinfer.kv.quant), or None.
        evaluator: where launched (pipelined) steps are evaluated (default: mx.async_eval).
        attention_fn: paged attention for every layer (a kernel dispatch); None: the reference.
        fill_masks: structured output: matchers -> int32 (B, W) token bitmasks (GrammarCompiler).
        hidden_sink: reported each forward's final hidden states (a feature draft):
            sink(seqs, starts, counts, hidden (B, L, D)).
        verifier: verifies a forward holding drafted tokens (macinfer.spec_decode.decoder.verify_rows):
            verifier(group, rows, logits (B, L, V)) -> [(row index, [num_accepted, tokens...])].
        compile_decode: launched decodes as compiled graphs (macinfer.core.decode_graph).
        compile_verify: forwards holding drafts as compiled graphs, where few enough rows (the same).
        slot_of: models with state layers: seq -> its state slot (macinfer.core.state_pool.StatePool).
        images: a vision-language model's image encoder (macinfer.modelio.vision.ImageEncoder: `embed`,
            `embed_tokens`): prefill chunks over image tokens run on input embeddings. None: text only.
    """

    def __init__(self, model: nn.Module, specs: list[LayerSpec], num_blocks: int, block_size: int,
                 batch_decode: bool = True, kv_bits: int | None = None, kv_group_size: int | None = None, *,
                 evaluator: StepEvaluator | None = None, attention_fn=None, fill_masks=None, hidden_sink=None,
                 verifier=None, compile_decode: bool = False, compile_verify: bool = False, slot_of=None,
                 images=None):
        self.model = model
        self.images = images
        self.block_size = block_size
        self.evaluator = evaluator or StepEvaluator(threaded=False)
        self.batch_decode = batch_decode
        self.pick_last_rows = norm_applied_once(model)  # prefill: the head on each row's last position only
        self.ctx = ForwardContext(attention_fn=attention_fn)
        if kv_bits:
            from macinfer.kv.quant import QuantizedPagedKVCache

            self.caches = [QuantizedPagedKVCache(self.ctx, spec, num_blocks, block_size, kv_bits, kv_group_size)
                           for spec in specs]
        else:
            self.caches = [PagedKVCache(self.ctx, spec, num_blocks, block_size) for spec in specs]
        # Hybrid / SSM models: a state slot per sequence beside the KV pools (macinfer.kv.state_cache);
        # self.caches is then the model's own cache layout (attention and state layers interleaved).
        self.states = None
        self.pool_caches = self.caches  # every paged cache, flat (the prefix cache's disk tier reads them)
        if getattr(specs, "states", None):
            self.states = StateStore(specs, slot_of, honours_lengths=honours_lengths(model))
            self.caches = self.states.model_caches(self.caches)
        elif getattr(specs, "layout", None):  # CacheLists of paged caches only (deepseek_v32's indexer)
            self.caches = layout_caches(specs.layout, self.caches)
        install_attention_patch(model)
        if specs:  # a model without attention layers (mamba2) has no RoPE to share
            install_shared_rope(model, specs[0].dtype, specs[0].k_head_dim)  # CPU backend: angles once per forward
        mx.eval([c.state for c in self.caches])
        self.hidden_sink = hidden_sink
        # The model split where its lm_head reads the final hidden states (a feature draft reads them too).
        self.body, self.lm_head = split_head(model) if hidden_sink is not None else (None, None)
        # Arrays evaluated with each forward (see the NOTE in execute_model): the hidden states a feature
        # draft reads, the logits every rank evaluates across ranks (macinfer.engine.distributed).
        self._with_forward: list[mx.array] = []
        self.logprob_rows = LogprobRows()  # this step's logprobs, handed over with its tokens
        self.verifier = verifier
        self.fill_masks = fill_masks
        self.decode_graph = (DecodeGraph(self, decode=compile_decode, verify=compile_verify)
                             if compile_decode or compile_verify else None)

    @property
    def num_setups(self) -> int:
        """Compiled forwards so far that traced or were checked (a step with one took longer than its kind)."""
        return 0 if self.decode_graph is None else self.decode_graph.num_setups

    def _hidden(self, tokens: mx.array, seqs: list, starts: list[int], counts: list[int]) -> mx.array:
        """The final hidden states (B, L, D) of a forward, reported to the sink."""
        h = self.body(tokens, cache=self.caches)
        self._report(seqs, starts, counts, h)
        return h

    def _report(self, seqs: list, starts: list[int], counts: list[int], h: mx.array) -> None:
        """Hand a forward's final hidden states (lazy) to the sink."""
        self.hidden_sink(seqs, starts, counts, h)
        # Evaluated with the forward even when nothing is sampled (a mid-prefill chunk): a lazy h
        # still reads the pools, and a later write to them would then copy every pool.
        self._with_forward.append(h)

    def _take_with_forward(self) -> list[mx.array]:
        out, self._with_forward = self._with_forward, []
        return out

    def sample_row(self, seq, logits: mx.array, history: mx.array | None = None,
                   into: LogprobRows | None = None) -> mx.array:
        """A per_row sequence's next token (1,) from its logits (1, V), lazily.

        Args:
            history: the sequence's token ids so far (default: seq.token_ids), what penalties read.
            into: where the token's logprobs go, if the request asked (default: this step's rows).
        """
        sampler = seq.sampler
        if history is None and sampler.processors:
            history = mx.array(seq.token_ids, dtype=mx.int32)
        logprobs = sampler.logprobs(logits, history)
        token = sampler.pick(logprobs)
        if seq.params.logprobs is not None:
            (self.logprob_rows if into is None else into).add(seq, logprobs, token)
        return token

    @property
    def kv_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def forward(self, rows: list[ScheduledSequence], all_logits: bool = False, head=None) -> mx.array:
        """One forward over rows padded to the longest -> each row's last real logits (B, V).

        Args:
            rows: each row's sequence and how many new tokens it computes (drafted tokens
                follow its last real one: macinfer.spec_decode.decoder).
            all_logits: the logits of every position instead: (B, L, V).
            head: applied to the final hidden states of the model's body (`model.model`)
                instead of the model's own head (a draft's head over part of the vocabulary).
        """
        starts = [r.seq.num_computed_tokens for r in rows]
        tokens = []
        for r, start in zip(rows, starts):
            ids = r.seq.token_ids[start: start + r.num_new_tokens]
            if len(ids) < r.num_new_tokens:
                ids = ids + r.seq.spec_token_ids[: r.num_new_tokens - len(ids)]
            tokens.append(ids)
        return self.run_forward([r.seq.block_table for r in rows], starts, tokens, [r.seq for r in rows],
                                all_logits, head, [r.seq.num_prompt_tokens for r in rows])

    def run_forward(self, tables: list[list[int]], starts: list[int], tokens: list[list[int]], seqs=None,
                    all_logits: bool = False, head=None, prompt_lens: list[int] | None = None) -> mx.array:
        """The forward of `forward`, from its plan: row i computes tokens[i] from position starts[i].

        `seqs` (the rows' sequences) is needed only by state layers and a hidden-state sink;
        a rank that follows another's plan (macinfer.engine.distributed) has neither. prompt_lens:
        the rows' prompt lengths, for a prompt window (ForwardContext.prompt_lens), if known.
        Padding sits at the end of a row: its tokens are id 0, its K/V writes go to
        the null block, its queries see only garbage that nobody reads.
        """
        counts = [len(t) for t in tokens]
        graph = self.decode_graph
        if all_logits and head is None and graph is not None and graph.verifies(len(tokens), max(counts)):
            logits, h = graph.verify_logits(tables, starts, tokens, prompt_lens, self.hidden_sink is not None)
            if h is not None:
                self._report(seqs, starts, counts, h)
            return logits
        L = self.set_context(tables, starts, counts, prompt_lens)
        last = [n - 1 for n in counts]
        if self.states is not None:
            self.states.bind(seqs, counts, L)
        inputs = mx.array([t + [0] * (L - len(t)) for t in tokens], dtype=mx.int32)
        embeds = self._input_embeddings(seqs, starts, counts, inputs) if self.images is not None and seqs else None
        if embeds is not None:  # a prefill chunk over image tokens: the model takes embeddings
            return self._forward_embeddings(inputs, embeds, last, all_logits)
        if self.hidden_sink is not None or head is not None:
            if self.hidden_sink is not None:  # a feature draft wants every position's hidden state
                h = self._hidden(inputs, seqs, starts, counts)
            else:
                h = self.model.model(inputs, cache=self.caches)
            head = head or self.lm_head
            if all_logits:
                return head(h)
            h = h[:, -1] if all(n == L - 1 for n in last) else h[mx.arange(len(tokens)), mx.array(last)]
            return head(h)  # (B, V): the head on the sampled positions only
        if all_logits:
            return self.model(inputs, cache=self.caches)  # (B, L, V)
        logits = (self.model(inputs, cache=self.caches) if L == 1 or not self.pick_last_rows
                  else _last_rows_only(self.model, inputs, self.caches, last))
        if logits.shape[1] == 1:  # the head ran on each row's last real position only
            return logits[:, 0, :]
        if all(n == L - 1 for n in last):
            return logits[:, -1, :]
        return logits[mx.arange(len(tokens)), mx.array(last)]

    def _input_embeddings(self, seqs: list, starts: list[int], counts: list[int], inputs: mx.array) -> mx.array | None:
        """The forward's input embeddings (B, L, D) if a row covers image tokens, else None.

        A row whose chunk starts before its images' end takes its prompt embeddings (the image features
        in place) for those positions, computed once per request (MultiModalInputs.embeds) and dropped by
        the chunk that reaches the end; every other position is the plain token embedding.
        """
        rows = [b for b, s in enumerate(seqs) if s.mm is not None and starts[b] < s.mm.end]
        if not rows:
            return None
        plain = self.images.embed_tokens(inputs)  # (B, L, D)
        out = []
        for b in range(len(seqs)):
            if b not in rows:
                out.append(plain[b])
                continue
            mm, start = seqs[b].mm, starts[b]
            if mm.embeds is None:
                mm.embeds = self.images.embed(mm, seqs[b].prompt_token_ids)  # (end, D), evaluated
            k = min(counts[b], mm.end - start)
            out.append(mx.concatenate([mm.embeds[start: start + k].astype(plain.dtype), plain[b, k:]]))
            if start + counts[b] >= mm.end:
                mm.embeds = None  # its image tokens are all in the cache after this forward
        return mx.stack(out)

    def _forward_embeddings(self, inputs: mx.array, embeds: mx.array, last: list[int], all_logits: bool) -> mx.array:
        """`run_forward` on input embeddings: each row's last real logits (B, V), or every position's."""
        logits = self.model(inputs, cache=self.caches, input_embeddings=embeds)  # (B, L, V)
        if all_logits:
            return logits
        L = inputs.shape[1]
        if all(n == L - 1 for n in last):
            return logits[:, -1, :]
        return logits[mx.arange(inputs.shape[0]), mx.array(last)]

    def set_context(self, tables: list[list[int]], starts: list[int], counts: list[int],
                    prompt_lens: list[int] | None = None) -> int:
        """Set the metadata every layer's cache reads for the next forward; returns its length L.

        Row i computes counts[i] new tokens from position starts[i] through its block table
        tables[i]; rows are right-padded to L = max(counts), and padding writes go to the
        null block (slot 0 of block 0). prompt_lens: each row's prompt length (a prompt
        window, ForwardContext.prompt_lens), if known.
        """
        bs = self.block_size
        L = max(counts)
        slots = []  # built here, not as graph ops: each op costs dispatch time on the CPU
        for table, start, n in zip(tables, starts, counts):
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)] + [0] * (L - n)
        c = self.ctx
        c.offsets = starts[0] if len(starts) == 1 else mx.array(starts, dtype=mx.int32)
        c.block_tables = tables
        c.context_lens = [s + L for s in starts]
        c.prompt_lens = prompt_lens
        c.counts = list(counts)
        c.slot_ids = mx.array(slots, dtype=mx.int32)
        c.memo = {}
        return L

    def launch_decode(self, seqs: list, tokens: mx.array) -> tuple[mx.array, LogprobRows, HeldRows | None]:
        """Async scheduling: queue one decode row per sequence without waiting for anything.

        Each seq computes the token at position seq.num_computed_tokens (its slot is
        allocated); `tokens` (B,) are the input ids, usually the previous step's sampled
        ids, still lazy. The graph is built now and launched (self.evaluator: mx.async_eval, or a
        worker thread on the CPU backend), so the host can resolve the previous step (and build
        the next one) while this one computes, as mlx-lm's generate_step does. Returns the lazy
        sampled ids (B,), the rows' logprobs (delivered when the ids are read back, after
        `self.evaluator.last.wait()`), and the rows held back: those with a grammar are not
        sampled (their mask needs the token the step before is still computing), their ids are
        0 until `launch_held` splices theirs in.
        """
        alone = self.ctx.attention_fn is not None  # a kernel dispatch checks shape classes as the forward is built
        if alone:
            self.evaluator.drain()  # that evaluates: nothing may be evaluating beside it
        if self.decode_graph is not None and self.decode_graph.usable(seqs):
            logits = self.decode_graph.logits(seqs, tokens)  # (B, V)
        else:
            logits = self._decode_logits(seqs, tokens)
        index = [j for j, s in enumerate(seqs) if s.grammar is not None]
        held = None
        if index:
            held = HeldRows(index, logits if len(index) == len(seqs) else logits[mx.array(index)])  # (G, V)
        logprob_rows = LogprobRows()
        sampled = self._sample_rows(seqs, logits, logprob_rows, tokens, skip=set(index))
        # The pools too: each forward's K/V writes must be queued before the next is built on them.
        self.evaluator.launch([sampled, [c.state for c in self.caches], self._take_with_forward(),
                               logprob_rows.arrays(), [] if held is None else held.logits], inline=alone, step=True)
        return sampled, logprob_rows, held

    def _decode_logits(self, seqs: list, tokens: mx.array) -> mx.array:
        """The eager decode forward of launch_decode: (B, V)."""
        starts = [s.num_computed_tokens for s in seqs]
        self.set_context([s.block_table for s in seqs], starts, [1] * len(seqs), [s.num_prompt_tokens for s in seqs])
        if self.states is not None:  # the rows' states may be the step in flight's lazy outputs: fine
            self.states.bind(seqs, [1] * len(seqs), 1)
        if self.hidden_sink is None:
            return self.model(tokens.reshape(-1, 1), cache=self.caches)[:, -1, :]
        return self.lm_head(self._hidden(tokens.reshape(-1, 1), seqs, starts, [1] * len(seqs))[:, -1, :])

    def launch_held(self, seqs: list, held: HeldRows, sampled: mx.array, into: LogprobRows) -> mx.array:
        """Sample a launched decode's held rows, now that each one's matcher has consumed its input id.

        Args:
            seqs: the launched step's sequences; its held rows that finished meanwhile keep id 0.
            held: what launch_decode held back; its logits are evaluated by the step's job.
            sampled: the step's ids (B,), lazy.
            into: the step's logprobs.

        Returns:
            The step's ids (B,) with the held rows' spliced in, launched behind the step: the
            next step may take them as its inputs, and reading them waits for `self.evaluator.last`.
        """
        live = [i for i, j in enumerate(held.index) if not seqs[j].is_finished]
        if not live:
            return sampled
        rows = [seqs[held.index[i]] for i in live]
        logits = held.logits if len(live) == len(held.index) else held.logits[mx.array(live)]
        # llguidance drops the GIL: the masks are computed while the step's forward runs
        ids = self._sample_rows(rows, apply_masks(logits, self.fill_masks([s.grammar for s in rows])), into)
        B = sampled.shape[0]
        order = list(range(B))  # row j's id: sampled[j], or ids[k] (at B + k) for the k-th live held row
        for k, i in enumerate(live):
            order[held.index[i]] = B + k
        out = mx.concatenate([sampled, ids.astype(sampled.dtype)])[mx.array(order)]
        self.evaluator.launch([out, into.arrays()], inline=self.ctx.attention_fn is not None)
        return out

    def _sample_rows(self, seqs: list, logits: mx.array, into: LogprobRows, inputs: mx.array | None = None,
                     skip: set[int] = frozenset()) -> mx.array:
        """Each row's next token (B,) from launched logits (B, V), lazily; `skip` rows get id 0.

        inputs: the rows' input ids (B,), lazy, if their sequences do not hold them yet.
        """
        if all(s.sampler.params.greedy and not s.sampler.per_row for s in seqs):
            return mx.argmax(logits, axis=-1)  # skipped rows too: overwritten, and one argmax is cheaper
        return mx.concatenate([mx.zeros((1,), mx.uint32) if j in skip else
                               self._launch_row(s, logits[j: j + 1], None if inputs is None else inputs[j: j + 1], into)
                               for j, s in enumerate(seqs)])

    def _launch_row(self, seq, logits: mx.array, token: mx.array | None, logprob_rows: LogprobRows) -> mx.array:
        """One row of a launched decode: (1, V) logits -> (1,) token; `token` is its input id if still lazy."""
        sampler = seq.sampler
        if not sampler.per_row:
            return mx.argmax(logits, axis=-1) if sampler.params.greedy else sampler(logits)
        history = None
        if sampler.processors:
            history = mx.array(seq.token_ids, dtype=mx.int32)
            if token is not None and len(seq.token_ids) == seq.num_computed_tokens:  # the step in flight's id
                history = mx.concatenate([history, token.astype(mx.int32)])
        return self.sample_row(seq, logits, history, into=logprob_rows)

    def _verify(self, group: list[int], rows: list[ScheduledSequence], pending: list) -> list:
        """A forward holding drafts: the verifier's rows, and per_row rows (no drafts) sampled into pending."""
        logits = self._masked(rows, self.forward(rows, all_logits=True))  # (B, L, V)
        own = [j for j, r in enumerate(rows) if r.samples and r.seq.sampler.per_row]
        if not own:
            return self.verifier(group, rows, logits)
        for j in own:
            assert not rows[j].num_spec_tokens, rows[j]  # per_row requests never draft
            pending.append(([group[j]], self.sample_row(rows[j].seq, logits[j, rows[j].num_new_tokens - 1][None])))
        rest = [j for j in range(len(rows)) if j not in own]
        return self.verifier([group[j] for j in rest], [rows[j] for j in rest], logits[mx.array(rest)])

    def refeed_rejected(self, rows: list[ScheduledSequence], results: list[tuple[int, mx.array]],
                        group: list[int]) -> int:
        """Speculative decoding on a model with state layers: after a verify forward, rows that rejected
        some of their drafts get the state of their accepted tokens only.

        The verify forward ran every drafted token through the state layers, and a recurrent state cannot
        be trimmed like K/V. So such a row's slot goes back to the state before the forward and one more
        forward feeds the row's real token and its accepted drafts again (right-padded, per-row lengths):
        it rewrites the K/V those positions already hold and leaves the state just past them. Rows that
        accepted everything keep the verify forward's state. Costs a forward per step with a rejection,
        which the adaptive K sees in its measured step times.

        Args:
            rows: the verify forward's ScheduledSequences.
            results: (scheduled index, evaluated [num_accepted, tokens...]) of its sampling rows.
            group: each row's scheduled index.

        Returns:
            How many rows were fed again.
        """
        accepted = {i: int(res[0].item()) for i, res in results}
        redo = [ScheduledSequence(r.seq, r.num_new_tokens - r.num_spec_tokens + accepted[i], accepted[i])
                for i, r in zip(group, rows)
                if r.num_spec_tokens and accepted.get(i, r.num_spec_tokens) < r.num_spec_tokens]
        if not redo:
            return 0
        self.states.rollback([r.seq for r in redo])
        for sub in self._groups(redo):  # unpadded groups for models that ignore lengths
            self.forward([redo[i] for i in sub])  # a feature draft's sink sees these positions again
            mx.eval([c.state for c in self.caches] + self._take_with_forward())  # see execute_model's NOTE
        return len(redo)

    def _groups(self, scheduled: list[ScheduledSequence]) -> list[list[int]]:
        """Rows per forward: all 1-token rows together; chunks batched while padding stays small.

        A decode row with drafts (1 token + k drafts) joins the 1-token rows: the forward is
        padded to 1 + max k, which costs far less than a second forward (spec_decode's model).
        """
        if not self.batch_decode:
            return [[i] for i in range(len(scheduled))]
        ones = [i for i, s in enumerate(scheduled) if s.num_new_tokens - s.num_spec_tokens == 1]
        groups = [ones] if ones else []
        chunks = sorted((i for i, s in enumerate(scheduled) if s.num_new_tokens - s.num_spec_tokens > 1),
                        key=lambda i: -scheduled[i].num_new_tokens)
        group, real = [], 0
        for i in chunks:  # longest first, so a group's first row sets its padded length
            n = scheduled[i].num_new_tokens
            if group and (len(group) + 1) * scheduled[group[0]].num_new_tokens > 1.25 * (real + n):
                groups.append(group)
                group, real = [], 0
            group.append(i)
            real += n
        if group:
            groups.append(group)
        if self.states is not None and not self.states.honours_lengths:
            # State layers that fold padding into their state (mamba v1): unpadded rows only.
            groups = [[i for i in g if scheduled[i].num_new_tokens == n]
                      for g in groups for n in sorted({scheduled[i].num_new_tokens for i in g})]
        return groups

    def _masked(self, rows: list[ScheduledSequence], logits: mx.array) -> mx.array:
        """The logits with each structured-output row's grammar mask applied (the others as they are).

        The forward is queued first, so the masks are computed (native threads, no GIL) while it runs.
        """
        matchers = [r.seq.grammar if r.samples else None for r in rows]
        if all(m is None for m in matchers):
            return logits
        mx.async_eval(logits, [c.state for c in self.caches])
        return apply_masks(logits, self.fill_masks(matchers))

    def execute_model(self, scheduled: list[ScheduledSequence]) -> list[int | list[int] | None]:
        """Compute this step's tokens; return the sampled token per row (None: mid-prefill).

        A forward holding drafted tokens is verified as a whole (self.verifier, spec.decoder.verify_rows):
        each of its sampling rows gets a list, the accepted drafts then the target's token.
        """
        pending: list[tuple[list[int], mx.array]] = []  # (row indices, sampled ids)
        verified: list[tuple[int, mx.array]] = []  # (row index, [num_accepted, tokens...])
        for group in self._groups(scheduled):
            rows = [scheduled[i] for i in group]
            if any(r.num_spec_tokens for r in rows):
                new = self._verify(group, rows, pending)
                verified += new
                mx.eval([v for _, v in verified] + [ids for _, ids in pending] + [c.state for c in self.caches]
                        + self._take_with_forward() + self.logprob_rows.arrays())  # the NOTE below
                if self.states is not None:  # recurrent states must not keep rejected drafts
                    self.refeed_rejected(rows, new, group)
                continue
            logits = self._masked(rows, self.forward(rows))  # (B, V)
            greedy = [j for j, r in enumerate(rows)
                      if r.samples and r.seq.sampler.params.greedy and not r.seq.sampler.per_row]
            if greedy:
                picked = logits if len(greedy) == len(rows) else logits[mx.array(greedy)]
                pending.append(([group[j] for j in greedy], mx.argmax(picked, axis=-1)))
            for j, r in enumerate(rows):
                if r.samples and r.seq.sampler.per_row:
                    pending.append(([group[j]], self.sample_row(r.seq, logits[j: j + 1])))
                elif r.samples and not r.seq.sampler.params.greedy:
                    pending.append(([group[j]], r.seq.sampler(logits[j: j + 1])))
            # NOTE: evaluate each forward (pools included: a mid-prefill chunk samples
            # nothing, yet its K/V writes must happen) before building the next. The
            # pools are updated in place only while no other array shares their
            # buffer; a later forward chained onto this one's lazy pool views would
            # copy every pool instead (measured: seconds per step on a 256 MB pool).
            mx.eval([ids for _, ids in pending] + [c.state for c in self.caches] + self._take_with_forward()
                    + self.logprob_rows.arrays())
        self.logprob_rows.deliver()
        out: list[int | None] = [None] * len(scheduled)
        for idx, ids in pending:
            for i, t in zip(idx, ids.tolist()):
                out[i] = t
        for i, v in verified:
            row = v.tolist()
            out[i] = row[1: 2 + row[0]]
        return out


class _PickRows(nn.Module):
    """The model's final norm, applied to one position per row: (B, L, D) -> (B, 1, D)."""

    def __init__(self, norm: nn.Module, last: list[int], L: int):
        super().__init__()
        self.norm, self.last, self.L = norm, last, L

    def __call__(self, h):
        if h.ndim != 3 or h.shape[1] != self.L:
            return self.norm(h)  # not the shape we expect: leave it alone
        if all(n == self.L - 1 for n in self.last):
            return self.norm(h[:, -1:])
        return self.norm(h[mx.arange(h.shape[0]), mx.array(self.last)][:, None])


def norm_applied_once(model: nn.Module) -> bool:
    """Whether the model's final norm (`model.model.norm`) runs exactly once per forward, at the end.

    `_last_rows_only` picks each row's last position inside that norm, which is only right if
    nothing runs after it: a looped model (nanbeige: the layer stack num_loops times, each loop
    ending with the norm) would carry on with one position per row. Found by one lazy forward
    (shapes only) that counts the calls.
    """
    from mlx_lm.models.cache import make_prompt_cache

    body = getattr(model, "model", None)
    norm = getattr(body, "norm", None)
    if not isinstance(norm, nn.Module):
        return False
    calls = []

    class Count(nn.Module):
        def __call__(self, h):
            calls.append(1)
            return norm(h)

    body.norm = Count()
    try:
        model(mx.array([[0, 0]]), cache=make_prompt_cache(model))
    except Exception:  # noqa: BLE001 - a model we cannot probe runs whole
        return False
    finally:
        body.norm = norm
    return len(calls) == 1


def _last_rows_only(model: nn.Module, inputs: mx.array, caches: list, last: list[int]) -> mx.array:
    """The forward's logits at each row's position last[b] only, if the model allows: (B, 1, V).

    A prefill chunk needs the logits of one position per row, but mlx-lm models project
    every position through the LM head (on SmolLM2, 49152 x 576: ~20% of a prefill's
    FLOPs). The final norm and the head are per position, so picking the rows before the
    norm changes nothing else. Models without `model.norm` run whole: (B, L, V).
    """
    body = getattr(model, "model", None)
    norm = getattr(body, "norm", None)
    if not isinstance(norm, nn.Module):
        return model(inputs, cache=caches)
    body.norm = _PickRows(norm, last, inputs.shape[1])
    try:
        return model(inputs, cache=caches)
    finally:
        body.norm = norm

