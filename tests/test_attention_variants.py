"""Families whose attention mlx-lm computes its own way, on the paged engine (macinfer.kv.attention_variants).

Each family is a tiny random-weight model written as an mlx-lm directory (config.json,
weights, the tiny tokenizer of tests/tiny.py) and loaded by mlx_lm.load. The engine serves
four staggered prompts with chunked prefill (and once more through a pool small enough to
preempt); every token must be what mlx-lm's own generate_step gives for that prompt alone.

The gemma3n, deepseek_v3 (also kimi_k25's text model) and glm4_moe_lite configurations are
adapted from mlx-lm's tests/test_models.py, Copyright © 2023-2024 Apple Inc., MIT License;
the others are sized alike (ministral3's and bailing_moe_v3's come from tests/arch_configs.json).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from macinfer.engine.llm_engine import LLMEngine
from macinfer.core.sampling import SamplingParams
from macinfer.kv import metal_attention as ma
from macinfer.kv.attention_variants import SharedKVView, batched_offsets_work
from macinfer.kv.paged_attention import paged_attention
from macinfer.kv.model_probe import inspect_model, supports_batched_offsets
from test_engine import assert_all_free, oracle, run
from tiny import train_tokenizer

GEMMA2 = {
    "model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
    "attn_logit_softcapping": 3.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16,
}
# Adapted from mlx-lm's tests/test_models.py (see the module docstring): 4 layers, the last 2 sharing K/V.
GEMMA3N = {
    "model_type": "gemma3n",
    "text_config": {
        "model_type": "gemma3n", "hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 128,
        "num_attention_heads": 4, "head_dim": 32, "rms_norm_eps": 1e-05, "num_key_value_heads": 2,
        "num_kv_shared_layers": 2, "sliding_window": 8, "max_position_embeddings": 1000,
        "rope_local_base_freq": 1.0, "rope_theta": 1000.0, "final_logit_softcapping": 1.0,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "activation_sparsity_pattern": [0.5, 0.5, 0.5, 0.5], "hidden_size_per_layer_input": 256,
        "altup_num_inputs": 4, "altup_coef_clip": 1.0, "altup_correct_scale": True, "altup_active_idx": 0,
        "laurel_rank": 8,
    },
}
GEMMA4 = {
    "model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_global_key_value_heads": 2, "head_dim": 16,
    "global_head_dim": 32, "sliding_window": 8, "hidden_size_per_layer_input": 16, "num_kv_shared_layers": 2,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "final_logit_softcapping": 30.0,
}
GPT_BIGCODE = {
    "model_type": "gpt_bigcode", "n_embd": 64, "n_layer": 2, "n_inner": 128, "n_head": 4, "n_positions": 512,
    "layer_norm_epsilon": 1e-5,
}
# MLA (multi-head latent attention), the next two adapted from mlx-lm's tests/test_models.py.
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "n_routed_experts": 4,
    "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "n_shared_experts": 1, "kv_lora_rank": 4,
    "q_lora_rank": 4, "qk_rope_head_dim": 32, "v_head_dim": 16, "qk_nope_head_dim": 32,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}
GLM4_MOE_LITE = {
    "model_type": "glm4_moe_lite", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
    "n_routed_experts": 4, "routed_scaling_factor": 1.0, "kv_lora_rank": 8, "q_lora_rank": 8,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 8, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2,
    "moe_layer_freq": 1, "first_k_dense_replace": 1, "max_position_embeddings": 256, "rms_norm_eps": 1e-05,
    "rope_theta": 1000.0, "attention_bias": False, "partial_rotary_factor": 1.0, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
}
KIMI_K25 = {"model_type": "kimi_k25", "text_config": dict(DEEPSEEK_V3)}
MISTRAL4 = {  # llama-4 query scaling from position 16 on, so per-row positions matter there too
    "model_type": "mistral4", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
    "n_routed_experts": 4, "routed_scaling_factor": 1.0, "kv_lora_rank": 16, "q_lora_rank": 16,
    "norm_topk_prob": True, "max_position_embeddings": 128, "rms_norm_eps": 1e-05, "topk_group": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 8,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "llama_4_scaling_beta": 0.1,
                        "original_max_position_embeddings": 16},
}
# Chunked local attention in 3 layers of 4 (chunks of 6 tokens: they end mid-block at block_size 4), a
# NoPE global layer whose query scaling grows every 8 positions (floor_scale 8: it bites at these lengths).
LLAMA4 = {
    "model_type": "llama4",
    "text_config": {
        "model_type": "llama4", "attention_bias": False, "attention_chunk_size": 6, "head_dim": 16, "hidden_size": 64,
        "interleave_moe_layer_step": 2, "intermediate_size": 64, "intermediate_size_mlp": 128,
        "max_position_embeddings": 1000, "num_attention_heads": 4, "num_experts_per_tok": 1, "num_hidden_layers": 4,
        "num_key_value_heads": 2, "num_local_experts": 2, "rms_norm_eps": 1e-5, "rope_theta": 1000,
        "use_qk_norm": True, "rope_scaling": None, "floor_scale": 8, "attn_scale": 0.5,
    },
}
# 4 layers, the last 2 attending to layer 1's K/V with queries of their own (mlx-lm rotates those at S - L).
AFM7 = {"model_type": "afm7", "hidden_dim": 64, "num_layers": 4, "num_kv_reuse_layers": 2, "num_heads": 4,
        "num_kv_heads": 2}
ARCH_CONFIGS = json.loads((Path(__file__).parent / "arch_configs.json").read_text())["configs"]
# MLA beside linear-attention (KDA) layers with recurrent state: the latent pages, the state gets slots.
BAILING_MOE_V3 = ARCH_CONFIGS["bailing_moe_v3"]
# The same beside KDA layers, but its MLA has no rope and masks its scores with a boolean array.
KIMI_LINEAR = ARCH_CONFIGS["kimi_linear"]
# MLA with an indexer (a CacheList per layer): past index_topk 4 keys, each query attends to 4 picked ones.
DEEPSEEK_V32 = ARCH_CONFIGS["deepseek_v32"]
# Two MLA attentions per layer, each with its own cache (a CacheList of two latents).
LONGCAT_FLASH = ARCH_CONFIGS["longcat_flash"]
# Mamba layers beside attention that calls mx.fast's sdpa itself (not mlx-lm's wrapper).
PLAMO2 = ARCH_CONFIGS["plamo2"]
# Sliding and full layers, yarn rope and llama-4 query scaling from position 16 on.
MINISTRAL3 = ARCH_CONFIGS["ministral3"]
# Sliding layers whose mask is one token wider than their RotatingKVCache (paged_attention: prompt window).
PLAMO3 = ARCH_CONFIGS["plamo3"]
# Two passes over its layers; the second attends globally to the first pass's K/V and locally within a
# window of its own (8 here, so that the prompts outrun it).
LOOPCODER = {**ARCH_CONFIGS["iquestloopcoder"], "hidden_size": 64, "intermediate_size": 128, "head_dim": 16,
             "loop_window_size": 8}
# longcat_flash's two MLAs per layer, under an n-gram embedding that keeps the last n - 1 token ids as
# its state (a token window: started from zeros in a fixed-size slot).
LONGCAT_NGRAM = ARCH_CONFIGS["longcat_flash_ngram"]
# Sparse layers whose indexer keeps the top 2 of 4-token key blocks (one local), cut over cache slots.
MINIMAX_M3_VL = ARCH_CONFIGS["minimax_m3_vl"]
# family -> (config, weight scale, norm weight noise): Gemmas scale the embeddings up by sqrt(hidden)
# and tie the head, so large weights make them repeat the last token; these give varied greedy output.
FAMILIES = {"gemma2": (GEMMA2, 0.1, 1.0), "gemma3n": (GEMMA3N, 0.05, 0.0), "gemma4_text": (GEMMA4, 0.05, 0.0),
            "gpt_bigcode": (GPT_BIGCODE, 0.3, 0.0), "deepseek_v3": (DEEPSEEK_V3, 0.3, 0.0),
            "glm4_moe_lite": (GLM4_MOE_LITE, 0.3, 0.0), "kimi_k25": (KIMI_K25, 0.3, 0.0),
            "mistral4": (MISTRAL4, 0.3, 0.0), "llama4": (LLAMA4, 0.3, 0.0),
            "bailing_moe_v3": (BAILING_MOE_V3, 0.3, 0.0), "ministral3": (MINISTRAL3, 0.3, 0.0),
            "plamo3": (PLAMO3, 0.2, 1.0), "kimi_linear": (KIMI_LINEAR, 0.3, 0.0),
            "plamo2": (PLAMO2, 0.1, 1.0), "afm7": (AFM7, 0.3, 0.0),
            "deepseek_v32": (DEEPSEEK_V32, 0.3, 0.0), "longcat_flash": (LONGCAT_FLASH, 0.3, 0.0),
            "iquestloopcoder": (LOOPCODER, 0.3, 0.0), "longcat_flash_ngram": (LONGCAT_NGRAM, 0.3, 0.0),
            "minimax_m3_vl": (MINIMAX_M3_VL, 0.3, 0.0)}


def build_model(out, config: dict, std: float, seed: int = 0, norm_std: float = 0.0):
    """Write a random-weight mlx-lm model directory for `config` (vocab set from the tiny tokenizer)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    config = json.loads(json.dumps(config))
    text = config.get("text_config", config)
    text["vocab_size"] = config["vocab_size"] = len(vocab) + 3
    if text["model_type"] in ("gemma3n", "gemma4_text"):
        text["vocab_size_per_layer_input"] = len(vocab) + 3
    config.update(eos_token_id=vocab["<|im_end|>"], bos_token_id=vocab["<|endoftext|>"], torch_dtype="float32")
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    params = {k: (mx.random.normal(v.shape) * (0.02 if v.ndim == 1 and "bias" in k else std)
                  if v.ndim > 1 or "bias" in k else v + norm_std * mx.random.normal(v.shape)).astype(mx.float32)
              for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), params, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """family(name, **config overrides) -> (model, tokenizer), built and loaded once."""
    import mlx_lm

    built = {}

    def get(name, **overrides):
        key = (name, json.dumps(overrides, sort_keys=True))
        if key not in built:
            config, std, norm_std = FAMILIES[name]
            config = {**config, **overrides}
            built[key] = mlx_lm.load(str(build_model(tmp_path_factory.mktemp(name), config, std, norm_std=norm_std)))
        return built[key]

    return get


def prompts_for(name):
    rng = random.Random(name)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 23, 12, 40)]


def serve(model, tok, prompts, num_blocks, max_tokens=16):
    """Four staggered arrivals, 16-token steps (chunked prefill), greedy; -> (engine, token ids per prompt)."""
    engine = LLMEngine(model, tok, None, num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16,
                       max_num_seqs=4)
    results = run(engine, [(step, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), f"r{i}")
                           for i, (step, p) in enumerate(zip((0, 0, 1, 3), prompts))])
    assert_all_free(engine)
    return engine, [results[f"r{i}"][0].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_mlx_lm_batched_and_preempted(family, name):
    model, tok = family(name)
    prompts = prompts_for(name)
    want = [oracle(model, p, 16)[0] for p in prompts]
    assert sum(len(set(w)) for w in want) > 20, "greedy output too repetitive to test anything"
    engine, got = serve(model, tok, prompts, num_blocks=80)
    assert engine.scheduler.num_preemptions == 0
    assert got == want
    # 15 usable 4-token blocks: the 40-token prompt's 56 tokens fit, all four together do not.
    engine, got = serve(model, tok, prompts, num_blocks=16)
    assert engine.scheduler.num_preemptions > 0
    assert got == want


@pytest.mark.parametrize("name,shared,cached", [("gemma2", 30, 28), ("gemma4_text", 30, 28), ("deepseek_v3", 30, 28),
                                                ("llama4", 30, 28), ("bailing_moe_v3", 36, 36), ("plamo3", 30, 28),
                                                ("kimi_linear", 36, 36), ("plamo2", 36, 36), ("afm7", 30, 28),
                                                ("deepseek_v32", 30, 28), ("longcat_flash", 30, 28),
                                                ("iquestloopcoder", 30, 28), ("longcat_flash_ngram", 36, 36),
                                                ("minimax_m3_vl", 30, 28)])
def test_prefix_cache_hit_matches_mlx_lm(family, name, shared, cached):
    """A later prompt sharing `shared` tokens starts from cached blocks (shared views and latents read them).

    A model with recurrent state (bailing_moe_v3) restarts only where a state snapshot was kept: the
    end of the first prompt's last full block (36 of its 40 tokens).
    """
    model, tok = family(name)
    p = prompts_for(name)[3]
    q = p[:shared] + [7, 8, 9]
    engine = LLMEngine(model, tok, None, num_blocks=40, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
                       enable_prefix_cache=True, persist_prefix_cache=False)
    if engine.state_pool is not None:
        engine.scheduler.min_snapshot_tokens = 0  # a tiny prompt: snapshot anyway (tests/test_hybrid_prefix.py)
    results = run(engine, [(0, p, SamplingParams(max_tokens=12, ignore_eos=True), "a"),
                           (30, q, SamplingParams(max_tokens=12, ignore_eos=True), "b")])
    assert results["b"][0].metrics.cached_tokens == cached
    assert [results[k][0].token_ids for k in "ab"] == [oracle(model, x, 12)[0] for x in (p, q)]


def test_loopcoder_window_and_first_pass_are_what_decide(family):
    """The second pass's window bites (a wider one changes the tokens); its global attention reads the first
    pass's K/V, so its caches page only the window's layers' own K/V beside the first pass's."""
    model, _ = family("iquestloopcoder")
    wide, _ = family("iquestloopcoder", loop_window_size=1000)
    prompts = prompts_for("iquestloopcoder")
    assert any(oracle(model, p, 16)[0] != oracle(wide, p, 16)[0] for p in prompts)
    assert [s.window for s in inspect_model(model, "iquestloopcoder")] == [None, None, 8, 8]


def test_minimax_block_sparsity_is_what_decides(family):
    """Picking 2 key blocks of 4 tokens changes the tokens (against a budget that keeps every block): the
    batched and preempted test above runs the sparse selection, row by row."""
    model, _ = family("minimax_m3_vl")
    config = MINIMAX_M3_VL["text_config"]["sparse_attention_config"]
    dense, _ = family("minimax_m3_vl", text_config={**MINIMAX_M3_VL["text_config"],
                                                    "sparse_attention_config": {**config, "sparse_topk_blocks": 64}})
    prompts = prompts_for("minimax_m3_vl")
    assert any(oracle(model, p, 16)[0] != oracle(dense, p, 16)[0] for p in prompts)


@pytest.mark.parametrize("lengths", [(13, 12), (21, 20), (24, 20)])
def test_minimax_rows_padded_in_one_forward_match_mlx_lm(family, lengths):
    """Prompts of different lengths prefilled in one forward (the shorter row right-padded): each sparse
    row runs on its real tokens only (a padded row once read keys its table did not cover)."""
    model, tok = family("minimax_m3_vl")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in lengths]
    engine = LLMEngine(model, tok, None, num_blocks=80, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    widths = []
    forward = engine.runner.run_forward
    engine.runner.run_forward = lambda tables, starts, tokens, *a, **k: (
        widths.append([len(t) for t in tokens]) or forward(tables, starts, tokens, *a, **k))
    got = run(engine, [(0, p, SamplingParams(max_tokens=8, ignore_eos=True), str(i)) for i, p in enumerate(prompts)])
    assert list(lengths) in widths  # both prompts in one (padded) forward
    assert [got[str(i)][0].token_ids for i in range(len(prompts))] == [oracle(model, p, 8)[0] for p in prompts]


def test_minimax_speculative_decoding_is_exact(family):
    """Verify forwards pad rows to 1 + their drafts: the sparse layers see each row's real tokens."""
    from test_hybrid import ScriptedDrafter

    model, tok = family("minimax_m3_vl")
    prompts = prompts_for("minimax_m3_vl")[:3]
    want = [oracle(model, p, 14)[0] for p in prompts]
    drafter = ScriptedDrafter({tuple(p): w for p, w in zip(prompts, want)}, model.args.text_config.vocab_size)
    engine = LLMEngine(model, tok, None, num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=3,
                       draft=drafter, num_speculative_tokens=3, adaptive_speculation=False)
    got = run(engine, [(i, p, SamplingParams(max_tokens=14, ignore_eos=True), f"s{i}") for i, p in enumerate(prompts)])
    assert [got[f"s{i}"][0].token_ids for i in range(len(prompts))] == want
    accepted = sum(o[0].metrics.accepted_tokens for o in got.values())
    assert drafter.proposed > 0 and 0 < accepted < drafter.proposed
    assert_all_free(engine)


def test_token_window_state_from_zeros_matches_mlx_lm_for_short_prompts(family):
    """Prompts shorter than the n-gram's window (where mlx-lm's state is shorter than the slot) batched
    with longer ones: the zero-filled window gives mlx-lm's tokens."""
    model, tok = family("longcat_flash_ngram")
    spec = inspect_model(model, "longcat_flash_ngram").states[0]
    assert spec.fresh_zeros and spec.shapes == [(model.model.ngram_embeddings.n - 1,)]
    prompts = [[11], [12, 13], prompts_for("longcat_flash_ngram")[1], [14]]
    _, got = serve(model, tok, prompts, num_blocks=80)
    assert got == [oracle(model, p, 16)[0] for p in prompts]


def test_gemma2_softcap_is_what_decides(family):
    """Without soft-capping (a cap too large to bite) the same weights decode differently."""
    model, _ = family("gemma2")
    loose, _ = family("gemma2", attn_logit_softcapping=1e4)
    prompts = prompts_for("gemma2")
    assert any(oracle(model, p, 16)[0] != oracle(loose, p, 16)[0] for p in prompts)
    assert [s.window for s in inspect_model(model, "gemma2")] == [None, None]  # mlx-lm's gemma2: no window


def test_llama4_chunks_and_query_scaling_are_what_decide(family):
    """Chunks wider than any prompt, or query scaling that starts past it, change the tokens: both are tested above."""
    model, tok = family("llama4")
    text = LLAMA4["text_config"]
    unchunked, _ = family("llama4", text_config={**text, "attention_chunk_size": 1000})
    unscaled, _ = family("llama4", text_config={**text, "floor_scale": 8192})
    prompts = prompts_for("llama4")
    want = [oracle(model, p, 16)[0] for p in prompts]
    assert want != [oracle(unchunked, p, 16)[0] for p in prompts]
    assert want != [oracle(unscaled, p, 16)[0] for p in prompts]
    # Layers 0-2 attend within chunks of 6, layer 3 (NoPE) globally; every row decodes in one forward.
    assert [(s.window, s.chunk) for s in inspect_model(model, "llama4")] == [(None, 6)] * 3 + [(None, None)]
    assert LLMEngine(model, tok, None, num_blocks=8, block_size=4).runner.batch_decode


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_llama4_decodes_through_the_kernel_dispatch(family, kv_bits):
    """The kernel's path for chunked layers: a KernelDispatch over the kernel's algorithm (NumPy; 8-bit KV:
    QuantPools, dequantised per key) checks each class with its chunk and gives the reference engine's tokens."""
    from macinfer.kv.kernel_dispatch import KernelDispatch, attention_layers

    model, tok = family("llama4", text_config={**LLAMA4["text_config"], "head_dim": 32})  # 8-bit KV: groups of 32
    prompts = prompts_for("llama4")[:3]
    chunks = []

    def kernel(queries, k_pool, v_pool, *a, n_simdgroups=None, lens=None, sink_array=None, **k):
        chunks.append(k.get("chunk"))
        return ma.paged_attention_online(queries, k_pool, v_pool, *a, splits=2, **k)

    def tokens(dispatch):
        engine = LLMEngine(model, tok, None, num_blocks=40, block_size=4, max_num_batched_tokens=16,
                           max_num_seqs=4, kv_bits=kv_bits)
        if dispatch is not None:  # what select_attention does at start-up
            assert dispatch.prepare(attention_layers(engine.specs, kv_bits), 4) == []
            chunks.clear()  # the start-up checks' own chunks
        engine.runner.ctx.attention_fn = dispatch
        results = run(engine, [(0, p, SamplingParams(max_tokens=6, ignore_eos=True), f"r{i}")
                               for i, p in enumerate(prompts)])
        return [results[f"r{i}"][0].token_ids for i in range(len(prompts))]

    dispatch = KernelDispatch("metal", kernel, paged_attention, timer=lambda fn: 0.0)
    assert tokens(dispatch) == tokens(None)
    assert set(chunks) == {6, None}  # the chunked layers' calls carry their chunk, the global layer's none
    assert set(dispatch.choices.values()) == {"kernel"} and dispatch.misses == 0 and dispatch.met


def mlx_lm_visible(window: int, steps: list[int]) -> dict[int, list[int]]:
    """Which key positions each query sees in mlx-lm, through its own RotatingKVCache(window) asked for a
    (window + 1)-token mask (plamo3), forward by forward of `steps` tokens: position -> visible positions."""
    from mlx_lm.models.cache import RotatingKVCache

    cache, seen, start = RotatingKVCache(max_size=window), {}, 0
    for n in steps:
        mask = cache.make_mask(n, window_size=window + 1)  # before the update, as the model asks
        k = mx.arange(start, start + n, dtype=mx.float32).reshape(1, 1, n, 1)  # each key holds its position
        held = np.array(cache.update_and_fetch(k, k)[0][0, 0, :, 0]).astype(int)  # in the cache's order
        S = len(held)
        if mask is None:
            m = np.ones((n, S), bool)
        elif isinstance(mask, str):  # "causal": the forward's n queries are the last n keys
            m = np.arange(S)[None] <= np.arange(S - n, S)[:, None]
        else:
            m = np.broadcast_to(np.array(mask), (n, S))
        for i in range(n):
            seen[start + i] = sorted(held[m[i]].tolist())
        start += n
    return seen


def test_plamo3_prompt_window_is_mlx_lms():
    """query_windows against mlx-lm's own cache and mask, as generate_step runs a 2060-token prompt: every
    prompt token but the last in forwards of 2048, then one token per forward (4 decode steps)."""
    from macinfer.kv.paged_attention import MLX_LM_PREFILL_STEP, query_windows

    W, n = 8, MLX_LM_PREFILL_STEP + 12
    steps = [MLX_LM_PREFILL_STEP, n - 1 - MLX_LM_PREFILL_STEP] + [1] * 5
    seen = mlx_lm_visible(W, steps)
    pos = mx.arange(sum(steps))[:, None]
    windows = np.array(query_windows(pos, W, (W + 1, [n])))[:, 0]
    assert {p: list(range(max(0, p - int(w) + 1), p + 1)) for p, w in enumerate(windows)} == seen
    assert sorted({int(windows[p]) for p in (9, 2047, 2049, n - 2)}) == [W + 1]  # prompt queries: W + 1
    assert sorted({int(windows[p]) for p in (2048, n - 1, n + 3)}) == [W]  # a forward's first, and one-token ones


@pytest.mark.parametrize("name", ["gemma3n", "gemma4_text"])
def test_kv_sharing_pages_once(family, name):
    model, tok = family(name)
    specs = inspect_model(model, name)
    # 4 layers, the last 2 reuse layers 0 (sliding, window 8) and 1 (full): two pools.
    assert [s.window for s in specs] == [8, None]
    engine = LLMEngine(model, tok, None, num_blocks=8, block_size=4)
    assert len(engine.runner.caches) == 2 and engine.runner.batch_decode
    view = SharedKVView(engine.runner.caches[1])
    assert view.nbytes == 0 and view.state == [] and view.window is None
    k = mx.ones((1, 2, 1, specs[1].k_head_dim))
    assert view.update_and_fetch(k, k) == (k, k)  # writes nothing


def test_afm7_kv_reuse_layers_page_nothing(family):
    model, tok = family("afm7")
    specs = inspect_model(model, "afm7")  # the 2 KV-reuse layers read layer 1's pools
    assert len(specs) == 2 and LLMEngine(model, tok, None, num_blocks=8, block_size=4).runner.batch_decode


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe_lite", "mistral4"])
def test_mla_pages_the_compressed_latent(family, name):
    model, tok = family(name)
    cfg = FAMILIES[name][0]
    specs = inspect_model(model, name)
    # One "KV head" per token: the latent (kv_lora_rank) and the rope key, not n_heads expanded K/V.
    assert {(s.n_kv_heads, s.k_head_dim, s.v_head_dim) for s in specs} == {
        (1, cfg["kv_lora_rank"], cfg["qk_rope_head_dim"])}
    expanded = cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"])
    assert specs[0].bytes_per_token() == 4 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) < 4 * expanded


def test_indexer_pages_beside_the_latent(family):
    model, tok = family("deepseek_v32")
    cfg = DEEPSEEK_V32
    specs = inspect_model(model, "deepseek_v32")
    # Per layer a CacheList: the latent and rope key, then the indexer's one key head (in K and V).
    assert [(s.n_kv_heads, s.k_head_dim, s.v_head_dim) for s in specs] == [
        (1, cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]), (1, cfg["index_head_dim"], cfg["index_head_dim"])
    ] * cfg["num_hidden_layers"]
    assert specs.layout == [("kvlist", 2 * i, 2 * i + 1) for i in range(cfg["num_hidden_layers"])] and not specs.states
    engine = LLMEngine(model, tok, None, num_blocks=8, block_size=4)
    assert engine.runner.batch_decode and engine.state_pool is None
    assert len(engine.runner.caches) == cfg["num_hidden_layers"] and len(engine.runner.pool_caches) == len(specs)


def test_state_that_grows_is_refused(family, monkeypatch):
    """A state that keeps the last n-1 token ids, fewer at first, fits no fixed slot unless it is known to be a
    token window that may start from zeros (longcat_flash_ngram's is: kv.state_cache.token_windows)."""
    from macinfer.errors import MacinferError
    from macinfer.kv import model_probe

    model, _ = family("longcat_flash_ngram")
    monkeypatch.setattr(model_probe, "token_windows", lambda model, states: {})
    with pytest.raises(MacinferError, match="^longcat_flash_ngram: a recurrent layer's state changes size"):
        inspect_model(model, "longcat_flash_ngram")


def test_gpt_bigcode_batches_with_row_positions(family):
    model, tok = family("gpt_bigcode")
    assert supports_batched_offsets(model)
    assert LLMEngine(model, tok, None, num_blocks=8, block_size=4).runner.batch_decode


def test_int_offset_model_falls_back_to_one_row_per_forward(family, monkeypatch):
    """The issue as reported: gpt_bigcode left alone makes a Python int of a (B,) offset array.

    The lazy probe finds out and the engine then runs every row in its own forward, still
    token for token mlx-lm's output.
    """
    import macinfer.kv.attention_variants as av

    monkeypatch.setattr(av, "_VARIANTS", {k: v for k, v in av._VARIANTS.items() if "gpt_bigcode" not in k})
    model, tok = family("gpt_bigcode", layer_norm_epsilon=1e-6)  # a fresh model object, never retyped
    assert not batched_offsets_work(model) and not supports_batched_offsets(model)
    prompts = prompts_for("gpt_bigcode")
    engine, got = serve(model, tok, prompts, num_blocks=80)
    assert not engine.runner.batch_decode
    assert got == [oracle(model, p, 16)[0] for p in prompts]


# ---------------------------------------------------------------- soft-capping in the attention paths


def softcapped_numpy(args, softcap):
    """Direct NumPy: each row's visible keys, tanh-capped scores, softmax, @ V."""
    q, kp, vp = (np.array(args[k], dtype=np.float64) for k in ("queries", "k_pool", "v_pool"))
    tables, BS, W = np.array(args["block_tables"]), args["block_size"], args.get("window")
    B, H, QL, D = q.shape
    out = np.zeros((B, H, QL, vp.shape[-1]))
    for b, C in enumerate(args["context_lens"]):
        slots = [tables[b, pos // BS] * BS + pos % BS for pos in range(C)]
        for h in range(H):
            kvh = h // (H // kp.shape[0])
            for i in range(QL):
                p = C - QL + i
                seen = [j for j in range(C) if j <= p and (W is None or j > p - W)]
                s = kp[kvh, [slots[j] for j in seen]] @ q[b, h, i] * args["scale"]
                s = np.tanh(s / softcap) * softcap
                w = np.exp(s - s.max())
                out[b, h, i] = w @ vp[kvh, [slots[j] for j in seen]] / w.sum()
    return out


CASES = [  # (context_lens, q_len, window, contiguous blocks)
    ([37], 1, None, True), ([37], 5, None, True), ([37], 20, None, False), ([30], 3, 7, False),
    ([9, 40, 17], 1, None, False), ([12, 33], 4, 10, False),
]


@pytest.mark.parametrize("context_lens,q_len,window,contiguous", CASES)
def test_reference_softcap_matches_direct_computation(context_lens, q_len, window, contiguous):
    args = ma.random_problem(len(context_lens) * 10 + q_len, context_lens=context_lens, q_len=q_len, n_heads=4,
                             n_kv_heads=2, head_dim=16, block_size=4, window=window)
    args["queries"] = args["queries"] * 4  # scores around +-8: a cap of 2 bites hard
    if contiguous:  # blocks handed out in order: the one-slice path
        args["block_tables"] = mx.arange(1, 1 + args["block_tables"].shape[1])[None].astype(mx.int32)
    want = softcapped_numpy(args, 2.0)
    got = paged_attention(**args, softcap=2.0)
    np.testing.assert_allclose(np.array(got), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.array(ma.paged_attention_online(**args, softcap=2.0, splits=3)), want,
                               rtol=2e-5, atol=2e-5)
    assert not np.allclose(np.array(paged_attention(**args)), want, atol=1e-2)  # the cap changed the answer


def test_metal_kernel_softcap_in_emulator(tmp_path):
    """The kernel with soft-capping, compiled as C++ and run in the emulator (tests/metal_emulator.py)."""
    import metal_emulator as me

    if me.compiler() is None:
        pytest.skip("needs clang++ or g++ to build the Metal-source emulator")
    emu = me.Emulator(tmp_path)
    args = ma.random_problem(5, context_lens=[3 * 8 + 2, 8, 45], q_len=2, n_heads=4, n_kv_heads=2, head_dim=32,
                             block_size=8, window=13, softcap=2.0)
    args["queries"] = args["queries"] * 4
    call = ma.kernel_call(**args)
    assert float(call.pass1["inputs"][ma.INPUT_NAMES.index("fparams")][1]) == 2.0

    def emulate(call):
        return np.array(emu.run(ma.build_kernel("float"), call.pass1, ma.INPUT_NAMES)[0])

    want = softcapped_numpy(args, 2.0)
    np.testing.assert_allclose(emulate(call), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(ma.paged_attention_online(**args, splits=2)), want, rtol=1e-5, atol=1e-5)
    # The same compiled kernel without a cap (softcap input 0) is plain attention again.
    plain = ma.kernel_call(**{**args, "softcap": None})
    np.testing.assert_allclose(emulate(plain), np.array(paged_attention(**{**args, "softcap": None})),
                               rtol=1e-5, atol=1e-5)