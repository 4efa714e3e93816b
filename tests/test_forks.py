"""n > 1 samples of one prompt: forks share the prompt's KV blocks, and each equals its solo run."""

import pytest
from driver import run

from macinfer.core.sampling import SamplingParams
from macinfer.engine.llm_engine import LLMEngine

BS, N, MAX_TOKENS = 4, 4, 9


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_n_forks_use_the_prompt_blocks_once_and_each_equals_its_solo_run(load, prefix_cache):
    model, tok = load("llama")
    prompt = tok.encode("Paged attention stores the key value cache in fixed size blocks.")[:22]
    assert len(prompt) == 22  # 5 full blocks before the last prompt token, then 2 tokens of block 6
    shared = (len(prompt) - 1) // BS
    params = [SamplingParams(temperature=0.9, seed=7 + i, max_tokens=MAX_TOKENS, ignore_eos=True) for i in range(N)]
    engine = LLMEngine(model, tok, None, max_model_len=256, block_size=BS, num_blocks=80,
                       enable_prefix_cache=prefix_cache)
    solo = [run(engine, [(0, prompt, p, f"solo{i}")])[f"solo{i}"].token_ids for i, p in enumerate(params)]
    assert len({tuple(s) for s in solo}) > 1, "the seeds should give different samples"

    # A 12-token budget: the parent's prompt takes two steps, and the forks must wait for both.
    engine = LLMEngine(model, tok, None, max_model_len=256, block_size=BS, num_blocks=80,
                       enable_prefix_cache=prefix_cache, max_num_seqs=8, max_num_batched_tokens=12)
    engine.add_request(prompt, params[0], request_id="c0")
    for i in range(1, N):
        engine.add_request(prompt, params[i], request_id=f"c{i}", fork_of="c0")
    seen_all, outputs = False, {}
    while engine.has_unfinished():
        for d in engine.step():
            if d.output is not None:
                outputs[d.request_id] = d.output
        running = [s for s in engine.scheduler.running if s.request_id.startswith("c")]
        tables = [s.block_table for s in running]
        # Every running sample holds the same first `shared` blocks; the rest are its own.
        assert all(t[:shared] == tables[0][:shared] for t in tables)
        assert engine.kv_stats()["used_blocks"] == (shared + sum(len(t) - shared for t in tables) if tables else 0)
        seen_all |= len(running) == N and all(len(t) > shared for t in tables)
    assert seen_all
    assert [outputs[f"c{i}"].token_ids for i in range(N)] == solo
    # The forks computed the prompt's last partial block only: the prefill was shared.
    assert [outputs[f"c{i}"].metrics.cached_tokens for i in range(1, N)] == [shared * BS] * (N - 1)
    assert engine.kv_stats()["used_blocks"] == 0


def test_a_fork_of_a_finished_or_unknown_request_runs_alone(load):
    model, tok = load("llama")
    engine = LLMEngine(model, tok, None, max_model_len=256, block_size=BS, num_blocks=80, enable_prefix_cache=False)
    prompt = tok.encode("Once upon a time there was a little model")
    want = run(engine, [(0, prompt, SamplingParams(max_tokens=5), "a")])["a"].token_ids
    engine.add_request(prompt, SamplingParams(max_tokens=5), request_id="b", fork_of="nobody")
    out = run(engine, [])
    assert out["b"].token_ids == want and out["b"].metrics.cached_tokens == 0
