"""The last-resort engine (mlx-lm's BatchGenerator behind LLMEngine's API), engine selection,
load errors as one line, and the architecture census (scripts/arch_census.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from oracle import mlx_lm_greedy, mlx_lm_load
from tiny import build_from_config

import unpageable

from macinfer.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = json.loads((ROOT / "tests" / "arch_configs.json").read_text())["configs"]
# A model the paged engine refuses and mlx-lm batches exactly (two sdpa calls per layer: tests/unpageable.py).
UNSUPPORTED = unpageable.NAME
PROMPTS = ["The quick brown fox", "Paged attention stores the key value cache in fixed size blocks. Continuous",
           "What is", "Once upon a time there was a little model that wanted to run on a Mac."]


@pytest.fixture(scope="module")
def unsupported(tiny_models, tmp_path_factory):
    return unpageable.build(tiny_models("llama"), tmp_path_factory.mktemp("unsupported") / UNSUPPORTED)


def greedy(path, ids, n):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model, _ = mlx_lm_load(str(path))
    return [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]


def staggered(engine, prompts, params):
    """Request i arrives at step 2i; returns each request's RequestOutput."""
    rids, outs, step = [], {}, 0
    while len(rids) < len(prompts) or engine.has_unfinished():
        if len(rids) < len(prompts) and step == 2 * len(rids):
            rids.append(engine.add_request(prompts[len(rids)], params[len(rids)]))
        for d in engine.step():
            if d.output is not None:
                outs[d.request_id] = d.output
        step += 1
    return [outs[r] for r in rids]


def test_dense_engine_staggered_batch_matches_mlx_lm(tiny_models):
    from macinfer.core.sampling import SamplingParams
    from macinfer.llm import LLM

    path = tiny_models("llama")
    llm = LLM(str(path), engine="mlx-lm", max_num_seqs=4, max_num_batched_tokens=8)
    assert llm.engine_kind == "mlx-lm" and "BatchGenerator" in llm.engine.describe()
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    n = [12, 7, 10, 9]
    outs = staggered(llm.engine, ids, [SamplingParams(max_tokens=k, ignore_eos=True) for k in n])
    for out, i, k in zip(outs, ids, n):
        assert out.token_ids == greedy(path, i, k)
        assert out.finish_reason == "length" and out.metrics.ttft > 0 and out.metrics.generation_tokens == k
    stats = llm.engine.kv_stats()
    assert stats["running"] == stats["waiting"] == 0 and stats["used_blocks"] is None
    assert not llm.engine.requests

    # Stops are LLMEngine's: a stop token ends it (not in the output), a stop string cuts the text.
    ref = outs[0].token_ids
    out = llm.generate(ids[0], SamplingParams(max_tokens=12, stop_token_ids=[ref[4]]))[0]
    assert out.token_ids == ref[:ref.index(ref[4])] and out.finish_reason == "stop"
    text = llm.tokenizer.decode(ref)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    out = llm.generate(ids[0], SamplingParams(max_tokens=12, stop=[stop], ignore_eos=True))[0]
    assert out.text == text[:text.index(stop)] and out.finish_reason == "stop"

    # Seeded sampling repeats, alone or batched with others; abort frees the request.
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    alone = llm.generate(ids[1], sampled)[0].token_ids
    batched = llm.generate([ids[1], ids[3]], [sampled, SamplingParams(temperature=1.0, max_tokens=6)])[0].token_ids
    assert alone == batched
    rid = llm.engine.add_request(ids[2], SamplingParams(max_tokens=50))
    llm.engine.step()
    llm.engine.abort_request(rid)
    finals = [d for d in llm.engine.step() if d.output is not None]
    assert [d.output.finish_reason for d in finals] == ["abort"] and not llm.engine.has_unfinished()


def run(*args):
    return CliRunner().invoke(main, ["run", *map(str, args)])


def test_run_engine_mlx_lm_matches_mlx_lm(tiny_models):
    path = tiny_models("llama")
    r = run(path, PROMPTS[1], "--engine", "mlx-lm", "--json", "--no-chat-template", "-n", 16, "--peak-bandwidth", 100)
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout.strip().splitlines()[-1])
    _, tok = mlx_lm_load(str(path))
    assert got["token_ids"] == mlx_lm_greedy(path, tok.encode(PROMPTS[1]), 16)


def test_auto_falls_back_with_one_line_and_paged_refuses(unsupported):
    r = run(unsupported, "The quick", "--no-chat-template", "-n", 6, "--json", "--peak-bandwidth", 100)
    assert r.exit_code == 0, r.output
    notes = [line for line in r.stderr.splitlines() if "BatchGenerator" in line]
    assert len(notes) == 1
    assert "without paging, prefix cache, speculation, quantised KV" in notes[0] and UNSUPPORTED in notes[0]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    _, tok = mlx_lm_load(str(unsupported))
    assert got["token_ids"] == mlx_lm_greedy(unsupported, tok.encode("The quick"), 6)

    r = run(unsupported, "The quick", "--engine", "paged", "-n", 4)
    assert r.exit_code == 1
    assert r.output.strip().splitlines() == [r.output.strip()] and r.output.startswith(f"Error: {UNSUPPORTED}: ")


def test_unknown_architecture_and_mismatched_weights_are_one_line(tiny_models, tmp_path):
    import shutil

    src = tiny_models("llama")
    for name, change, words in (("nosuch", {"model_type": "nosucharch"}, "unknown architecture"),
                                ("wrongsize", {"hidden_size": 128}, "could not load the weights"),
                                ("fewer", {"num_hidden_layers": 3}, "Missing")):
        path = tmp_path / name
        shutil.copytree(src, path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **change}))
        r = run(path, "hi", "-n", 2)
        assert r.exit_code == 1, r.output
        line = r.output.strip()
        assert "\n" not in line and line.startswith(f"Error: {name}: ") and words in line, line


def census(*args):
    r = subprocess.run([sys.executable, "scripts/arch_census.py", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return [" ".join(line.split()) for line in r.stdout.strip().splitlines()]


def test_census_verdicts():
    lines = census("--only", "llama,minimax_m3_vl,nosucharch", "--jobs", "2")
    assert lines[:3] == ["llama identical (paged)", "minimax_m3_vl identical (paged)",
                         "nosucharch skipped: no configuration in mlx-lm's tests/test_models.py"]
    assert lines[3].startswith("3 model types: 2 identical (paged), 0 identical (fallback), 0 mismatch, 0 refused, "
                               "0 error, 1 skipped")
    # On mlx-lm's BatchGenerator: llama batches exactly; minimax_m3_vl's sparse layers do not (left padding).
    lines = census("--only", "llama,minimax_m3_vl", "--engine", "mlx-lm", "--jobs", "2")
    assert lines[0] == "llama identical (fallback: --engine mlx-lm)"
    assert lines[1].startswith("minimax_m3_vl mismatch (fallback: request ") and \
        lines[1].endswith("mlx-lm's BatchGenerator alone differs too)")


def test_a_model_whose_attention_is_its_own_code_takes_turns_on_the_fallback(tmp_path):
    """phi3small's block-sparse layers compute attention in their own code and line mlx-lm's batch
    mask up with their kv heads (an error with 3 rows; with 2, each row's mask lands on a kv head of both): the fallback
    serves its requests one at a time, each as mlx-lm's BatchGenerator runs that request alone."""
    from mlx_lm.generate import BatchGenerator

    from macinfer.core.sampling import SamplingParams
    from macinfer.llm import LLM

    path = build_from_config(tmp_path / "phi3small", CONFIGS["phi3small"])
    llm = LLM(str(path), max_num_seqs=4, max_num_batched_tokens=8)
    assert llm.engine_kind == "mlx-lm" and llm.engine.serial
    assert llm.engine.config.max_num_seqs == 1  # what the server's queue limit counts as running
    assert "one request at a time" in llm.engine.describe()
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = staggered(llm.engine, ids, [SamplingParams(max_tokens=6, ignore_eos=True)] * len(ids))
    for out, prompt in zip(outs, ids):
        gen = BatchGenerator(llm.model, max_tokens=6, completion_batch_size=1, prefill_batch_size=1,
                             prefill_step_size=8)
        (uid,) = gen.insert([prompt])
        alone = []
        while len(alone) < 6:
            alone += [int(r.token) for r in gen.next()[1] if r.uid == uid]
        gen.close()
        assert out.token_ids == alone


def test_serve_runs_the_fallback_engine(unsupported):
    """The OpenAI server over DenseEngine: concurrent completions, each its solo greedy output."""
    import asyncio

    import openai

    from macinfer.llm import LLM
    from macinfer.serve.server import create_app, serve_in_thread

    llm = LLM(str(unsupported))
    assert llm.engine_kind == "mlx-lm"
    _, tok = mlx_lm_load(str(unsupported))

    async def one(c, prompt):
        r = await c.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0,
                                       extra_body={"return_token_ids": True})
        return r.choices[0].model_extra["token_ids"]

    async def all_of(url):
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        return await asyncio.gather(*(one(c, p) for p in PROMPTS[:3]))

    with serve_in_thread(create_app(llm, model_name="m")) as url:
        got = asyncio.run(all_of(url))
        metrics = __import__("httpx2").get(url + "/metrics").text
    for p, ids in zip(PROMPTS[:3], got):
        assert ids == mlx_lm_greedy(unsupported, tok.encode(p), 6)
    assert "macinfer_requests_running" in metrics and "macinfer_kv_blocks_total" not in metrics


def test_looped_model_prefill_keeps_every_position(tmp_path):
    """nanbeige runs its layer stack twice, each loop ending with the final norm: picking each row's
    last position inside that norm (the prefill shortcut) broke the second loop (token 0 differed)."""
    from macinfer.core.sampling import SamplingParams
    from macinfer.llm import LLM

    path = build_from_config(tmp_path / "nanbeige", CONFIGS["nanbeige"])
    llm = LLM(str(path), engine="paged", max_num_seqs=4, max_num_batched_tokens=8, kv_memory="64MiB")
    assert llm.engine.runner.pick_last_rows is False
    _, tok = mlx_lm_load(str(path))
    prompts = [tok.encode(p) for p in PROMPTS]
    outs = staggered(llm.engine, prompts, [SamplingParams(max_tokens=6, ignore_eos=True)] * len(prompts))
    assert [o.token_ids for o in outs] == [greedy(path, p, 6) for p in prompts]


def test_phixtral_vocabulary_covers_the_tokenizer(tmp_path):
    """phixtral sizes its embedding by num_vocab (mlx-lm's test config: 256, below the tiny tokenizer's
    320): ids past it were an out-of-range gather, so mlx-lm's own output was whatever memory held."""
    from macinfer.core.sampling import SamplingParams
    from macinfer.llm import LLM

    with pytest.raises(ValueError, match="num_vocab 256 < the tokenizer's"):
        build_from_config(tmp_path / "small", {**CONFIGS["phixtral"], "num_vocab": 256})
    path = build_from_config(tmp_path / "phixtral", CONFIGS["phixtral"])
    llm = LLM(str(path), engine="paged", max_num_seqs=4, max_num_batched_tokens=8, kv_memory="64MiB")
    _, tok = mlx_lm_load(str(path))
    prompts = [tok.encode(p) for p in PROMPTS]
    assert max(max(p) for p in prompts) >= 256  # the ids that fell outside the old embedding
    outs = staggered(llm.engine, prompts, [SamplingParams(max_tokens=6, ignore_eos=True)] * len(prompts))
    assert [o.token_ids for o in outs] == [greedy(path, p, 6) for p in prompts]
