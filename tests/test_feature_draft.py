"""Feature drafts (EAGLE-style, macinfer.spec_decode.feature_draft) on a tiny random target.

The engine feeds the draft the target's hidden states step by step through its own paged KV
cache, rolling back rows fed with guessed features. The checks: every round-0 draft state the
engine computes equals the draft run densely over the target's real features of the same
tokens (so the paging, the rollback and the feature bookkeeping are right); greedy output
equals mlx-lm's with accepted and rejected drafts, synchronous and async, with prefix-cache
hits and preemption; nothing is left behind; bad drafts are refused in one line.
"""

from __future__ import annotations

import json
import os
import time

import mlx.core as mx
import mlx_lm
import pytest
from oracle import mlx_lm_greedy
from test_spec_decode import TEXTS, run

from macinfer.core.decode_graph import block_bucket
from macinfer.spec_decode.draft_model import load_draft, save_draft
from macinfer.engine.llm_engine import LLMEngine
from macinfer.errors import MacinferError
from macinfer.core.lm_head import split_head
from macinfer.spec_decode.feature_draft import FeatureDraft, FeatureDrafter, feature_draft_config, load_feature_draft
from macinfer.core.sampling import SamplingParams

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def fm(tiny_models, tmp_path_factory):
    from mlx_lm.models import llama

    path = tiny_models("llama")
    model, tok = mlx_lm.load(str(path))
    prompts = [tok.encode(t) for t in TEXTS]
    want = [mlx_lm_greedy(path, p, MAX_TOKENS) for p in prompts]
    cfg = json.loads((path / "config.json").read_text())
    V = model.args.vocab_size
    fcfg = feature_draft_config(cfg, V // 2)
    mx.random.seed(3)
    draft = FeatureDraft(llama.ModelArgs.from_dict(fcfg))
    out = tmp_path_factory.mktemp("feature") / "draft"
    save_draft(draft, fcfg, out, head_ids=list(range(0, V, 2)), bits=8)
    return {"path": path, "model": model, "tok": tok, "prompts": prompts, "want": want, "draft": out, "V": V}


def checked(engine, fm, script: bool):
    """Instrument the engine's FeatureDrafter: compare every round 0 with a dense recomputation;
    with script, propose the right token except at every third output position."""
    d: FeatureDrafter = engine.spec_decoder.drafter
    assert isinstance(d, FeatureDrafter)
    seen = {"round0": 0, "late_base": 0, "round": 0}
    run_, propose_ = d._run, d.propose

    def propose(seqs, num_draft):
        seen["round"] = 0
        propose_(seqs, num_draft)

    def run_checked(sts, tokens, feats):
        out = run_(sts, tokens, feats)
        seen["round"] += 1
        if seen["round"] == 1:  # round 0: rows with the target's real features only
            for i, (st, t) in enumerate(zip(sts, tokens)):
                seq = engine.requests[st.request_id]
                end = st.base + st.true_rows + len(t)  # rows fed: positions base .. end - 1
                F = fm["model"].model(mx.array([seq.token_ids[:end]]))[:, st.base:]
                dense = d.draft(mx.array([seq.token_ids[st.base + 1: end + 1]]), F)[0, -1]
                assert mx.allclose(out[i], dense, atol=1e-4, rtol=1e-4).item(), (st.request_id, end)
                seen["round0"] += 1
                seen["late_base"] += st.base > 0
        return out

    d._run, d.propose = run_checked, propose
    d.min_joint = 0.0  # a random draft is never sure of anything: draft all k anyway
    if script:
        cont = {tuple(p): w for p, w in zip(fm["prompts"], fm["want"])}

        def pick(seq, sub, head):
            j = seq.num_output_tokens + len(seq.spec_token_ids)  # the output index being drafted
            w = cont[tuple(seq.prompt_token_ids)]
            t = w[j] if j < len(w) else 0
            return mx.array(t if j % 3 != 2 else (t + 1) % fm["V"]), None

        d._pick = pick
    return seen


def assert_all_free(engine):
    engine.step()
    for pool in (engine.block_pool, engine.spec_decoder.drafter.pool):
        assert not [b for b in pool.blocks[1:] if b.ref_cnt] and pool.req_to_blocks == {}
    assert engine.spec_decoder.drafter.states == {} and engine.spec_decoder.drafter.feats == {}
    assert engine.requests == {}


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("script", [False, True])
def test_greedy_equals_mlx_lm(fm, script, async_scheduling):
    engine = LLMEngine(fm["model"], fm["tok"], None, max_model_len=256, block_size=4, num_blocks=60,
                       draft=str(fm["draft"]), num_speculative_tokens=3, adaptive_speculation=False,
                       async_scheduling=async_scheduling)
    seen = checked(engine, fm, script)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    alone = run(engine, [(0, fm["prompts"][0], params, "alone")])
    assert alone["alone"].token_ids == fm["want"][0]
    # All four arriving over the first steps; the first prompt's blocks come from the prefix cache.
    batch = run(engine, [(i, p, params, f"r{i}") for i, p in enumerate(fm["prompts"])])
    for i, want in enumerate(fm["want"]):
        assert batch[f"r{i}"].token_ids == want, i
    drafted = sum(o.metrics.draft_tokens for o in batch.values())
    accepted = sum(o.metrics.accepted_tokens for o in batch.values())
    assert drafted > 0 and seen["round0"] > 20
    assert seen["late_base"] > 0  # a draft context that starts after a cached prefix
    if script:
        assert 0 < accepted < drafted
    assert_all_free(engine)


def test_verify_forwards_run_compiled_on_the_cpu_backend(fm, monkeypatch):
    """On MLX's CPU backend a forward holding drafts is one compiled graph, traced once per shape
    (DecodeGraph.verify_logits): mlx-lm's tokens, the draft fed what the eager forward computes (`checked`),
    and a step that traced or checked the graph is not taken as what a step costs."""
    from macinfer.core.decode_graph import DecodeGraph

    check = DecodeGraph._check

    def slow_check(self, *a):  # a first replay checked against the eager forward: slow, like a trace
        time.sleep(0.5)
        return check(self, *a)

    monkeypatch.setattr(DecodeGraph, "_check", slow_check)
    engine = LLMEngine(fm["model"], fm["tok"], None, max_model_len=256, block_size=4, num_blocks=60,
                       draft=str(fm["draft"]), num_speculative_tokens=3, eval_thread=True)
    graph = engine.runner.decode_graph
    calls, built, observed = [], [], []  # verify forwards (rows, width, block bucket); graphs built; step costs
    verify, traced, observe = graph.verify_logits, graph._traced, engine.spec_decoder.step_cost.observe

    def spy(tables, starts, tokens, *a):
        L = max(map(len, tokens))
        calls.append((len(tokens), L, block_bucket(max(-(-(s + L) // 4) for s in starts))))
        return verify(tables, starts, tokens, *a)

    graph.verify_logits = spy
    graph._traced = lambda keys, kind: built.append(kind) or traced(keys, kind)
    engine.spec_decoder.step_cost.observe = lambda n, s, sync=False: observed.append(s) or observe(n, s, sync)
    seen = checked(engine, fm, script=True)
    engine.spec_decoder.adaptive = False  # draft every step: every width
    params = SamplingParams(max_tokens=MAX_TOKENS)
    out = run(engine, [(i, p, params, f"r{i}") for i, p in enumerate(fm["prompts"])])
    for i, want in enumerate(fm["want"]):
        assert out[f"r{i}"].token_ids == want, i
    assert seen["round0"] > 20 and len(calls) >= 8 and max(L for _, L, _ in calls) > 2
    assert graph.enabled and "hidden" in graph._checked  # its first replay equalled the eager forward bit for bit
    assert built.count("hidden") == len(set(calls)) < len(calls)  # one graph per shape, not per step
    assert observed and max(observed) < 0.4  # the checked step (0.5 s more) was left out
    assert_all_free(engine)


def test_preemption_and_no_leak(fm):
    # 17 usable blocks of 4 tokens: each sequence fits alone, not all four.
    engine = LLMEngine(fm["model"], fm["tok"], None, max_model_len=256, block_size=4, num_blocks=18,
                       draft=str(fm["draft"]), num_speculative_tokens=4, adaptive_speculation=False,
                       enable_prefix_cache=False)
    seen = checked(engine, fm, script=True)
    engine.spec_decoder.drafter.max_unfed = 3  # a prompt longer than that: the draft starts after its start
    params = SamplingParams(max_tokens=MAX_TOKENS)
    out = run(engine, [(0, p, params, f"r{i}") for i, p in enumerate(fm["prompts"])])
    assert engine.scheduler.num_preemptions > 0 and seen["round0"] > 20
    for i, want in enumerate(fm["want"]):
        assert out[f"r{i}"].token_ids == want, i
    assert_all_free(engine)


def test_bad_drafts_are_refused(fm, tiny_models, tmp_path):
    other, other_tok = mlx_lm.load(str(tiny_models("llama", hidden_size=96)))
    with pytest.raises(MacinferError, match="use a draft made for this target"):
        load_draft(str(fm["draft"]), other, other_tok)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((fm["draft"] / "config.json").read_text())
    w = mx.load(str(fm["draft"] / "model.safetensors"))
    mx.save_safetensors(str(broken / "model.safetensors"), {k: v for k, v in w.items() if not k.startswith("fc.")})
    with pytest.raises(MacinferError, match="incomplete"):
        load_draft(str(broken), fm["model"], fm["tok"])

    with pytest.raises(MacinferError, match="is not a feature draft"):
        load_feature_draft(tmp_path / "missing", fm["model"])

    class Scaled(type(fm["model"])):  # logits that are not lm_head(hidden state)
        def __call__(self, inputs, cache=None, input_embeddings=None):
            return 2 * super().__call__(inputs, cache, input_embeddings)

    scaled = Scaled(fm["model"].args)
    scaled.update(mlx_lm.load(str(fm["path"]))[0].parameters())  # a fresh copy: no engine patches
    with pytest.raises(MacinferError, match="feature draft cannot read"):
        split_head(scaled)


def test_a_draft_that_always_declines_is_soon_not_asked(fm):
    """Declined rounds count as rejections: adaptive k turns drafting off, and output stays right.

    A declined ask widens no forward (the cost model knows the decline rate), so what it costs is
    its draft round: here 30% of a step, and acceptance falling with each decline soon outweighs it."""
    engine = LLMEngine(fm["model"], fm["tok"], None, max_model_len=256, block_size=4, num_blocks=60,
                       draft=str(fm["draft"]), num_speculative_tokens=3, enable_prefix_cache=False)
    d = engine.spec_decoder.drafter
    d.min_joint = 1.1  # never sure enough
    # Costs that make drafting look worth it at the prior acceptance (1 ms steps + 0.1 ms per
    # token, 0.3 ms draft rounds), so only the declines can turn it off.
    cost = engine.spec_decoder.step_cost.observe
    engine.spec_decoder.step_cost.observe = lambda tokens, seconds, **kw: cost(tokens, 1e-3 + 1e-4 * tokens, **kw)
    engine.spec_decoder.draft_round_seconds = lambda: 3e-4
    calls, spans = [], []
    propose, observe = d.propose, d.observe
    d.propose = lambda seqs, ks: (calls.append(engine.spec_decoder.step_cost.ready), propose(seqs, ks))

    def observe_(seqs, starts, counts, h):
        observe(seqs, starts, counts, h)
        chunks = d.feats[seqs[0].request_id]
        spans.append(chunks[-1][0] + chunks[-1][1].shape[0] - chunks[0][0])

    d.observe = observe_
    engine.runner.hidden_sink = observe_
    d.max_unfed = 3  # features kept while nothing is drafted: bounded
    out = run(engine, [(0, fm["prompts"][1], SamplingParams(max_tokens=40, ignore_eos=True), "r")])
    want = mlx_lm_greedy(fm["path"], fm["prompts"][1], 40)
    assert out["r"].token_ids == want and out["r"].metrics.draft_tokens == 0
    assert 0 < len(calls) < 12, len(calls)  # 3 of 40 steps (35 without the accounting)
    assert max(spans[-20:]) <= 3 + 1 and max(spans) <= len(fm["prompts"][1]) + 3, spans
    assert engine.spec_decoder.alpha("r") < 0.5 or ("r", "") not in engine.spec_decoder.acceptance


def test_lookup_where_the_text_repeats_the_draft_elsewhere(fm, tiny_models):
    """draft="<feature draft>+ngram": rows whose text repeats draft by lookup, the others with the
    feature draft, in the same steps; the output is still mlx-lm's, and nothing is left behind."""
    from mlx.utils import tree_map
    from mlx_lm.generate import generate_step

    from macinfer.spec_decode.drafter import LookupDrafter

    model, tok = mlx_lm.load(str(tiny_models("llama")))
    model.update(tree_map(lambda w: w * 0.3 if w.ndim > 1 else w, model.parameters()))  # repeats itself
    want = [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=32)] for p in fm["prompts"]]
    engine = LLMEngine(model, tok, None, max_model_len=256, block_size=4, num_blocks=80,
                       draft=f"{fm['draft']}+ngram", num_speculative_tokens=3, adaptive_speculation=False)
    d = engine.spec_decoder.drafter
    assert isinstance(d, LookupDrafter) and isinstance(d.model, FeatureDrafter) and d.name.endswith("+ngram")
    d.model.min_joint = 0.0  # a random draft is never sure: let it draft
    rows, drafted = {"lookup": 0, "model": 0}, {"lookup": 0, "model": 0}
    for key, part in (("lookup", d.ngram), ("model", d.model)):
        def spy(seqs, ks, propose=part.propose, key=key):
            rows[key] += len(seqs)
            propose(seqs, ks)
        part.propose = spy
    propose = d.propose

    def kept(seqs, ks, kinds=None):  # whose drafts each row kept (a short copy the model disputes: the model's)
        propose(seqs, ks, kinds)
        for i, s in enumerate(seqs):
            drafted["lookup" if (kinds[i] if kinds else d.kind(s)).startswith("ngram:") else "model"] += len(
                s.spec_token_ids)

    d.propose = kept
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    out = run(engine, [(i, p, params, f"r{i}") for i, p in enumerate(fm["prompts"])])
    for i, w in enumerate(want):
        assert out[f"r{i}"].token_ids == w, i
    assert rows["lookup"] > 5 and rows["model"] > 5, rows
    # Each request's metrics split its drafts by who made them (the stats line shows it).
    metrics = [o.metrics for o in out.values()]
    assert sum(m.lookup_draft_tokens for m in metrics) == drafted["lookup"] > 0
    assert sum(m.draft_tokens - m.lookup_draft_tokens for m in metrics) == drafted["model"] > 0
    assert all(m.lookup_accepted_tokens <= m.lookup_draft_tokens for m in metrics)
    kinds = {kind for kind, _ in engine.spec_decoder.pooled}
    assert "model" in kinds and any(k.startswith("ngram:") for k in kinds), kinds
    engine.step()
    for pool in (engine.block_pool, d.model.pool):
        assert not [b for b in pool.blocks[1:] if b.ref_cnt] and pool.req_to_blocks == {}
    assert d.model.states == {} and d.model.feats == {} and d.ngram._cache == {}
    assert engine.spec_decoder.acceptance == {}


def test_round_cost_is_timed_on_decode_rounds_only(fm, tiny_models, monkeypatch):
    """The draft round cost adaptive k charges per token (`round_s`) is timed on rounds feeding one or two
    tokens a row: not on a prompt's catch-up, nor on the catch-up after lookup drafted for a while
    (every token accepted meanwhile fed in one round). A clock that charges 1 ms per token fed says so."""
    from mlx.utils import tree_map

    import macinfer.spec_decode.feature_draft as feature_draft

    model, tok = mlx_lm.load(str(tiny_models("llama")))
    model.update(tree_map(lambda w: w * 0.3 if w.ndim > 1 else w, model.parameters()))  # repeats itself
    engine = LLMEngine(model, tok, None, max_model_len=256, block_size=4, num_blocks=80,
                       draft=f"{fm['draft']}+ngram", num_speculative_tokens=3, adaptive_speculation=False)
    d = engine.spec_decoder.drafter.model
    d.min_joint = 0.0
    clock, fed = {"now": 0.0}, []
    monkeypatch.setattr(feature_draft, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock["now"])}))
    run_ = d._run

    def timed(sts, tokens, feats):
        fed.append(max(map(len, tokens)))
        clock["now"] += 0.001 * fed[-1]
        return run_(sts, tokens, feats)

    d._run = timed
    propose, measured = d.propose, []

    def watched(seqs, ks):
        propose(seqs, ks)
        measured.append(d.round_s or 0.0)

    d.propose = watched
    run(engine, [(i, p, SamplingParams(max_tokens=32, ignore_eos=True), f"r{i}") for i, p in enumerate(fm["prompts"])])
    assert any(2 < n <= 8 for n in fed) and any(n <= 2 for n in fed)  # catch-ups of a few tokens, and decode rounds
    assert 0.001 <= max(measured) <= 0.002 + 1e-9


def test_narrowing_the_head_keeps_the_most_generated_tokens(fm, tmp_path, monkeypatch):
    """scripts/train/train_eagle.py head: the head keeps the N of its ids the target generates most (prompt
    tokens do not count; ties go to the lower id), nothing else in the file changes, and the
    narrowed draft still decodes exactly."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np

    script = Path(__file__).resolve().parents[1] / "scripts" / "train" / "train_eagle.py"
    data = tmp_path / "data"
    data.mkdir()

    def head(where, n):  # the script as a user runs it, on this test's data
        return subprocess.run([sys.executable, str(script), "head", "--draft", str(where), "--head-vocab", str(n)],
                              capture_output=True, text=True, env={**os.environ, "MACINFER_DRAFT_DATA": str(data)})

    # Continuations: 10 x3, 6 x2, 8 x2, 12 x1, 13 (not a kept id: odd) x5. Prompt tokens: 2, 4 x9.
    seqs = [([2, 4, 4, 10, 6, 13, 13], 3), ([4, 4, 4, 10, 8, 8, 13, 13], 3), ([4, 4, 4, 10, 6, 12, 13], 3)]
    draft = tmp_path / "draft"
    shutil.copytree(fm["draft"], draft)
    before = mx.load(str(draft / "model.safetensors"))
    # Bad input: one line each, and the draft is left as it was.
    for where, n, says in ((tmp_path, 6, "not a feature draft"), (draft, 10**6, "--head-vocab must be"),
                           (draft, 6, "no training continuations")):
        res = head(where, n)
        assert res.returncode == 1 and says in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert mx.array_equal(mx.load(str(draft / "model.safetensors"))["macinfer.head_ids"], before["macinfer.head_ids"])
    rows = sum(len(s) - 1 for s, _ in seqs)  # a shard as train_draft.py data writes it
    np.savez(data / "train-greedy-96-0000.npz", tokens=np.array(sum((s for s, _ in seqs), []), np.int32),
             lens=np.array([len(s) for s, _ in seqs]), n_prompt=np.array([n for _, n in seqs]),
             topi=np.zeros((rows, 16), np.int32), topl=np.zeros((rows, 16), np.float16))
    assert head(draft, 6).returncode == 0
    after = mx.load(str(draft / "model.safetensors"))
    assert after["macinfer.head_ids"].tolist() == [0, 2, 6, 8, 10, 12]  # 10, 6, 8, 12 by count, then 0, 2
    assert set(after) == set(before) and all(mx.array_equal(after[k], before[k]).item()
                                             for k in before if k != "macinfer.head_ids")
    assert json.loads((draft / "config.json").read_text())["macinfer_draft"]["head_vocab"] == 6
    assert not list(draft.glob("*.tmp.*"))
    engine = LLMEngine(fm["model"], fm["tok"], None, max_model_len=256, block_size=4, num_blocks=60,
                       draft=str(draft), num_speculative_tokens=2, adaptive_speculation=False,
                       enable_prefix_cache=False)
    assert engine.spec_decoder.drafter.draft.head.weight.shape[0] == 6
    engine.spec_decoder.drafter.min_joint = 0.0  # a random draft is never sure: let it draft
    out = run(engine, [(0, fm["prompts"][0], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), "r")])
    assert out["r"].token_ids == fm["want"][0] and out["r"].metrics.draft_tokens > 0


def test_the_drafter_s_memory_is_counted_once(fm):
    """kv_stats' draft_bytes (what the server's --models-memory counts): the draft's own layer, its
    head's kept rows and its KV pool, but not the target's embedding, which it only reads."""
    from mlx.utils import tree_flatten

    engine = LLMEngine(fm["model"], fm["tok"], None, max_model_len=256, block_size=4, num_blocks=18,
                       draft=str(fm["draft"]))
    d: FeatureDrafter = engine.spec_decoder.drafter
    embed = fm["model"].model.embed_tokens.weight
    own = sum(v.nbytes for _, v in tree_flatten(d.draft.parameters()) if v is not embed)
    assert any(v is embed for _, v in tree_flatten(d.draft.parameters()))  # it shares the target's embedding
    assert engine.kv_stats()["draft_bytes"] == own + d.draft.head.weight.nbytes + d.runner.kv_bytes > 0
    plain = LLMEngine(fm["model"], fm["tok"], None, max_model_len=256, block_size=4, num_blocks=18)
    assert plain.kv_stats()["draft_bytes"] == 0
