"""The drafters `--draft auto` finds, on tiny random models written as the drafts are published.

Kinds (tests/drafts.py writes them): a Qwen3-Next target with MTP layers in its checkpoint; a
GLM-4.7-Flash target (DeepSeek-V3's MLA and MTP layout); an EAGLE-3 draft for a llama target in
vLLM speculators' layout, and one in the EAGLE-3 authors' layout with a smaller draft vocabulary
(d2t); a smaller model with the same tokenizer on disk. For each: greedy output equals mlx-lm's
alone and in a staggered batch that preempts; every round-0 draft the engine computes through its
paged cache equals the draft run densely on the target's real hidden states (so features, paging
and rollback are right); sampled tokens follow the target's distribution (chi-square). The EAGLE-3
layer is also checked against the published formula written out here, and the Qwen MTP layer
against mlx-lm's own sanitize of the same tensors. Then which drafter `auto` picks, and bad input.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from oracle import mlx_lm_greedy
from test_hybrid import HYBRID
from test_models_cli import add_hf_repo
from test_rejection import chi2_pvalue
from test_spec_decode import TEXTS, run, sampled_prefixes

from drafts import eagle3_draft, mtp_checkpoint
from macinfer.core.sampling import Sampler, SamplingParams
from macinfer.engine.llm_engine import LLMEngine
from macinfer.errors import MacinferError
from macinfer.modelio import loader
from macinfer.modelio.loader import load_model
from macinfer.spec_decode.drafter import DraftModelDrafter, LookupDrafter, NgramDrafter
from macinfer.spec_decode.feature_draft import FeatureDrafter
from tiny import build_tiny_model

MAX_TOKENS = 16
KINDS = ["mtp-qwen3_next", "mtp-glm4_moe_lite", "eagle3-speculators", "eagle3-authors-subset", "model-on-disk"]
GLM = json.loads((Path(__file__).parent / "arch_configs.json").read_text())["configs"]["glm4_moe_lite"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("drafters")


_built: dict = {}


def build(kind: str, root) -> dict:
    """Target (path, model, tokenizer, info), the draft option, prompts and mlx-lm's greedy output."""
    if kind in _built:
        return _built[kind]
    d = root / kind
    if kind.startswith("mtp-"):
        family = kind[len("mtp-"):]
        target = mtp_checkpoint(d / "target", family, HYBRID[family] if family.startswith("qwen") else GLM)
        draft = "mtp"
    elif kind.startswith("eagle3-"):
        target = _llama(root, "llama7", num_layers=7)
        draft = str(eagle3_draft(d / "draft", target, "speculators", layer_ids=[0, 3, 6]) if kind.endswith("speculators")
                    else eagle3_draft(d / "draft", target, "authors", draft_vocab=160))
    else:  # a 12-layer target and a 1-layer, 16-wide model with the same tokenizer (< 1/8 of its parameters)
        target = _llama(root, "llama12", num_layers=12)
        draft = str(build_tiny_model(d / "small", "llama", seed=3, hidden_size=16, num_layers=1, heads=2, kv_heads=1))
    model, tok, info = load_model(str(target))
    prompts = [tok.encode(t) for t in TEXTS]
    _built[kind] = {"path": target, "model": model, "tok": tok, "info": info, "draft": draft, "prompts": prompts,
                    "want": [mlx_lm_greedy(target, p, MAX_TOKENS) for p in prompts]}
    return _built[kind]


def _llama(root, name, **kw):
    path = root / name
    if not (path / "config.json").exists():
        build_tiny_model(path, "llama", **kw)
    return path


def engine(c, info=None, **kw):
    opts = dict(max_model_len=256, block_size=4, num_blocks=60, max_num_seqs=4, num_speculative_tokens=3,
                adaptive_speculation=False, draft=c["draft"]) | kw
    return LLMEngine(c["model"], c["tok"], info or c["info"], **opts)


def dense_round0(drafter: FeatureDrafter, model, tokens: list[int], base: int, end: int) -> mx.array:
    """The draft's guess after feeding rows base .. end - 1 with the target's real hidden states, densely."""
    hidden = model.model(mx.array([tokens[:end]]))  # (1, end, D); an EAGLE-3 draft's taps record this forward
    feats = drafter.draft.features(hidden)[:, base:]
    return drafter.draft(mx.array([tokens[base + 1: end + 1]]), feats)[0, -1]


def instrument(e, c, script: bool) -> dict:
    """Check every round 0 of a feature drafter against `dense_round0`; with script, draft the right
    token except at every third output position (accepted and rejected drafts, deterministically)."""
    seen = {"round0": 0}
    d = e.spec_decoder.drafter
    if not isinstance(d, FeatureDrafter):
        return seen
    d.min_joint = 0.0  # a random draft is never sure of anything: draft all k anyway
    run_, propose_ = d._run, d.propose
    state = {"round": 0}

    def propose(seqs, ks):
        state["round"] = 0
        propose_(seqs, ks)

    def run_checked(sts, tokens, feats):
        out = run_(sts, tokens, feats)
        state["round"] += 1
        if state["round"] == 1:
            for i, (st, t) in enumerate(zip(sts, tokens)):
                seq = e.requests[st.request_id]
                end = st.base + st.true_rows + len(t)
                want = dense_round0(d, c["model"], seq.token_ids, st.base, end)
                assert mx.allclose(out[i], want, atol=1e-3, rtol=1e-3).item(), (st.request_id, end)
                seen["round0"] += 1
        return out

    d._run, d.propose = run_checked, propose
    if script:
        cont = {tuple(p): w for p, w in zip(c["prompts"], c["want"])}
        V = c["model"].model.embed_tokens.weight.shape[0]

        def pick(seq, sub, head):
            j = seq.num_output_tokens + len(seq.spec_token_ids)
            w = cont[tuple(seq.prompt_token_ids)]
            t = w[j] if j < len(w) else 0
            return mx.array(t if j % 3 != 2 else (t + 1) % V), None

        d._pick = pick
    return seen


def assert_all_free(e):
    e.step()
    d = e.spec_decoder.drafter
    for pool in (e.block_pool, d.pool):
        assert not [b for b in pool.blocks[1:] if b.ref_cnt] and pool.req_to_blocks == {}
    assert d.states == {} and e.requests == {}


@pytest.mark.parametrize("kind", KINDS + ["mtp-qwen3_5"])
def test_greedy_equals_mlx_lm_batched_with_preemption(root, kind):
    c = build(kind, root)
    e = engine(c, num_blocks=18, max_num_seqs=3)
    assert isinstance(e.spec_decoder.drafter, DraftModelDrafter if kind == "model-on-disk" else FeatureDrafter)
    seen = instrument(e, c, script=True)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    alone = run(e, [(0, c["prompts"][0], params, "alone")])  # then again in the batch: a prefix-cache hit
    assert alone["alone"].token_ids == c["want"][0]
    out = run(e, [(i, p, params, f"r{i}") for i, p in enumerate(c["prompts"])])
    assert e.scheduler.num_preemptions > 0
    for i, want in enumerate(c["want"]):
        assert out[f"r{i}"].token_ids == want, i
    drafted = sum(o.metrics.draft_tokens for o in out.values())
    accepted = sum(o.metrics.accepted_tokens for o in out.values())
    assert drafted > 0
    if kind != "model-on-disk":
        assert 0 < accepted < drafted and seen["round0"] > 10
    if kind.startswith("eagle3"):  # never a compiled verify through tapped layers (the taps would keep tracers)
        assert e.runner.decode_graph is None or not e.runner.decode_graph.verify
    assert_all_free(e)


def test_eagle3_layer_is_the_published_formula(root):
    """EAGLE-3's first layer written out (vLLM's llama_eagle3.py, the speculators' Eagle3DecoderLayer):
    fc over the inputs of the target's layers, hidden_norm, [input_layernorm(embedding), feature]
    into attention, residual from the feature, then the MLP; logits over the draft vocabulary, which
    d2t maps onto the target's."""
    c = build("eagle3-authors-subset", root)
    drafter = engine(c).spec_decoder.drafter
    w = mx.load(str(Path(c["draft"]) / "model.safetensors"))
    cfg = json.loads((Path(c["draft"]) / "config.json").read_text())
    model, tokens = c["model"], c["prompts"][0]
    x = mx.array([tokens])
    layer_inputs, h = [], model.model.embed_tokens(x)
    for layer in model.model.layers:  # the inputs of layers 2, 3, 4 (L = 7: 2, L // 2, L - 3)
        layer_inputs.append(h)
        h = layer(h, mask="causal")

    def rms(v, weight):
        return v * mx.rsqrt((v * v).mean(-1, keepdims=True) + 1e-5) * weight

    def lin(v, name):
        return v @ w[name].T

    aux = mx.concatenate([layer_inputs[2], layer_inputs[3], layer_inputs[4]], axis=-1)[:, :-1]
    feat = lin(aux, "fc.weight")
    e = model.model.embed_tokens(mx.array([tokens[1:]]))
    a = mx.concatenate([rms(e, w["midlayer.input_layernorm.weight"]), rms(feat, w["midlayer.hidden_norm.weight"])], -1)
    H, n, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, L = H // n, a.shape[1]
    q = lin(a, "midlayer.self_attn.q_proj.weight").reshape(1, L, n, hd).transpose(0, 2, 1, 3)
    k = lin(a, "midlayer.self_attn.k_proj.weight").reshape(1, L, kv, hd).transpose(0, 2, 1, 3)
    v = lin(a, "midlayer.self_attn.v_proj.weight").reshape(1, L, kv, hd).transpose(0, 2, 1, 3)
    q, k = mx.fast.rope(q, hd, traditional=False, base=cfg["rope_theta"], scale=1.0, offset=0), \
        mx.fast.rope(k, hd, traditional=False, base=cfg["rope_theta"], scale=1.0, offset=0)
    att = mx.fast.scaled_dot_product_attention(q, k, v, scale=hd ** -0.5, mask="causal")
    att = lin(att.transpose(0, 2, 1, 3).reshape(1, L, -1), "midlayer.self_attn.o_proj.weight")
    r = feat + att
    m = rms(r, w["midlayer.post_attention_layernorm.weight"])
    gate = lin(m, "midlayer.mlp.gate_proj.weight")
    mlp = lin(gate * mx.sigmoid(gate) * lin(m, "midlayer.mlp.up_proj.weight"), "midlayer.mlp.down_proj.weight")
    out = r + mlp
    logits = lin(rms(out, w["norm.weight"]), "lm_head.weight")[0, -1]
    ours = dense_round0(drafter, model, tokens, 0, len(tokens) - 1)
    assert mx.allclose(ours, out[0, -1], atol=1e-3, rtol=1e-3).item()
    assert mx.allclose(drafter.draft.logits(ours), logits, atol=1e-3, rtol=1e-3).item()
    ids = (mx.arange(w["d2t"].shape[0]) + w["d2t"]).tolist()
    assert drafter.draft.vocab.ids.tolist() == ids and ids == sorted(np.flatnonzero(np.array(w["t2d"])).tolist())


def test_qwen_mtp_layer_loads_as_mlx_lm_would(root):
    """The MTP layer's tensors (experts one by one, norms as offsets from 1) go through the same
    transformation mlx-lm's qwen3_next sanitize gives a main layer: the layers compute the same."""
    from mlx.utils import tree_flatten

    c = build("mtp-qwen3_next", root)
    drafter = engine(c).spec_decoder.drafter
    raw = mx.load(str(c["path"] / "model.safetensors"))
    renamed = {k.replace("mtp.layers.0.", "model.layers.1."): v for k, v in raw.items() if k.startswith("mtp.layers.0.")}
    ref = {k[len("model.layers.1."):]: v for k, v in c["model"].sanitize(renamed).items()
           if k.startswith("model.layers.1.")}
    ours = dict(tree_flatten(drafter.draft.body.layers[0].parameters()))
    assert set(ours) == set(ref) and all(mx.array_equal(ours[k], ref[k]).item() for k in ref)
    for name, key in (("norm_embedding", "pre_fc_norm_embedding"), ("norm_hidden", "pre_fc_norm_hidden"), ("norm", "norm")):
        assert mx.allclose(getattr(drafter.draft, name).weight, raw[f"mtp.{key}.weight"] + 1.0).item()


# -- sampling -------------------------------------------------------------------------------------
def _first_two(c, drafter, prompt, sampler):
    """The target's exact distribution over the first two sampled tokens, and whether the draft's
    distribution for the second shares support with it (then both accept and reject paths can run)."""
    model = c["model"]

    def probs(ids):
        return np.array(sampler.probs(model(mx.array([ids]))[0, -1]))

    p = {(): probs(prompt)}
    overlap = False
    for a in np.flatnonzero(p[()]):
        ids = prompt + [int(a)]
        p[(a,)] = probs(ids)
        if isinstance(drafter, FeatureDrafter):
            sub = drafter.draft.logits(dense_round0(drafter, model, ids, 0, len(ids) - 1))
            full = sub if drafter.draft.vocab is None else drafter.draft.vocab.expand(sub)
        else:
            full = drafter.model(mx.array([ids]))[0, -1]
        q = np.array(sampler.probs(full))
        overlap |= bool((q * p[(a,)]).sum() > 0)
    return p, overlap


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_tokens_follow_the_target(root, kind):
    c = build(kind, root)
    e = engine(c, max_model_len=64, num_blocks=700, max_num_seqs=64, num_speculative_tokens=1,
               enable_prefix_cache=False)
    drafter = e.spec_decoder.drafter
    if isinstance(drafter, FeatureDrafter):
        drafter.min_joint = 0.0
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=3))
    # A prompt where the draft's top 3 meets the target's (random weights rarely agree).
    for prompt in [p[:n] for p in c["prompts"] for n in range(len(p), 2, -1)]:
        p, overlap = _first_two(c, drafter, prompt, sampler)
        if overlap:
            break
    assert overlap, "no prompt where the draft and the target share a likely token"
    cells = [(a, b) for a in np.flatnonzero(p[()]) for b in np.flatnonzero(p[(a,)])]
    n = 400
    counts, drafted, accepted = sampled_prefixes(e, prompt, n, width=2, max_tokens=3)
    assert set(counts) <= set(cells)
    observed = np.array([counts.get(cell, 0) for cell in cells], dtype=float)
    expected = np.array([p[()][a] * p[(a,)][b] for a, b in cells]) * n
    assert chi2_pvalue(observed, expected) > 1e-3
    assert drafted > 0 and 0 < accepted < drafted  # both paths ran


# -- what auto picks --------------------------------------------------------------------------------
@pytest.fixture
def env(tmp_path, monkeypatch):
    """An empty HF cache and MACINFER_HOME, and a catalog of our own (monkeypatched path)."""
    hub, home = tmp_path / "hub", tmp_path / "home"
    hub.mkdir()
    home.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("MACINFER_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    catalog = tmp_path / "catalog.json"
    catalog.write_text(json.dumps({"default": "smollm2-135m", "models": {}}))
    monkeypatch.setattr(loader, "CATALOG", catalog)
    return {"hub": hub, "home": home, "catalog": catalog}


def auto(c, info=None, **kw):
    return engine({**c, "draft": "auto"}, info=info or c["info"], adaptive_speculation=True, **kw)


def assert_greedy(e, c):
    """The prompts served together, k adaptive: mlx-lm's tokens."""
    params = SamplingParams(max_tokens=MAX_TOKENS)
    out = run(e, [(i, p, params, f"r{i}") for i, p in enumerate(c["prompts"])])
    assert [out[f"r{i}"].token_ids for i in range(len(c["prompts"]))] == c["want"]


def engine_info(c, **changes):
    return dataclasses.replace(c["info"], **changes)


@pytest.mark.parametrize("kind", ["mtp-qwen3_next", "mtp-qwen3_5", "mtp-glm4_moe_lite"])
def test_auto_picks_the_checkpoints_mtp_layers(root, env, kind):
    e = auto(build(kind, root))
    assert e.draft_choice.kind == "mtp" and "MTP" in e.draft_choice.reason
    assert isinstance(e.spec_decoder.drafter, LookupDrafter) and isinstance(e.spec_decoder.drafter.model, FeatureDrafter)
    assert e.features.drafter == "mtp+ngram" and "draft: mtp (the checkpoint's own MTP layers)" in e.describe()
    assert_greedy(e, build(kind, root))


def test_mtp_weights_missing_where_the_config_promises_them(root, env, capfd):
    target = mtp_checkpoint(root / "no-mtp", "qwen3_next", HYBRID["qwen3_next"], with_mtp=False)
    model, tok, info = load_model(str(target))
    c = {"model": model, "tok": tok, "info": info, "draft": "mtp"}
    with pytest.raises(MacinferError, match="promises 1 MTP layer") as err:  # named explicitly: an error
        engine(c)
    assert "\n" not in str(err.value)
    e = auto(c)  # auto: one line, and lookup instead
    lines = [x for x in capfd.readouterr().err.splitlines() if "MTP" in x]
    assert len(lines) == 1 and "drafting without them" in lines[0]
    assert e.draft_choice.kind == "ngram" and isinstance(e.spec_decoder.drafter, NgramDrafter)


def _catalog(env, name, source, drafts):
    env["catalog"].write_text(json.dumps({"default": "smollm2-135m", "models": {
        name: {"source": source, "description": "a tiny test model", "drafts": drafts}}}))


def test_auto_picks_a_catalog_eagle3_draft_on_disk(root, env, tiny_models, capfd):
    c = build("eagle3-speculators", root)
    info = engine_info(c, name="tiny-llama7")
    _catalog(env, "tiny-llama7", "tiny/llama7", ["tiny/llama7-eagle3", "tiny/elsewhere"])
    e = auto(c, info)
    assert e.draft_choice.kind == "ngram"  # listed, not on disk: nothing downloads
    add_hf_repo(env["hub"], "tiny/llama7-eagle3", Path(c["draft"]))
    e = auto(c, info)
    assert e.draft_choice.kind == "eagle3" and e.draft_choice.name == "tiny/llama7-eagle3"
    assert e.features.drafter == "tiny/llama7-eagle3+ngram"
    assert_greedy(e, c)
    # A draft for another model: made for a 96-wide target, or for another 64-wide one (its copy of
    # the embedding differs). Skipped in one line each; named explicitly, refused.
    other = _llama(root, "llama7-other", num_layers=7, seed=9)
    wide = tiny_models("llama", hidden_size=96)
    for n, (tgt, says) in enumerate(((wide, "96-wide"), (other, "made for another model"))):
        bad = eagle3_draft(root / f"bad-eagle3-{n}", tgt, "speculators", layer_ids=[0, 1, 2] if n == 0 else [0, 3, 6])
        shutil.rmtree(env["hub"], ignore_errors=True)
        env["hub"].mkdir()
        add_hf_repo(env["hub"], "tiny/llama7-eagle3", bad)
        capfd.readouterr()
        e = auto(c, info)
        lines = [x for x in capfd.readouterr().err.splitlines() if "note:" in x]
        assert e.draft_choice.kind == "ngram" and len(lines) == 1 and says in lines[0], lines
        with pytest.raises(MacinferError, match=says):
            engine({**c, "draft": str(bad)})


def test_an_eagle3_draft_that_fails_to_load_leaves_the_target_untapped(root):
    """EAGLE-3 taps retype the target's layers for good; a draft refused for its weights (one missing,
    one a llama layer does not have) must not leave them tapped."""
    from macinfer.spec_decode.eagle3 import load_eagle3

    c = build("eagle3-speculators", root)
    model, _, _ = load_model(str(c["path"]))  # a target of its own: the engines of other tests tap theirs
    before = [type(layer) for layer in model.model.layers]
    for n, edit in enumerate((lambda w: w.pop(next(k for k in w if k.endswith("o_proj.weight"))),
                              lambda w: w.__setitem__("layers.0.self_attn.q_norm.weight", mx.ones((8,))))):
        bad = Path(shutil.copytree(c["draft"], root / f"eagle3-weights-{n}"))
        w = dict(mx.load(str(bad / "model.safetensors")))
        edit(w)
        mx.save_safetensors(str(bad / "model.safetensors"), w, metadata={"format": "pt"})
        with pytest.raises(MacinferError, match="incomplete" if n == 0 else "not supported"):
            load_eagle3(bad, model)
        assert [type(layer) for layer in model.model.layers] == before
    draft = load_eagle3(Path(c["draft"]), model)  # one that loads taps the layers it reads
    assert [i for i, layer in enumerate(model.model.layers) if type(layer) is not before[i]] == [0, 3, 6]
    assert draft.features(model.model(mx.array([[1, 2, 3]]))).shape == (1, 3, draft.fc.weight.shape[0])


def test_auto_picks_a_smaller_model_with_the_same_tokenizer(root, env):
    c = build("model-on-disk", root)
    small = Path(c["draft"])
    e = auto(c)
    assert e.draft_choice.kind == "ngram"  # nothing in MACINFER_HOME yet
    # Decoys: the same tokenizer but over 1/8 of the target's parameters; a small model whose
    # vocabulary differs by two swapped tokens.
    build_tiny_model(env["home"] / "too-big", "llama", seed=4, num_layers=2)
    swapped = shutil.copytree(small, env["home"] / "swapped")
    tj = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = sorted(k for k in vocab if len(k) > 1)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tj))
    assert auto(c).draft_choice.kind == "ngram"
    shutil.copytree(small, env["home"] / "small-draft")
    e = auto(c)
    assert e.draft_choice.kind == "model" and e.draft_choice.name == "small-draft"
    assert isinstance(e.spec_decoder.drafter.model, DraftModelDrafter) and e.features.drafter == "small-draft+ngram"
    assert_greedy(e, c)


def test_auto_where_nothing_pays_or_nothing_is_found(root, env, tiny_models):
    c = build("eagle3-speculators", root)
    e = auto(c)  # no MTP, nothing listed, nothing on disk: lookup alone
    assert e.draft_choice.kind == "ngram" and isinstance(e.spec_decoder.drafter, NgramDrafter)
    import mlx.core as mxc

    if not mxc.metal.is_available():  # a quantised target on MLX's CPU backend: verifying k drafts costs k steps
        e = auto(c, engine_info(c, quantization="4-bit g64"))
        assert e.spec_decoder is None and e.draft_choice.kind == "none" and e.features.drafter is None
        assert "draft: none (quantised weights without Metal" in e.describe()


def test_pull_with_draft_then_auto_uses_it(root, env, monkeypatch):
    """`pull MODEL --with-draft` fetches the catalog's drafts (a fake hub: nothing leaves the machine),
    and `auto` then picks the EAGLE-3 draft; a named draft that does not load is exit 1, one line."""
    import fnmatch

    import huggingface_hub
    from click.testing import CliRunner

    from macinfer.cli.main import main

    c = build("eagle3-speculators", root)
    remote = {"tiny/llama7": c["path"], "tiny/llama7-eagle3": Path(c["draft"])}

    class File:
        def __init__(self, name):
            self.filename = name

    def snapshot_download(repo_id, *, allow_patterns=None, cache_dir=None, dry_run=False, **kw):
        files = [f.name for f in remote[repo_id].iterdir()
                 if not allow_patterns or any(fnmatch.fnmatch(f.name, p) for p in allow_patterns)]
        if dry_run:
            return [File(n) for n in files]
        return str(add_hf_repo(Path(cache_dir), repo_id, remote[repo_id], allow_patterns))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    _catalog(env, "tiny-llama7", "tiny/llama7", ["tiny/llama7-eagle3"])
    r = CliRunner().invoke(main, ["pull", "tiny-llama7", "--with-draft"])
    assert r.exit_code == 0, r.output
    assert "pulled draft tiny/llama7-eagle3" in r.output
    assert auto(c, engine_info(c, name="tiny-llama7")).draft_choice.kind == "eagle3"
    shown = json.loads(CliRunner().invoke(main, ["show", "tiny-llama7", "--json", "--no-probe"]).output)
    assert shown["auto_draft"] == "tiny/llama7-eagle3 (on disk) with n-gram lookup"
    no_mtp = mtp_checkpoint(root / "no-mtp-cli", "qwen3_next", HYBRID["qwen3_next"], with_mtp=False)
    r = CliRunner().invoke(main, ["run", str(no_mtp), "hello", "--no-chat-template", "-n", "2", "--draft", "mtp"])
    assert r.exit_code == 1 and "promises 1 MTP layer" in r.output and len(r.output.strip().splitlines()) == 1


def test_the_server_says_which_drafter_each_loaded_model_uses(root, env):
    """GET /v1/models through the openai client: a loaded model's card names its drafter, and the
    greedy completion is still the model's own."""
    import openai

    from macinfer.llm import LLM
    from macinfer.serve.model_pool import PoolOptions
    from macinfer.serve.server import create_app, serve_in_thread

    c = build("mtp-qwen3_next", root)
    other = build("eagle3-speculators", root)
    app = create_app(LLM(str(c["path"]), num_blocks=60, draft="auto"), model_name="qwen-mtp",
                     models=PoolOptions(others={"llama7": str(other["path"])},
                                        load=lambda spec: LLM(spec, num_blocks=60)))
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        cards = {m.id: m.model_extra for m in client.models.list().data}
        assert cards["qwen-mtp"]["draft"] == "mtp+ngram" and "draft" not in cards["llama7"]  # not loaded yet
        r = client.completions.create(model="qwen-mtp", prompt=TEXTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == c["want"][0]


def test_show_says_what_auto_picks_where_weights_stay_quantised(root, env, monkeypatch):
    """`macinfer show`'s line follows auto's rule: a model that loads quantised on MLX's CPU backend
    (too large for float32) drafts nothing; one that loads as float32 gets lookup at least."""
    from types import SimpleNamespace

    from macinfer.spec_decode import auto_draft

    monkeypatch.setattr(auto_draft.mx.metal, "is_available", lambda: False)
    m = SimpleNamespace(config={}, path=None, catalog_name=None, name="some-model", quantization="4-bit",
                        num_params=70_000_000_000)
    assert auto_draft.describe_auto(m).startswith("none (quantised weights without Metal")
    assert auto_draft.describe_auto(SimpleNamespace(**{**vars(m), "num_params": 1_000_000})).startswith("n-gram")
    assert auto_draft.describe_auto(SimpleNamespace(**{**vars(m), "quantization": None})).startswith("n-gram")
