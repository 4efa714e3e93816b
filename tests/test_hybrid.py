"""Hybrid linear-attention / SSM models (mlx-lm ArraysCache layers) on the paged engine, against mlx-lm.

Each family is a tiny random-weight model written as an mlx-lm directory (tests/tiny.py), loaded
once with mlx_lm.load; the oracle is mlx-lm's generate_step on each prompt alone. The engine
serves the prompts together, arriving at different steps, through a small token budget (chunked
prefill carrying the state from chunk to chunk, chunks of different lengths padded into one
forward with per-row lengths), with async decoding on.
"""

from __future__ import annotations

import random

import mlx.core as mx
import mlx_lm
import pytest
from driver import run
from mlx_lm.generate import generate_step

from macinfer.core.sampling import SamplingParams
from macinfer.engine.llm_engine import LLMEngine
from macinfer.errors import MacinferError
from macinfer.kv import state_cache
from macinfer.kv.model_probe import inspect_model
from tiny import build_tiny_model

# Configurations adapted from mlx-lm's tests/test_models.py, Copyright © 2023-2024 Apple Inc., MIT License
# (shrunk; on top of tiny.py's llama base: hidden 64, 4 heads, 2 KV heads, vocab 323).
_GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=3, head_dim=16, partial_rotary_factor=0.5, rope_theta=1000.0,
            full_attention_interval=2, num_hidden_layers=4)
HYBRID = {
    "qwen3_next": dict(model_type="qwen3_next", **_GDN, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                       shared_expert_intermediate_size=64, mlp_only_layers=[0], moe_intermediate_size=32),
    "qwen3_5": dict(model_type="qwen3_5", text_config=dict(
        model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-5, vocab_size=323, max_position_embeddings=512, tie_word_embeddings=True, **_GDN)),
    "lfm2": dict(model_type="lfm2", norm_eps=1e-5, full_attn_idxs=[1, 3], num_hidden_layers=4, conv_bias=True,
                 conv_L_cache=3, block_dim=64, block_ff_dim=128, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                 block_auto_adjust_ff_dim=False),
    "granitemoehybrid": dict(model_type="granitemoehybrid", num_hidden_layers=4, attention_bias=False,
                             embedding_multiplier=1.0, attention_multiplier=0.25, logits_scaling=1.0,
                             residual_multiplier=1.0, num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=64, mamba_n_heads=8, mamba_d_head=16, mamba_expand=2,
                             mamba_proj_bias=False, mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1,
                             mamba_conv_bias=False, layer_types=["mamba", "attention", "mamba", "attention"],
                             rope_theta=1000.0),
    "nemotron_h": dict(model_type="nemotron_h", num_hidden_layers=4, attention_bias=False, mamba_num_heads=4,
                       mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16, conv_kernel=3, n_groups=2,
                       time_step_limit=[0.01, 10.0], mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=True,
                       use_conv_bias=True, residual_in_fp32=True, hybrid_override_pattern=["*", "M", "-", "M"]),
    "falcon_h1": dict(model_type="falcon_h1", num_hidden_layers=2, head_dim=16, mamba_d_ssm=64, mamba_d_head=16,
                      mamba_n_heads=4, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16, mlp_expansion_factor=2,
                      rope_theta=10000.0),
    "mamba2": dict(model_type="mamba2", num_heads=8, head_dim=16, intermediate_size=128, expand=2, state_size=16,
                   num_hidden_layers=3, layer_norm_epsilon=1e-5, conv_kernel=3, n_groups=2, use_bias=False,
                   use_conv_bias=True, time_step_limit=[0.01, 10.0], time_step_rank="auto"),
    # Not in the brief's list, but the one family whose layers ignore `lengths`: unpadded groups only.
    "mamba": dict(model_type="mamba", intermediate_size=128, state_size=8, num_hidden_layers=2, conv_kernel=4,
                  use_bias=False, use_conv_bias=True, time_step_rank=4),
}

_built: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """hybrid("lfm2") -> (path, model, tokenizer), built and loaded once."""

    def get(name):
        if name not in _built:
            path = build_tiny_model(tmp_path_factory.mktemp(f"hybrid-{name}"), "llama", **HYBRID[name])
            _built[name] = (path, *mlx_lm.load(str(path)))
        return _built[name]

    return get


def oracle(model, prompt, max_tokens):
    """mlx-lm alone: greedy, EOS ignored (the engine's requests set ignore_eos)."""
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


def assert_all_free(engine):
    pool, states = engine.block_pool, engine.state_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks and pool.req_to_blocks == {}
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:]) and engine.requests == {}
    assert states.num_free_slots == states.num_slots == engine.config.max_num_seqs
    assert states.req_to_slot == {} and sorted(states.free_slots) == list(range(1, states.num_slots + 1))
    assert engine.runner.states._where == {}  # no state kept for anyone
    s = engine.kv_stats()
    assert s["state_slots_used"] == 0 and s["state_slots_free"] == engine.config.max_num_seqs


@pytest.fixture
def uneven(monkeypatch):
    """Counts forwards whose rows have different numbers of new tokens (per-row lengths)."""
    seen = {"uneven": 0, "forwards": 0}
    bind = state_cache.StateStore.bind

    def counting(self, seqs, counts, L):
        seen["forwards"] += 1
        seen["uneven"] += any(n != L for n in counts)
        return bind(self, seqs, counts, L)

    monkeypatch.setattr(state_cache.StateStore, "bind", counting)
    return seen


@pytest.mark.parametrize("name", list(HYBRID))
def test_staggered_chunked_batch_matches_mlx_lm(hybrid, uneven, name):
    path, model, tok = hybrid(name)
    rng = random.Random(name)
    # (arrival step, prompt length): two long prompts arrive together so their chunks share forwards.
    plan = [(0, 9), (1, 23), (1, 21), (3, 4)]  # step 2 pads chunks of 8 and 7 tokens into one forward
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for _, n in plan]
    engine = LLMEngine(model, tok, None, num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    assert "recurrent state: 4 slots" in engine.describe()
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    out = run(engine, [(s, p, params, f"r{i}") for i, ((s, _), p) in enumerate(zip(plan, prompts))])
    for i, p in enumerate(prompts):
        assert out[f"r{i}"].token_ids == oracle(model, p, 10), f"r{i}"
    want = oracle(model, prompts[1], 10)
    assert len(set(want)) > 3, "the model repeats itself: the test proves little"
    # mamba folds padding into its state; nemotron_h (mlx-lm 0.32.2) masks its conv but does not hand
    # `lengths` to ssm_update, so a right-padded row's SSM state is wrong: the probe finds both.
    assert engine.runner.states.honours_lengths == (name not in ("mamba", "nemotron_h"))
    if engine.runner.states.honours_lengths:
        assert uneven["uneven"] > 0, "no forward padded rows of different lengths"
    else:
        assert uneven["uneven"] == 0  # grouped by length instead
    assert_all_free(engine)


@pytest.mark.parametrize("name", ["qwen3_next", "falcon_h1", "mamba2"])
def test_preempted_mid_prefill_recomputes_same_tokens(hybrid, monkeypatch, name):
    path, model, tok = hybrid(name)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (14, 26, 18)]
    engine = LLMEngine(model, tok, None, num_blocks=13, block_size=4, max_num_batched_tokens=8, max_num_seqs=3,
                       async_scheduling=False)
    mid_prefill = []
    preempt = type(engine.scheduler)._preempt

    def spy(self, seq):
        mid_prefill.append(0 < seq.num_computed_tokens < seq.num_prompt_tokens)
        preempt(self, seq)

    monkeypatch.setattr(type(engine.scheduler), "_preempt", spy)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    out = run(engine, [(i, p, params, f"p{i}") for i, p in enumerate(prompts)])
    assert any(mid_prefill), f"no sequence was preempted mid-prefill: {mid_prefill}"
    for i, p in enumerate(prompts):
        assert out[f"p{i}"].token_ids == oracle(model, p, 12), f"p{i}"
    assert_all_free(engine)


def test_aborts_free_their_slots(hybrid):
    path, model, tok = hybrid("lfm2")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (25, 6, 9, 4)]
    engine = LLMEngine(model, tok, None, num_blocks=64, block_size=4, max_num_batched_tokens=8, max_num_seqs=3)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    arrivals = [(0, prompts[0], params, "mid-prefill"), (0, prompts[1], params, "a"),
                (1, prompts[2], params, "mid-decode"), (2, prompts[3], params, "b")]
    outputs, step = {}, 0
    while arrivals or engine.has_unfinished():
        for a in [a for a in arrivals if a[0] == step]:
            engine.add_request(a[1], a[2], request_id=a[3])
            arrivals.remove(a)
        if step == 2:
            assert 0 < engine.requests["mid-prefill"].num_computed_tokens < 25
            engine.abort_request("mid-prefill")  # its slot goes to "b", which must start from a fresh state
        if step == 7:
            assert engine.requests["mid-decode"].num_output_tokens > 0
            engine.abort_request("mid-decode")
        for d in engine.step():
            if d.output is not None:
                outputs[d.request_id] = d.output
        step += 1
    assert outputs["mid-prefill"].finish_reason == outputs["mid-decode"].finish_reason == "abort"
    assert outputs["a"].token_ids == oracle(model, prompts[1], 12)
    assert outputs["b"].token_ids == oracle(model, prompts[3], 12)
    assert_all_free(engine)


def test_budget_describe_and_stats(hybrid):
    path, model, tok = hybrid("qwen3_next")
    specs = inspect_model(model, "qwen3_next")
    assert len(specs) == 2 and len(specs.states) == 2 and [e[0] for e in specs.layout] == ["state", "kv"] * 2
    per_slot = specs.bytes_per_slot
    off = LLMEngine(model, tok, None, kv_memory="256KiB", block_size=4, max_num_seqs=3, max_model_len=512,
                    enable_prefix_cache=False)
    # The slots come out of the KV budget: fewer blocks than the same budget buys without them.
    assert off.state_bytes == 3 * per_slot and off.snapshot_bytes == 0 and off.snapshots is None
    assert off.block_pool.num_blocks == ((256 << 10) - 3 * per_slot) // off.bytes_per_block
    # With the prefix cache, state snapshots too: one per slot, at most a quarter of what the slots leave.
    engine = LLMEngine(model, tok, None, kv_memory="256KiB", block_size=4, max_num_seqs=3, max_model_len=512,
                       persist_prefix_cache=True)
    snap = min(3 * per_slot, ((256 << 10) - 3 * per_slot) // 4)
    assert engine.snapshot_bytes == snap == 3 * per_slot and "state snapshots: " in engine.describe()
    assert engine.block_pool.num_blocks == ((256 << 10) - 3 * per_slot - snap) // engine.bytes_per_block
    s = engine.kv_stats()
    assert (s["state_slots_used"], s["state_slots_free"], s["state_bytes"]) == (0, 3, 3 * per_slot)
    assert s["prefix_cache"] is True and s["state_snapshot_capacity"] == snap
    assert engine.block_pool.store is None  # NOTE in LLMEngine: no disk tier for models with state layers
    assert LLMEngine(model, tok, None, kv_memory="256KiB", block_size=4, max_num_seqs=3, max_model_len=512,
                     state_snapshot_memory="10KiB").snapshot_bytes == 10 << 10
    engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=3))
    engine.step()
    assert engine.kv_stats()["state_slots_used"] == 1
    with pytest.raises(MacinferError, match="recurrent state of 64 sequences"):  # chosen: kept or refused
        LLMEngine(model, tok, None, kv_memory="64KB", max_model_len=512, max_num_seqs=64)
    falcon = inspect_model(hybrid("falcon_h1")[1], "falcon_h1")
    assert [e[0] for e in falcon.layout] == ["list", "list"] and len(falcon) == 2


def test_a_small_budget_runs_fewer_sequences_of_a_hybrid(hybrid, capfd):
    """The default max_num_seqs' state slots outgrow a small KV budget: fewer sequences run (half the
    budget's worth of slots), said in one line, and generation is still mlx-lm's."""
    path, model, tok = hybrid("falcon_h1")
    per_slot = inspect_model(model, "falcon_h1").bytes_per_slot
    budget = 20 * per_slot  # 64 slots do not fit; 10 do in half of it
    engine = LLMEngine(model, tok, None, kv_memory=budget, block_size=4, max_model_len=256)
    assert engine.max_num_seqs == engine.state_pool.num_slots == 10 == engine.scheduler.config.max_num_seqs
    assert engine.state_bytes == 10 * per_slot
    note = [line for line in capfd.readouterr().err.splitlines() if "sequences run at once" in line]
    assert len(note) == 1 and "falcon_h1: the recurrent state of 64 sequences" in note[0] and "at most 10" in note[0]
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 9, 13)] * 4  # 12 requests for 10 slots
    out = run(engine, [(0, p, SamplingParams(max_tokens=4, ignore_eos=True), f"r{i}") for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts[:3]):
        assert out[f"r{i}"].token_ids == oracle(model, p, 4)
    with pytest.raises(MacinferError, match="recurrent state of 64 sequences"):  # chosen: refused, not lowered
        LLMEngine(model, tok, None, kv_memory=budget, block_size=4, max_model_len=256, max_num_seqs=64)


class ScriptedDrafter:
    """Drafts mlx-lm's own continuation with the first e of k drafts right and the rest wrong, e cycling
    through 0..k as the output grows: full, partial and no acceptance, deterministically."""

    name, has_model, hidden_sink = "scripted", False, None

    def __init__(self, script: dict, vocab: int):
        self.script, self.vocab, self.proposed = script, vocab, 0

    def available(self, seq, k):
        return k

    def propose(self, seqs, num_draft):
        for seq, k in zip(seqs, num_draft):
            cont, j = self.script[tuple(seq.prompt_token_ids)], seq.num_output_tokens
            want = (cont[j: j + k] + [0] * k)[:k]
            e = j % (k + 1)
            seq.spec_token_ids = want[:e] + [(t + 1) % self.vocab for t in want[e:]]
            seq.spec_probs = None
            self.proposed += k

    def remove(self, request_id):
        pass


@pytest.mark.parametrize("name", ["qwen3_next", "falcon_h1", "mamba2", "nemotron_h"])
def test_speculative_decoding_is_exact(hybrid, monkeypatch, name):
    from macinfer.core.model_runner import ModelRunner

    path, model, tok = hybrid(name)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (6, 17, 11)]
    want = [oracle(model, p, 14) for p in prompts]
    fed = []
    refeed = ModelRunner.refeed_rejected
    monkeypatch.setattr(ModelRunner, "refeed_rejected", lambda *a: fed.append(refeed(*a)) or fed[-1])
    drafter = ScriptedDrafter({tuple(p): w for p, w in zip(prompts, want)}, model_vocab(model))
    engine = LLMEngine(model, tok, None, num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=3,
                       draft=drafter, num_speculative_tokens=3, adaptive_speculation=False)
    out = run(engine, [(i, p, SamplingParams(max_tokens=14, ignore_eos=True), f"s{i}") for i, p in enumerate(prompts)])
    for i in range(len(prompts)):
        assert out[f"s{i}"].token_ids == want[i], f"s{i}"
    m = engine.spec_decoder
    assert drafter.proposed > 0 and sum(fed) > 0, "no draft was rejected: the rollback was never tested"
    accepted = sum(o.metrics.accepted_tokens for o in out.values())
    assert 0 < accepted < drafter.proposed, (accepted, drafter.proposed, m)
    assert_all_free(engine)


def model_vocab(model):
    return model.args.vocab_size if hasattr(model.args, "vocab_size") else model.args.text_config["vocab_size"]


def test_drafts_that_cannot_be_exact_are_refused(hybrid):
    path, model, tok = hybrid("lfm2")
    auto = LLMEngine(model, tok, None, num_blocks=16, draft="auto")  # nothing made for it: lookup alone
    assert auto.draft_choice.kind == "ngram" and auto.spec_decoder.drafter.name == "ngram"
    draft_path, draft_model, _ = hybrid("mamba2")
    with pytest.raises(MacinferError, match="draft models with recurrent state layers are not supported yet"):
        LLMEngine(model, tok, None, num_blocks=16, draft=draft_model)
