"""The shipped SmolLM2-135M draft loads against the embedded target and really gets accepted."""

from __future__ import annotations

import json
import shutil

import pytest

from macinfer.core.lm_head import SubsetHead
from macinfer.spec_decode.draft_model import SHIPPED_DRAFTS, load_draft
from macinfer.errors import MacinferError

# A held-out prompt kind (scripts/train/train_draft.py never trains on held-out topics).
PROMPT = "Write a short poem about a rainy day."
K = 4
# The shipped draft accepts 0.130 per drafted token at k=4 (0.329 at k=1) over 48 held-out
# prompts and 4/20 on this prompt (greedy, deterministic); an untrained truncated-layer draft
# accepts ~0.
MIN_ACCEPTANCE = 0.1
# The feature draft (k = 2, chains cut by its confidence) gets 8 of 18 drafts accepted on this
# prompt; its untrained start gets none (top-1 0.001 on held-out text).
MIN_FEATURE_ACCEPTANCE = 0.25


@pytest.fixture(scope="module")
def target():
    from macinfer.modelio.loader import load_model

    model, tokenizer, _ = load_model(None, dequantize=True)
    return model, tokenizer


@pytest.mark.parametrize("name", ["smollm2-135m", "smollm2-135m-tokens"])
def test_shipped_draft_is_small_and_embeddingless(name):
    path = SHIPPED_DRAFTS[name]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["macinfer_draft"]["embedding"] == "target"
    assert cfg["vocab_size"] == 49152 and cfg["hidden_size"] == 576
    assert sum(f.stat().st_size for f in path.iterdir()) < 20e6
    assert (path / "README.md").exists()


def test_shipped_draft_is_accepted(target):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    model, tokenizer = target
    draft = load_draft("smollm2-135m-tokens", model, tokenizer)
    assert draft.model.embed_tokens is model.model.embed_tokens  # shared, not copied
    assert isinstance(draft.lm_head, SubsetHead) and draft.lm_head.weight.shape == (8192, 576)
    assert len(draft.layers) < len(model.layers)
    assert all(v.dtype == mx.float32 for v in _leaves(draft)) or mx.metal.is_available()

    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    tc, dc = make_prompt_cache(model), make_prompt_cache(draft)
    x = mx.array([ids])
    out = [int(mx.argmax(model(x, cache=tc)[0, -1]))]
    mx.eval(draft(x[:, :-1], cache=dc))
    pending = [ids[-1], out[0]]
    accepted = drafted = 0
    for _ in range(5):  # five speculative steps: k greedy drafts, one target verify pass
        props = []
        logits = draft(mx.array([pending]), cache=dc)
        for i in range(K):
            props.append(int(mx.argmax(logits[0, -1])))
            if i < K - 1:
                logits = draft(mx.array([[props[-1]]]), cache=dc)
        preds = mx.argmax(model(mx.array([[out[-1]] + props]), cache=tc)[0], axis=-1).tolist()
        n = 0
        while n < K and props[n] == preds[n]:
            n += 1
        accepted, drafted = accepted + n, drafted + K
        trim_prompt_cache(tc, K - n)
        if n < K:
            trim_prompt_cache(dc, K - 1 - n)
            pending = [preds[n]]
        else:
            pending = [props[-1], preds[n]]
        out += props[:n] + [preds[n]]
    assert accepted / drafted >= MIN_ACCEPTANCE, (accepted, drafted, tokenizer.decode(out))


def test_shipped_feature_draft_is_accepted(target):
    """The default SmolLM2 draft reads the target's hidden states (macinfer.spec_decode.feature_draft)."""
    import mlx.core as mx

    from macinfer.engine.llm_engine import LLMEngine
    from macinfer.spec_decode.feature_draft import FeatureDraft
    from macinfer.core.sampling import SamplingParams

    model, tokenizer = target
    draft = load_draft("smollm2-135m", model, tokenizer)
    assert isinstance(draft, FeatureDraft) and len(draft.layers) == 1
    assert draft.model.embed_tokens is model.model.embed_tokens and draft.head.weight.shape == (4096, 576)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    params = SamplingParams(max_tokens=24)
    outs = {}
    for name, draft_opt in (("plain", None), ("feature", "smollm2-135m")):
        engine = LLMEngine(model, tokenizer, None, max_model_len=512, kv_memory="32MB", enable_prefix_cache=False,
                           draft=draft_opt, num_speculative_tokens=2, adaptive_speculation=False)
        engine.add_request(ids, params, request_id="r")
        while engine.has_unfinished():
            for d in engine.step():
                if d.output is not None:
                    outs[name] = d.output
    assert outs["feature"].token_ids == outs["plain"].token_ids
    m = outs["feature"].metrics
    assert m.accepted_tokens / m.draft_tokens >= MIN_FEATURE_ACCEPTANCE, (m.accepted_tokens, m.draft_tokens)
    assert mx.metal.is_available() or draft.fc.weight.dtype == mx.float32


def test_auto_is_the_shipped_draft_with_lookup(target):
    """draft="auto" for the embedded model: its feature draft, plus n-gram lookup where that pays;
    for a model nothing is made for, lookup alone (macinfer.spec_decode.auto_draft)."""
    from types import SimpleNamespace

    from macinfer.spec_decode.drafter import LookupDrafter, NgramDrafter
    from macinfer.engine.llm_engine import LLMEngine
    from macinfer.spec_decode.feature_draft import FeatureDrafter

    model, tokenizer = target
    info = SimpleNamespace(name="smollm2-135m", context_length=8192)
    engine = LLMEngine(model, tokenizer, info, kv_memory="32MB", enable_prefix_cache=False, draft="auto")
    d = engine.spec_decoder.drafter
    assert isinstance(d, LookupDrafter) and isinstance(d.model, FeatureDrafter) and d.name == "smollm2-135m+ngram"
    other = SimpleNamespace(name="some-other-model", context_length=8192)
    e = LLMEngine(model, tokenizer, other, kv_memory="32MB", enable_prefix_cache=False, draft="auto")
    assert isinstance(e.spec_decoder.drafter, NgramDrafter) and e.draft_choice.kind == "ngram"  # nothing made for it


def _leaves(m):
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(m.parameters())]


def test_embeddingless_draft_vocab_mismatch(tiny_models, tmp_path):
    from macinfer.modelio.loader import load_model

    model, tokenizer, _ = load_model(str(tiny_models("llama")))
    bad = tmp_path / "draft"
    shutil.copytree(SHIPPED_DRAFTS["smollm2-135m-tokens"], bad)  # made for a 49152-token vocabulary
    with pytest.raises(MacinferError, match="vocabulary"):
        load_draft(bad, model, tokenizer)


def test_full_draft_tokenizer_must_match(tiny_models, tmp_path):
    from macinfer.modelio.loader import load_model

    from tiny import build_tiny_model

    tgt = tiny_models("llama")
    model, tokenizer, _ = load_model(str(tgt))
    # same tokenizer, different weights: accepted
    same = build_tiny_model(tmp_path / "same", "llama", seed=1, num_layers=1)
    draft = load_draft(str(same), model, tokenizer)
    assert len(draft.layers) == 1
    # a tokenizer with a different vocabulary: refused with one line
    other = build_tiny_model(tmp_path / "other", "llama", seed=2, num_layers=1)
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = sorted(k for k in vocab if len(k) > 1)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(MacinferError, match="tokenizer") as e:
        load_draft(str(other), model, tokenizer)
    assert "\n" not in str(e.value)
