"""Penalties, logit_bias and logprobs in the engines, against mlx-lm's generate_step with the
same logits processors (token for token) and the log-probabilities it computes (to 1e-4)."""

import mlx.core as mx
import mlx_lm
import pytest
from driver import run
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from mlx.utils import tree_map

from macinfer.core.sampling import SamplingParams
from macinfer.engine.dense_engine import DenseEngine
from macinfer.engine.llm_engine import LLMEngine

PROMPTS = ["The quick brown fox", "Paged attention stores the key value cache in", "Once upon a time"]
PENALTIES = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.4,
             "logit_bias": {5: 3.0, 7: -100.0}}


def oracle(model, prompt, n, **penalties):
    """mlx-lm's greedy tokens and their (V,) logprobs, with mlx-lm's processors for `penalties`."""
    procs = make_logits_processors(penalties.get("logit_bias"), penalties.get("repetition_penalty"), 20,
                                   penalties.get("presence_penalty"), 20, penalties.get("frequency_penalty"), 20)
    return [(int(t), lp) for t, lp in generate_step(mx.array(prompt), model, max_tokens=n, logits_processors=procs)]


ENGINES = ["pipelined", "sync", "ngram-draft", "dense"]


def setup(which, load, tiny_models):
    """(model, tokenizer, engine) for each way a row is sampled: a pipelined decode, a synchronous
    step, a forward verifying the drafts of other rows, mlx-lm's BatchGenerator."""
    model, tok = load("llama")
    kw = dict(max_model_len=256, block_size=4, num_blocks=80)
    if which == "dense":
        return model, tok, DenseEngine(model, tok, None, max_model_len=256)
    if which == "ngram-draft":  # a flattened random model repeats itself: the n-gram drafter has matches
        model, tok = mlx_lm.load(str(tiny_models("llama")))
        model.update(tree_map(lambda w: w * 0.3 if w.ndim > 1 else w, model.parameters()))
        kw.update(draft="ngram", num_speculative_tokens=3, adaptive_speculation=False)
    return model, tok, LLMEngine(model, tok, None, async_scheduling=which != "sync", **kw)


@pytest.mark.parametrize("which", ENGINES)
def test_greedy_penalties_equal_mlx_lm_with_the_same_processors(load, tiny_models, which):
    """Batched with a plain greedy request, each penalised request is mlx-lm's, and the penalties
    change the output (so the comparison is not vacuous)."""
    model, tok, engine = setup(which, load, tiny_models)
    prompts = [tok.encode(p) for p in PROMPTS]
    pen = SamplingParams(max_tokens=24, ignore_eos=True, **PENALTIES)
    plain = SamplingParams(max_tokens=24, ignore_eos=True)
    out = run(engine, [(0, prompts[0], pen, "a"), (0, prompts[1], plain, "b"), (1, prompts[2], pen, "c")])
    for rid, i, kw in (("a", 0, PENALTIES), ("b", 1, {}), ("c", 2, PENALTIES)):
        assert out[rid].token_ids == [t for t, _ in oracle(model, prompts[i], 24, **kw)], rid
    assert out["a"].token_ids != [t for t, _ in oracle(model, prompts[0], 24)]
    assert 7 not in out["a"].token_ids + out["c"].token_ids  # biased out
    if which == "ngram-draft":  # the plain row drafted; penalised rows never do
        assert out["b"].metrics.draft_tokens > 0 and out["a"].metrics.draft_tokens == 0
    assert not engine.requests


@pytest.mark.parametrize("which", ENGINES)
def test_logprobs_are_mlx_lm_log_softmax_for_the_same_tokens(load, tiny_models, which):
    model, tok, engine = setup(which, load, tiny_models)
    prompts = [tok.encode(p) for p in PROMPTS[:2]]
    k = 5
    out = run(engine, [(0, prompts[0], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=k), "a"),
                       (0, prompts[1], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0,
                                                      repetition_penalty=1.5), "b"),
                       (0, prompts[0], SamplingParams(max_tokens=12, ignore_eos=True), "plain")])
    assert out["plain"].logprobs is None
    if which == "ngram-draft":
        assert out["plain"].metrics.draft_tokens > 0
    for rid, prompt, kw, top in (("a", prompts[0], {}, k), ("b", prompts[1], {"repetition_penalty": 1.5}, 0)):
        want = oracle(model, prompt, 12, **kw)
        got = out[rid].logprobs
        assert [e.token_id for e in got] == out[rid].token_ids == [t for t, _ in want]
        for e, (t, lp) in zip(got, want):
            assert e.logprob == pytest.approx(lp[t].item(), abs=1e-4)
            order = mx.argsort(-lp).tolist()[:top]
            assert [i for i, _ in e.top] == order
            assert [v for _, v in e.top] == pytest.approx([lp[i].item() for i in order], abs=1e-4)


def test_streamed_deltas_carry_the_logprobs_of_their_tokens(load):
    model, tok = load("llama")
    engine = LLMEngine(model, tok, None, max_model_len=256, block_size=4, num_blocks=80)
    engine.add_request(tok.encode(PROMPTS[0]), SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2), "a")
    ids, lps, final = [], [], None
    while engine.has_unfinished():
        for d in engine.step():
            ids += d.token_ids
            lps += d.logprobs or []
            final = d.output or final
    assert [e.token_id for e in lps] == ids == final.token_ids and lps == final.logprobs


@pytest.mark.parametrize("bad, msg", [
    ({"logprobs": 21}, "logprobs must be"),
    ({"presence_penalty": 2.5}, "presence_penalty must be"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be"),
    ({"repetition_penalty": 0}, "repetition_penalty must be"),
    ({"logit_bias": {"5": 1}}, "logit_bias keys"),
    ({"logit_bias": {5: 101}}, "logit_bias values"),
])
def test_sampling_params_refuse_bad_penalties_in_one_line(bad, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**bad)
