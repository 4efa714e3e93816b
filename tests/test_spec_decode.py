"""Speculative decoding in the engine, on tiny random models.

Greedy: every drafter (a draft model that is the target itself = always right,
one with other weights = mostly wrong, scripted drafters that are always right
or always wrong, n-gram on a model that repeats itself) must give mlx-lm's tokens exactly, alone and in a
continuous batch with arrivals, a pool small enough to preempt, and no block
left behind by rollback. Sampling: the engine's sampled tokens with speculation
follow the target's exact distribution (chi-square on the first two tokens).
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from driver import run as drive
from oracle import mlx_lm_greedy
from test_rejection import chi2_pvalue

from macinfer.spec_decode.drafter import DraftModelDrafter, NgramDrafter
from macinfer.engine.llm_engine import LLMEngine
from macinfer.core.sampling import Sampler, SamplingParams
from macinfer.core.sequence import Sequence, SequenceStatus

TEXTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "Paged attention stores the key value cache",
    "What is the capital of France?",
    "Once upon a time there was a little model",
]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory):
    target_path, other_path = tiny_models("llama"), tiny_models("llama", seed=1)
    model, tok = mlx_lm.load(str(target_path))
    prompts = [tok.encode(t) for t in TEXTS]
    want = [mlx_lm_greedy(target_path, p, MAX_TOKENS) for p in prompts]
    return {"tmp": tmp_path_factory.mktemp("spec"), "target": target_path, "other": other_path, "model": model, "tok": tok, "prompts": prompts, "want": want}


class ScriptedDrafter:
    """Proposes the known greedy continuation (right) or something else (wrong): deterministic."""

    name, has_model, hidden_sink = "scripted", False, None

    def __init__(self, prompts, continuations, right: bool, vocab: int):
        self.script = {tuple(p): c for p, c in zip(prompts, continuations)}
        self.right, self.vocab = right, vocab

    def available(self, seq, k):
        return k

    def propose(self, seqs, num_draft):
        for seq, k in zip(seqs, num_draft):
            cont = self.script[tuple(seq.prompt_token_ids)]
            j = seq.num_output_tokens
            want = (cont[j: j + k] + [0] * k)[:k]
            seq.spec_token_ids = want if self.right else [(t + 1) % self.vocab for t in want]
            seq.spec_probs = None

    def remove(self, request_id):
        pass


def subset_draft(m, out, keep, noise: float = 0.0):
    """An embedding-less draft of the target (optionally perturbed) whose head covers only `keep`."""
    from mlx.utils import tree_map

    from macinfer.spec_decode.draft_model import save_draft

    draft, _ = mlx_lm.load(str(m["target"]))
    if noise:
        key = mx.random.key(7)
        draft.update(tree_map(lambda w: w + noise * mx.random.normal(w.shape, key=key) if w.ndim > 1 else w,
                              draft.parameters()))
    cfg = json.loads((m["target"] / "config.json").read_text())
    cfg["macinfer_draft"] = {"target": "tiny", "embedding": "target", "head_vocab": len(keep)}
    save_draft(draft, cfg, out, head_ids=sorted(keep), bits=0)
    return str(out)


def make_draft(kind, m):
    if kind == "subset":  # the target's own layers, a head over the even token ids only
        return subset_draft(m, m["tmp"] / "subset-draft", range(0, m["model"].args.vocab_size, 2))
    if kind == "same":
        return str(m["target"])  # loaded through macinfer.draft_model.load_draft
    if kind == "other":
        return str(m["other"])
    return ScriptedDrafter(m["prompts"], m["want"], right=kind == "right", vocab=m["model"].args.vocab_size)


def no_blocks_past_the_tokens(engine):
    """Rollback freed every block past a sequence's tokens."""
    pool = engine.block_pool
    for seq in engine.scheduler.running:
        assert len(pool.req_to_blocks.get(seq.request_id, [])) <= pool.num_blocks_for(seq.num_tokens), seq
        assert seq.num_computed_tokens <= seq.num_tokens


def run(engine, arrivals):
    """arrivals: (step, prompt, params, rid). Checks the no-leak invariant after every step."""
    return drive(engine, arrivals, after_step=no_blocks_past_the_tokens)


def assert_all_free(engine):
    engine.step()  # lets the drafter drop what finished requests held
    for pool in [engine.block_pool] + ([engine.spec_decoder.drafter.pool] if isinstance(engine.spec_decoder.drafter, DraftModelDrafter) else []):
        used = [b for b in pool.blocks[1:] if b.ref_cnt]
        assert not used and pool.req_to_blocks == {}
    assert engine.requests == {}


@pytest.mark.parametrize("kind", ["same", "other", "right", "wrong", "subset"])
def test_greedy_equals_mlx_lm(models, kind):
    m = models
    engine = LLMEngine(m["model"], m["tok"], None, max_model_len=256, block_size=4, num_blocks=40,
                       draft=make_draft(kind, m), num_speculative_tokens=3, adaptive_speculation=False)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    # Alone, then all four arriving over the first steps (continuous batch).
    alone = run(engine, [(0, m["prompts"][0], params, "alone")])
    assert alone["alone"].token_ids == m["want"][0]
    batch = run(engine, [(i, p, params, f"r{i}") for i, p in enumerate(m["prompts"])])
    for i, want in enumerate(m["want"]):
        assert batch[f"r{i}"].token_ids == want, i
    drafted = sum(o.metrics.draft_tokens for o in batch.values())
    accepted = sum(o.metrics.accepted_tokens for o in batch.values())
    if kind in ("same", "right"):
        assert drafted > 0 and accepted == drafted
    if kind == "wrong":
        assert drafted > 0 and accepted == 0
    if kind == "subset":  # right exactly where the target's token is one the head covers
        odd = sum(t % 2 for w in m["want"] for t in w)
        assert drafted > 0 and 0 < accepted < drafted and odd > 0
    assert_all_free(engine)


def test_subset_head_drafts_from_its_kept_columns(models):
    """A draft whose head keeps part of the vocabulary drafts from those columns' logits alone
    (no full-width -inf row per draft): the same drafts, accepted the same, as from the full row."""
    m = models
    path = subset_draft(m, m["tmp"] / "subset-draft-cols", range(0, m["model"].args.vocab_size, 2))
    params = SamplingParams(max_tokens=MAX_TOKENS)
    seen = []
    for narrow in (True, False):
        engine = LLMEngine(m["model"], m["tok"], None, max_model_len=256, block_size=4, num_blocks=40,
                           draft=path, num_speculative_tokens=3, adaptive_speculation=False)
        drafter = engine.spec_decoder.drafter
        assert isinstance(drafter, DraftModelDrafter) and drafter.head is not None
        widths, forward = [], drafter.runner.forward

        def spy(sched, forward=forward, widths=widths, **kw):
            logits = forward(sched, **kw)
            widths.append(logits.shape[-1])
            return logits

        drafter.runner.forward = spy
        if not narrow:
            drafter.head = None  # the full-width path: SubsetHead's -inf-padded logits
        out = run(engine, [(i, p, params, f"r{i}") for i, p in enumerate(m["prompts"])])
        assert set(widths) == {len(range(0, m["model"].args.vocab_size, 2)) if narrow else m["model"].args.vocab_size}
        seen.append([(o.token_ids, o.metrics.draft_tokens, o.metrics.accepted_tokens) for _, o in sorted(out.items())])
    assert seen[0] == seen[1]
    assert [t for t, _, _ in seen[0]] == m["want"]


@pytest.mark.parametrize("kind", ["same", "wrong"])
def test_preemption_during_speculation(models, kind):
    m = models
    # 17 usable blocks of 4 tokens: each sequence (<= 62 tokens) fits alone, not all four.
    engine = LLMEngine(m["model"], m["tok"], None, max_model_len=256, block_size=4, num_blocks=18,
                       draft=make_draft(kind, m), num_speculative_tokens=4, adaptive_speculation=False)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    out = run(engine, [(0, p, params, f"r{i}") for i, p in enumerate(m["prompts"])])
    assert engine.scheduler.num_preemptions > 0
    for i, want in enumerate(m["want"]):
        assert out[f"r{i}"].token_ids == want, i
    assert_all_free(engine)


def test_ngram_greedy_on_repetitive_model(tiny_models):
    """A flattened random model repeats itself: n-gram drafts are often (not always) right."""
    from mlx.utils import tree_map
    from mlx_lm.generate import generate_step

    model, tok = mlx_lm.load(str(tiny_models("llama")))
    model.update(tree_map(lambda w: w * 0.3 if w.ndim > 1 else w, model.parameters()))
    prompts = [tok.encode(t) for t in TEXTS]
    want = [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=32)] for p in prompts]
    engine = LLMEngine(model, tok, None, max_model_len=256, block_size=4, num_blocks=60,
                       draft="ngram", num_speculative_tokens=4, adaptive_speculation=False)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    alone = run(engine, [(0, prompts[1], params, "alone")])
    assert alone["alone"].token_ids == want[1]
    out = run(engine, [(i, p, params, f"r{i}") for i, p in enumerate(prompts)])
    for i in range(len(prompts)):
        assert out[f"r{i}"].token_ids == want[i], i
    drafted = sum(o.metrics.draft_tokens for o in out.values())
    accepted = sum(o.metrics.accepted_tokens for o in out.values())
    assert 0 < accepted < drafted
    assert_all_free(engine)


def test_adaptive_k_follows_acceptance_and_costs():
    """K maximises expected tokens per second: more drafts when they are cheap and right."""
    from macinfer.spec_decode.decoder import SpecDecoder
    from macinfer.spec_decode.step_cost import StepCost

    spec = SpecDecoder(NgramDrafter(), num_speculative_tokens=5)
    assert spec.choose_k([0.9], [5]) == 0  # nothing measured yet: one plain step first

    def costs(a, b):
        spec.step_cost = StepCost(prior_weight=0.0)
        for n in (1, 2, 4, 8, 1, 3):
            spec.step_cost.observe(n, a + b * n)

    costs(0.100, 0.008)  # float32 + OpenBLAS, Metal: nearly flat in tokens
    assert spec.choose_k([0.95], [5]) == 5
    assert spec.choose_k([0.95], [2]) == 2  # the drafter only offers 2
    assert spec.choose_k([0.0], [5]) == 0
    assert spec.choose_k([0.0, 0.9], [5, 5]) == 5  # one row's good drafts pay for the batch
    costs(0.0, 0.1)  # quantised matmul on a CPU: k drafts cost k tokens
    assert spec.choose_k([0.8], [5]) == 0
    spec.drafter.has_model = True
    costs(0.100, 0.008)
    # A draft model not measured yet is tried (its first rounds measure it), even with 8 rows
    # per step; with a quarter of a step assumed per round it would never be, at 0.5 acceptance.
    spec.drafter.round_s = None
    assert spec.choose_k([0.5] * 8, [5] * 8) > 0
    # 8 rows that have only ever run plain steps (160 ms): their slope is the prior's, which is
    # optimistic, so drafting is tried (and measured) at 0.5 acceptance; at 0.1 it never was.
    spec.step_cost = StepCost()
    for _ in range(10):
        spec.step_cost.observe(8, 0.160)
    spec.drafter.round_s = 0.005
    assert spec.choose_k([0.5] * 8, [5] * 8) > 0
    spec.drafter.round_s = 0.05  # a draft model costing half a step per token
    costs(0.100, 0.008)
    assert spec.choose_k([0.95], [5]) > 0
    assert spec.choose_k([0.3], [5]) == 0


def test_step_cost_tells_the_synchronous_step_from_the_extra_tokens():
    """Every verify step is synchronous: one line through queued one-token steps and synchronous
    verify steps would charge what queueing hides to the verified tokens. Costs of the dev CPU
    (float32 SmolLM2 + OpenBLAS): 37.5 ms + 5.5 ms per token, 4 ms more synchronously."""
    from macinfer.spec_decode.step_cost import StepCost

    cost = StepCost()
    widths = [(1, False)] * 3 + [(2, True), (3, True), (1, True), (2, True), (1, False), (4, True)]
    for _ in range(20):
        for n, sync in widths:
            cost.observe(n, 0.0375 + 0.0055 * n + (0.004 if sync else 0.0), sync=sync)
    a, b = cost.coeffs()
    assert a == pytest.approx(0.0375, rel=1e-2) and b == pytest.approx(0.0055, rel=1e-2)
    assert cost.sync_penalty == pytest.approx(0.004, rel=2e-2)
    assert cost(3) == pytest.approx(0.0375 + 3 * 0.0055, rel=1e-2)
    # Synchronous steps of one width only cannot tell c from b: the ridge keeps c near 0 and the
    # steps are still predicted as measured.
    cost = StepCost(prior_weight=0.0)
    for _ in range(40):
        for n, sync in ((1, False), (2, True)):
            cost.observe(n, 0.0375 + 0.0055 * n + (0.004 if sync else 0.0), sync=sync)
    assert cost(2) + cost.sync_penalty == pytest.approx(0.0375 + 2 * 0.0055 + 0.004, rel=2e-2)
    assert cost.sync_penalty < 0.002
    # Steps of one size only show no slope: b is 0 and they are predicted as measured.
    cost = StepCost(prior_weight=0.0)
    for _ in range(5):
        cost.observe(8, 0.160)
    assert cost.coeffs() == pytest.approx((0.160, 0.0)) and cost.sync_penalty == 0.0


def test_step_cost_prior_gives_way_to_the_verify_steps():
    """A reply as the engine times it: its first step drafts, then mostly synchronous verify steps
    of 1-4 tokens with a queued plain step now and then (dev CPU costs: 38 ms + 5.3 ms per token,
    2.6 ms more synchronously). Within 40 steps the fit has the verify steps' own slope, and the
    optimistic prior no longer holds b down (which a large c then made up for)."""
    import random

    from macinfer.spec_decode.step_cost import StepCost

    rng = random.Random(0)
    cost = StepCost()
    for i in range(40):
        sync = i % 8 != 7
        n = rng.choice([1, 2, 2, 2, 3, 3, 4]) if sync else 1
        cost.observe(n, 0.038 + 0.0053 * n + (0.0026 if sync else 0.0), sync=sync)
    a, b = cost.coeffs()
    assert b == pytest.approx(0.0053, rel=0.15) and cost.sync_penalty < 0.004
    assert cost(1) == pytest.approx(0.0433, rel=0.03)


def _busy_then_quiet(cost, quiet_steps: int):
    """A busy host (every step slow, wide synchronous ones slower and noisier), then quiet
    width-1 queued steps of 40 ms."""
    import random

    rng = random.Random(1)
    cost.observe(1, 0.040)
    for _ in range(30):
        if rng.random() < 0.5:
            cost.observe(1, 0.12 + rng.random() * 0.05)
        else:
            w = rng.choice([1, 2, 3])
            cost.observe(w, 0.12 + 0.08 * w + rng.random() * 0.1, sync=True)
    for _ in range(quiet_steps):
        cost.observe(1, 0.040)


def test_a_fit_starts_again_when_the_host_gets_faster():
    """Two steps in a row well under the prediction: the busy steps are dropped, not faded over
    ~100 steps (queued steps of one width could not move b or c)."""
    from macinfer.spec_decode.step_cost import StepCost

    cost = StepCost()
    _busy_then_quiet(cost, 10)
    assert cost(1) == pytest.approx(0.040, rel=0.05)
    assert cost.sync_penalty < 0.005 and cost(3) < 0.05


def test_a_coefficient_at_its_bound_is_held_there_while_the_others_are_solved():
    """The busy steps left in (no restart): A's unconstrained optimum is negative. Held at its
    bound, b and c are solved again, and T(1) follows the quiet steps; clipped after the solve,
    T(1) stayed at 2.2x their measured time."""
    from macinfer.spec_decode.step_cost import StepCost

    cost = StepCost()
    cost.FAST = 0.0  # never restart
    _busy_then_quiet(cost, 40)
    a, b = cost.coeffs()
    assert a == pytest.approx(1e-6) and cost(1) < 0.05


def test_adaptive_k_charges_declined_asks_their_draft_round_only():
    """A row the drafter often declines widens the forward less often: asking it costs less.

    Costs of the dev CPU (float32 SmolLM2, a feature draft): a 60 ms step, +9 ms per verified
    token, 4.5 ms per draft round. At 0.2 acceptance per ask, asking does not pay if every ask
    widens the forward (1.2 tokens for 73.5 ms against 1 for 60), and does if 40% of asks are
    declined (widening 60% of the time: 1.2 for 69.9).
    """
    from macinfer.spec_decode.decoder import SpecDecoder
    from macinfer.spec_decode.step_cost import StepCost

    spec = SpecDecoder(NgramDrafter(), num_speculative_tokens=1)
    spec.drafter.has_model, spec.drafter.round_s = True, 0.0045
    spec.step_cost = StepCost(prior_weight=0.0)
    for n in (1, 2, 1, 2, 3):
        spec.step_cost.observe(n, 0.051 + 0.009 * n)
    assert spec.choose_k([0.2], [1]) == 0
    assert spec.choose_k([0.2], [1], declines=[0.0]) == 0
    assert spec.choose_k([0.2], [1], declines=[0.4]) == 1
    # In a batch the forward widens if any row drafts: two rows each declining 40% of the time
    # widen it 84% of the time, which does not pay.
    assert spec.choose_k([0.2, 0.2], [1, 1], declines=[0.4, 0.4]) == 0


def test_a_planned_step_drafts_unless_the_offer_is_gone():
    """wants_sync plans a draft a step ahead; the synchronous step it costs then drafts, unless
    the drafter has nothing to offer any more (the pending token broke an n-gram match)."""
    from types import SimpleNamespace

    from macinfer.spec_decode.decoder import SpecDecoder
    from macinfer.spec_decode.step_cost import StepCost

    class Scripted(NgramDrafter):
        offer = 2

        def available(self, seq, k):
            return min(k, self.offer)

        def propose(self, seqs, num_draft):
            for s, k in zip(seqs, num_draft):
                s.spec_token_ids = [7] * k

    spec = SpecDecoder(Scripted(), num_speculative_tokens=4)
    spec.step_cost = StepCost(prior_weight=0.0)
    for n in (1, 2, 1, 3):
        spec.step_cost.observe(n, 0.05 + 0.005 * n)
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=50))
    seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, 2
    assert spec.wants_sync([seq], pending=True)  # at the prior acceptance (0.5), K = 2 pays
    assert spec.wants_sync([seq], pending=False)  # ... carried out by the next step
    spec.alpha = lambda rid, kind="", sampled=False: 0.01  # judged again, it no longer pays (a knife edge)
    spec.propose([seq])
    assert seq.spec_token_ids == [7, 7] and spec._plan_backoff == 0
    del spec.alpha
    assert spec.wants_sync([seq], pending=True) and spec.wants_sync([seq], pending=False)
    Scripted.offer = 0  # the match is gone: nothing to draft, and planning backs off
    spec.propose([seq])
    assert seq.spec_token_ids == [] and spec._plan_backoff == 1


def test_a_stale_sync_penalty_is_probed_after_a_run_of_queued_steps():
    """Synchronous steps timed on a busy host fit c near 30 ms (the step's real c is 2.5 ms), and
    with it drafting does not pay. Queued steps never measure c, and as the busy steps fade the fit
    moves their excess from c into b, which queued steps of one width cannot measure either: without
    a probe nothing is planned for ~100 steps. After PROBE_AFTER queued steps, a step is planned as
    if synchronous anyway; it drafts, and its own time (with the probes it calls for while it comes
    in under the fit) brings the fit back, after which every step drafts."""
    from macinfer.spec_decode.decoder import SpecDecoder

    class Offers(NgramDrafter):
        def available(self, seq, k):
            return min(k, 2)

    spec = SpecDecoder(Offers(), num_speculative_tokens=4)
    step = lambda n, sync: 0.044 + 0.005 * n + (0.0025 if sync else 0.0)  # noqa: E731
    spec.step_cost.observe(1, step(1, False))
    for n in (2, 3, 2, 3, 2):
        spec._measured_sync(n, step(n, True) + 0.0275)  # the busy moment
    assert spec.step_cost.sync_penalty > 0.02
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=500))
    seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, 2
    drafted = []
    for i in range(100):
        if spec.wants_sync([seq], pending=True):
            assert spec.wants_sync([seq], pending=False)  # carried out by the next step, which drafts
            spec._measured_sync(1 + spec._plan_k, step(1 + spec._plan_k, True))  # as update_from_output does
            drafted.append(i)
        else:
            spec.skip_step([seq], 1, step(1, False))
    assert drafted == list(range(SpecDecoder.PROBE_AFTER, 100))
    assert spec.step_cost.sync_penalty < 0.005


# -- sampling: the distribution is the target's ---------------------------------------------
def sampled_prefixes(engine, prompt, n: int, width: int, max_tokens: int) -> tuple[dict, int, int]:
    """n requests sampled from `prompt` (temperature 1, top-k 3, seeds 0..n-1) -> (count of each
    first-`width`-token prefix, drafts proposed, drafts accepted)."""
    for i in range(n):
        engine.add_request(prompt, SamplingParams(temperature=1.0, top_k=3, max_tokens=max_tokens, ignore_eos=True,
                                                  seed=i))
    counts, drafted, accepted = {}, 0, 0
    while engine.has_unfinished():
        for d in engine.step():
            if d.output is not None:
                key = tuple(d.output.token_ids[:width])
                counts[key] = counts.get(key, 0) + 1
                drafted += d.output.metrics.draft_tokens
                accepted += d.output.metrics.accepted_tokens
    return counts, drafted, accepted


def feature_draft(m, out, keep):
    """A random feature draft (macinfer.spec_decode.feature_draft) for the tiny target, its head over `keep`."""
    from mlx_lm.models import llama

    from macinfer.spec_decode.draft_model import save_draft
    from macinfer.spec_decode.feature_draft import FeatureDraft, feature_draft_config

    V = m["model"].args.vocab_size
    cfg = feature_draft_config(json.loads((m["target"] / "config.json").read_text()), len(keep))
    mx.random.seed(5)
    save_draft(FeatureDraft(llama.ModelArgs.from_dict(cfg)), cfg, out, head_ids=sorted(keep), bits=0)
    return str(out)


@pytest.mark.parametrize("kind", ["model", "top", "subset", "feature", "checked-copy"])
def test_sampled_tokens_follow_the_target(models, kind):
    """First three sampled tokens (top-3, temperature 1) against the target's exact joint distribution.

    The first comes from the prefill; the next two from one verify step with two drafts,
    from a perturbed copy of the target (sampled q) or from a deterministic drafter; "checked-copy":
    a short copy checked against that perturbed model's draw (LookupDrafter), kept where they agree.
    """
    from mlx.utils import tree_map

    m = models
    model, prompt = m["model"], m["prompts"][2]
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=3))

    def probs(ids):
        return np.array(sampler.probs(model(mx.array([ids]))[0, -1]))

    p = {(): probs(prompt)}
    for a in np.flatnonzero(p[()]):
        p[(a,)] = probs(prompt + [int(a)])
        for b in np.flatnonzero(p[(a,)]):
            p[(a, b)] = probs(prompt + [int(a), int(b)])
    cells = [(a, b, c) for a in np.flatnonzero(p[()]) for b in np.flatnonzero(p[(a,)]) for c in np.flatnonzero(p[(a, b)])]
    if kind == "top":  # always proposes the two tokens most likely after the most likely first token
        a = int(p[()].argmax())
        b = int(p[(a,)].argmax())
        draft = ScriptedDrafter([prompt], [[a, b, int(p[(a, b)].argmax())]], right=True, vocab=0)
    elif kind == "subset":  # q is 0 on part of p's support: the residual max(0, p - q) must make up for it
        a = int(p[()].argmax())
        drop = {int(np.argsort(-p[()])[1]), int(p[(a,)].argmax())}
        draft = subset_draft(m, m["tmp"] / "subset-noisy", set(range(model.args.vocab_size)) - drop, noise=0.05)
    elif kind == "feature":  # q from the target's hidden states; chains cut by the draft's confidence
        # A head over just the tokens of the cells, so that random drafts land in p's support.
        draft = feature_draft(m, m["tmp"] / "feature-draft", {int(t) for c in cells for t in c})
    else:
        draft, _ = mlx_lm.load(str(m["target"]))
        noise = mx.random.key(7)
        # Close enough to the target that some drafts are accepted whatever the schedule (at 0.15 almost none were).
        scale = 0.01 if kind == "checked-copy" else 0.05  # near the target: its draws often agree with the copy
        draft.update(tree_map(lambda w: w + scale * mx.random.normal(w.shape, key=noise) if w.ndim > 1 else w,
                              draft.parameters()))
        if kind == "checked-copy":  # a 5-token match, checked against that model's draw at every step
            from macinfer.spec_decode.drafter import LookupDrafter

            # The copy: the target's likeliest two tokens after its likeliest first one. Verified as a
            # deterministic copy (q one-hot) where the model's draw agreed, its first token would come out
            # with about p^2 instead of p, which this test detects.
            a = int(p[()].argmax())
            b = int(p[(a,)].argmax())
            copy = _Copy()
            copy.copy = [b, int(p[(a, b)].argmax())]
            draft = LookupDrafter(DraftModelDrafter(draft, 900, 4), copy)
            draft.wins = {"model": float("inf"), "lookup": 0.0}  # the model always wins disputes: copies stay checked
    engine = LLMEngine(model, m["tok"], None, max_model_len=64, block_size=4, num_blocks=900, max_num_seqs=64,
                       draft=draft, num_speculative_tokens=2, adaptive_speculation=False)
    n = 1000 if kind == "top" else 1500
    counts, drafted, accepted = sampled_prefixes(engine, prompt, n, width=3, max_tokens=4)
    assert set(counts) <= set(cells)
    observed = np.array([counts.get(c, 0) for c in cells], dtype=float)
    expected = np.array([p[()][a] * p[(a,)][b] * p[(a, b)][c] for a, b, c in cells]) * n
    assert chi2_pvalue(observed, expected) > 1e-3
    assert drafted > 0 and 0 < accepted < drafted  # both accept and reject paths ran


def test_run_cli_draft_options(models):
    import json

    from click.testing import CliRunner

    from macinfer.cli.main import main

    args = ["run", str(models["target"]), "The quick brown fox", "--no-chat-template", "-n", "8", "--json",
            "--no-prefix-cache"]
    result = CliRunner().invoke(main, args + ["--draft", str(models["target"])])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.output.strip().splitlines()[-1])
    assert stats["generation_tokens"] == 8 and stats["accepted_tokens"] <= stats["draft_tokens"]
    assert "accepted_per_step" in stats  # (None if adaptive k never drafted: it is timing-driven)
    result = CliRunner().invoke(main, args + ["--draft", "ngram", "--no-draft"])
    assert result.exit_code != 0 and "contradict" in result.output


@pytest.mark.parametrize("good", ["model", "lookup"])
def test_each_row_drafts_with_whichever_pays(models, good):
    """A LookupDrafter offers lookup and its model for a row whose text matches an earlier stretch;
    adaptive k weighs each by its own measured acceptance, so wrong lookups stop displacing right
    model drafts (and the other way round). Costs are made deterministic (a 10 ms step, +1 ms per
    token), so the outcome depends on acceptance alone; output is mlx-lm's either way."""
    from macinfer.spec_decode.drafter import LookupDrafter

    m = models

    class Lookup(NgramDrafter):  # a match everywhere, its drafts right or wrong
        def __init__(self, right):
            super().__init__()
            self.inner = ScriptedDrafter(m["prompts"], m["want"], right, m["model"].args.vocab_size)

        def match_length(self, seq):
            return 5

        def available(self, seq, k):
            return k

        def propose(self, seqs, num_draft):
            self.inner.propose(seqs, num_draft)

    model = ScriptedDrafter(m["prompts"], m["want"], right=good == "model", vocab=m["model"].args.vocab_size)
    drafter = LookupDrafter(model, Lookup(right=good == "lookup"))
    engine = LLMEngine(m["model"], m["tok"], None, max_model_len=256, block_size=4, num_blocks=60, draft=drafter,
                       num_speculative_tokens=3)
    observe = engine.spec_decoder.step_cost.observe
    engine.spec_decoder.step_cost.observe = lambda tokens, seconds, **kw: observe(tokens, 0.010 + 0.001 * tokens, **kw)
    used = {"model": 0, "lookup": 0}
    for key, part in (("model", model), ("lookup", drafter.ngram)):
        def spy(seqs, ks, propose=part.propose, key=key):
            used[key] += sum(k for k in ks)
            propose(seqs, ks)
        part.propose = spy
    out = run(engine, [(0, m["prompts"][0], SamplingParams(max_tokens=MAX_TOKENS), "r")])
    assert out["r"].token_ids == m["want"][0]
    bad = "lookup" if good == "model" else "model"
    assert used[good] > 3 * max(used[bad], 1), used


class _Copy(NgramDrafter):
    """A fixed match length and copy."""
    length, copy = 5, [7, 8, 9]

    def match_length(self, seq):
        return self.length

    def available(self, seq, k):
        return min(k, len(self.copy))

    def propose(self, seqs, num_draft):
        for s, k in zip(seqs, num_draft):
            s.spec_token_ids, s.spec_probs = self.copy[:k], None


class _FirstThenCount:
    """A model drafter that drafts `first`, then 1, 2, ..."""
    name, has_model, hidden_sink, first, round_s = "model", True, None, 7, None

    def __init__(self):
        self.asked = 0

    def available(self, seq, k):
        return k

    def propose(self, seqs, num_draft):
        for s, k in zip(seqs, num_draft):
            self.asked += 1
            s.spec_token_ids = ([self.first] + list(range(1, k)))[:k]
            # A sampled row's drafts come with q: row i puts 0.5 on its draft, the rest spread evenly.
            q = np.full((k, 12), 0.5 / 11, np.float32)
            q[np.arange(k), s.spec_token_ids] = 0.5
            s.spec_probs = None if s.sampler.params.greedy else mx.array(q)

    def remove(self, request_id):
        pass


def test_a_short_copy_is_kept_where_the_model_begins_alike():
    """LookupDrafter: a row with a short match (< TRUST_MATCH) is drafted by the model too and keeps the
    copy only where the model's first token agrees; otherwise it keeps the model's drafts and says so in
    its kind. Who turned out right where they disagreed is counted, and while the copy wins, short copies
    are not checked. Long matches keep the copy without asking the model."""
    from macinfer.spec_decode.drafter import LookupDrafter

    model, copy = _FirstThenCount(), _Copy()
    d = LookupDrafter(model, copy)
    greedy = Sequence("g", [1, 2, 3], SamplingParams(max_tokens=8))

    def draft(seq):
        kinds = [copy.kind(seq)]
        d.propose([seq], [3], kinds)
        return seq.spec_token_ids, kinds[0]

    assert draft(greedy) == ([7, 8, 9], "ngram:2") and model.asked == 1  # agreed: the copy
    model.first = 4
    assert draft(greedy) == ([4, 1, 2], "model") and model.asked == 2  # disputed: the model's drafts
    greedy.append_token(7)  # the target chose the copy's token
    wins = dict(d.wins)
    copy.length = 9
    assert draft(greedy) == ([7, 8, 9], "ngram:3") and model.asked == 2  # a long copy: not checked
    assert d.wins == {"lookup": 0.9 * wins["lookup"] + 1, "model": 0.9 * wins["model"]}  # the dispute settled
    # A sampled row is checked too: where the model drew the copy's first token, the copy is verified
    # against the model's q at its first position (it was drawn from it) and one-hot after.
    sampled = Sequence("s", [1, 2, 3], SamplingParams(max_tokens=8, temperature=1.0))
    copy.length, model.first, d.wins = 5, 7, {"model": 2.0, "lookup": 1.0}
    assert draft(sampled) == ([7, 8, 9], "ngram:2") and model.asked == 3
    q = np.array(sampled.spec_probs)
    assert q.shape == (3, 12) and q[0, 7] == 0.5 and np.allclose(q[0].sum(), 1.0)
    assert (q[1:] == np.eye(12)[[8, 9]]).all()
    model.first = 4
    assert draft(sampled) == ([4, 1, 2], "model") and model.asked == 4  # disputed: the model's drafts and q
    assert np.array(sampled.spec_probs)[0, 4] == 0.5
    d.wins = {"lookup": 3.0, "model": 2.0}  # the copy has been right more often where they disagreed
    assert draft(greedy) == ([7, 8, 9], "ngram:2") and model.asked == 4



def test_the_unused_draft_of_a_checked_copy_is_scored():
    """Where a copy was checked against the model, the draft the row did not use is scored as a one-token
    draft of its kind by the token the target kept there: the model's estimate learns from the steps a
    copy drafted (else a model that agreed with an accepted copy is never credited, and a few rejections
    of its own stop it drafting for the rest of a reply), and the copy's from the steps the model drafted."""
    from macinfer.core.scheduler import ScheduledSequence
    from macinfer.spec_decode.decoder import SpecDecoder
    from macinfer.spec_decode.drafter import LookupDrafter

    model, copy = _FirstThenCount(), _Copy()
    spec = SpecDecoder(LookupDrafter(model, copy), num_speculative_tokens=3, adaptive=False)
    seq = Sequence("g", [1, 2, 3], SamplingParams(max_tokens=16))
    seq.status = SequenceStatus.RUNNING

    def step(kept):
        """Draft for seq, then verify: the target keeps `kept` (accepted drafts, then its own token)."""
        seq.num_computed_tokens = seq.num_tokens - 1
        spec.propose([seq])
        k = len(seq.spec_token_ids)
        spec.update_from_output([ScheduledSequence(seq, 1 + k, k)], [kept], None)
        for t in kept:
            seq.append_token(t)
        return spec._kinds["g"]

    def counts(kind):
        a = spec.acceptance[("g", kind)]
        return round(a.accepted, 6), round(a.tried, 6)

    assert step([7, 5]) == "ngram:2"  # the model agreed: the copy drafted, 1 of its 3 accepted
    assert counts("ngram:2") == (1.0, 2.0) and counts("model") == (1.0, 1.0)  # the model's 7 was right too
    model.first = 4
    assert step([7]) == "model"  # disputed: the model's 4 drafted and was rejected; the target kept the copy's 7
    fade = spec.IDLE_DECAY * spec.ASK_DECAY / spec.IDLE_DECAY  # a step's aging, then asked
    assert counts("model") == (round(fade * 1.0 + 0, 6), round(fade * 1.0 + 1, 6))
    assert counts("ngram:2") == (round(fade * 1.0 + 1, 6), round(fade * 2.0 + 1, 6))
    copy.length = 9  # a long copy is not checked: nothing to score beside it
    before = counts("model")
    assert step([7, 8, 9, 1]) == "ngram:3"
    assert counts("model") == tuple(round(v * spec.IDLE_DECAY, 6) for v in before)
