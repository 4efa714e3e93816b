"""`macinfer run`: greedy output equals mlx-lm's, seeded sampling repeats, bad input is one line."""

import json

import pytest
from click.testing import CliRunner
from oracle import mlx_lm_greedy, mlx_lm_load

from macinfer.cli.main import main

PROMPT = "Paged attention stores the key value cache"


def run(*args, input=None):
    result = CliRunner().invoke(main, ["run", *map(str, args)], input=input)
    return result


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_matches_mlx_lm(tiny_models, arch):
    path = tiny_models(arch)
    r = run(path, PROMPT, "--json", "--no-chat-template", "-n", 24, "--peak-bandwidth", 100)
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout.strip().splitlines()[-1])
    _, tok = mlx_lm_load(str(path))
    want = mlx_lm_greedy(path, tok.encode(PROMPT), 24)
    assert got["token_ids"] == want
    assert got["generation_tokens"] == len(want)
    assert got["prompt_tokens"] == len(tok.encode(PROMPT))


def test_chat_template_and_system_prompt(tiny_models):
    path = tiny_models("llama")
    r = run(path, "What is the capital of France?", "--system", "Be brief.", "--json", "-n", 10, "--peak-bandwidth", 100)
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout.strip().splitlines()[-1])
    _, tok = mlx_lm_load(str(path))
    ids = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    assert got["prompt_tokens"] == len(ids)
    assert got["token_ids"] == mlx_lm_greedy(path, ids, 10)


def test_stats_line_and_streamed_text(tiny_models):
    path = tiny_models("qwen2")
    # No prefix cache: another test may have cached this prompt ("prompt cached" then, no prefill rate).
    r = run(path, PROMPT, "-n", 8, "--no-chat-template", "--peak-bandwidth", 100, "--no-prefix-cache")
    assert r.exit_code == 0, r.output
    line = r.stderr.strip().splitlines()[-1]
    for field in ("prompt", "TTFT", "prefill", "generated", "decode", "peak mem", "bandwidth"):
        assert field in line
    assert "of 100.0 GB/s (flag)" in line


def test_stats_line_splits_drafts_by_drafter():
    from macinfer.cli.main import stats_line

    s = {"prompt_tokens": 9, "cached_tokens": 0, "ttft_s": 0.1, "prefill_tps": 90.0, "prompt_cached": False,
         "generation_tokens": 40, "decode_tps": 12.0, "peak_memory_bytes": 2**20, "bandwidth_utilisation": None,
         "draft_tokens": 30,
         "accepted_tokens": 21, "acceptance_rate": 0.7, "accepted_per_step": 1.5,
         "lookup_draft_tokens": 20, "lookup_accepted_tokens": 18}
    assert stats_line(s).endswith("draft acceptance 70% (1.50 accepted/step; lookup 18/20, model 3/10)")
    s.update(lookup_draft_tokens=0, lookup_accepted_tokens=0)  # one drafter: no split
    assert stats_line(s).endswith("draft acceptance 70% (1.50 accepted/step)")


def test_bandwidth_figure_is_bytes_times_rate_over_peak(tiny_models):
    from macinfer.modelio.loader import load_model

    path = tiny_models("llama")
    r = run(path, PROMPT, "--json", "-n", 16, "--no-chat-template", "--peak-bandwidth", 50)
    s = json.loads(r.stdout.strip().splitlines()[-1])
    _, _, info = load_model(str(path))
    # weights read per step (tied embeddings: all of them) + KV of the mean context.
    kv = info.kv_bytes_per_token * (s["prompt_tokens"] + (s["generation_tokens"] - 1) / 2 + 0.5 - 1)
    assert s["bytes_per_decode_step"] == pytest.approx(info.weight_bytes + kv, rel=0.02)
    assert s["bandwidth_utilisation"] == pytest.approx(s["bytes_per_decode_step"] * s["decode_tps"] / 50e9, rel=1e-6)


def test_bandwidth_counts_forwards_not_accepted_drafts():
    """A verify forward reads the weights once for its token and every draft it accepts: with
    40 tokens decoded in 30 forwards (10 accepted drafts), bandwidth is bytes x 30/s, not x 40/s."""
    from types import SimpleNamespace

    from macinfer.perf.bandwidth import PeakBandwidth
    from macinfer.cli.main import run_stats
    from macinfer.core.metrics import RequestMetrics

    def stats(accepted):
        m = RequestMetrics(arrival_time=0.0, first_token_time=1.0, finish_time=2.0, prompt_tokens=8,
                           generation_tokens=41, draft_tokens=20, accepted_tokens=accepted, spec_steps=10,
                           kv_tokens_sum=400, decode_steps=40)
        info = SimpleNamespace(bytes_per_decode_step=1e9, kv_bytes_per_token=0.0)
        return run_stats(SimpleNamespace(metrics=m, finish_reason="length"), info, PeakBandwidth(100.0, "flag"))

    s = stats(accepted=10)
    assert s["decode_tps"] == pytest.approx(40.0)
    assert s["bandwidth_utilisation"] == pytest.approx(1e9 * 30 / 100e9)
    assert stats(accepted=0)["bandwidth_utilisation"] == pytest.approx(1e9 * 40 / 100e9)


def test_seeded_sampling_is_reproducible(tiny_models):
    path = tiny_models("llama")
    args = (path, PROMPT, "--json", "-n", 16, "--temp", 1.0, "--top-p", 0.95, "--peak-bandwidth", 100)
    a = json.loads(run(*args, "--seed", 7).stdout.strip().splitlines()[-1])["token_ids"]
    b = json.loads(run(*args, "--seed", 7).stdout.strip().splitlines()[-1])["token_ids"]
    c = json.loads(run(*args, "--seed", 8).stdout.strip().splitlines()[-1])["token_ids"]
    assert a == b
    assert a != c


@pytest.mark.parametrize(
    "args, message",
    [
        (["/nonexistent/model", "hi"], "no such model"),
        (["{tiny}", ""], "prompt is empty"),
        (["{tiny}", "hi", "--temp", "-1"], "temperature must be a number from 0 to 2"),
        (["{tiny}", "hi", "--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["{tiny}", "hi", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["{tiny}", "hi", "--max-tokens", "0"], "max_tokens must be"),
        (["{tiny}", "hi", "--repetition-penalty", "0"], "repetition_penalty must be a number > 0"),
        (["{tiny}", "word " * 600], "holds at most 512"),
        (["{nocfg}", "hi"], "no config.json"),
        (["{noweights}", "hi"], "no *.safetensors"),
        (["{corrupt}", "hi"], "could not load the weights"),
        (["{unknown}", "hi"], "unknown architecture"),
        (["{badjson}", "hi"], "config.json is not valid JSON (Expecting"),
        (["{notobject}", "hi"], "config.json holds a JSON list, not an object"),
        (["{badvalue}", "hi"], "config.json does not describe a valid llama model"),
        (["{badtemplate}", "hi"], "chat template failed on these messages (no system messages here)"),
        (["{typotemplate}", "hi"], "chat template failed on these messages"),
        (["{tiny}", "hi", "--draft", "/nonexistent/draft+ngram"], "no such model '/nonexistent/draft'"),
        (["{tiny}", "hi", "--draft", "+ngram"], "no such model '+ngram'"),
    ],
)
def test_bad_input_is_one_line(tiny_models, tmp_path, args, message):
    import shutil

    tiny = tiny_models("llama")
    dirs = {}
    for name in ("nocfg", "noweights", "corrupt", "unknown", "badjson", "notobject", "badvalue", "badtemplate",
                 "typotemplate"):
        d = tmp_path / name
        shutil.copytree(tiny, d)
        dirs[name] = d
    (dirs["badjson"] / "config.json").write_text('{"model_type": "llama",')
    (dirs["notobject"] / "config.json").write_text("[1, 2]")
    cfg = json.loads((tiny / "config.json").read_text())
    (dirs["badvalue"] / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 0}))
    for name, template in (("badtemplate", "{{ raise_exception('no system messages here') }}"),
                           ("typotemplate", "{{ messages[0]['content'] + 1 }}")):
        tc = json.loads((tiny / "tokenizer_config.json").read_text())
        (dirs[name] / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": template}))
    (dirs["nocfg"] / "config.json").unlink()
    (dirs["noweights"] / "model.safetensors").unlink()
    data = (dirs["corrupt"] / "model.safetensors").read_bytes()
    (dirs["corrupt"] / "model.safetensors").write_bytes(data[: len(data) // 2])
    cfg = json.loads((dirs["unknown"] / "config.json").read_text())
    cfg["model_type"] = "no_such_arch"
    (dirs["unknown"] / "config.json").write_text(json.dumps(cfg))
    args = [a.format(tiny=tiny, **dirs) for a in args]
    r = run(*args)
    assert r.exit_code != 0
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert message in err
    assert "Traceback" not in r.output


@pytest.mark.slow
def test_embedded_model_answers_paris_like_mlx_lm():
    """The embedded SmolLM2 end to end: `macinfer run` equals mlx-lm's greedy tokens and names Paris."""
    from mlx_lm.generate import stream_generate

    from macinfer.modelio.loader import load_model

    r = run("What is the capital of France?", "--json", "-n", 8, "--peak-bandwidth", 100)
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert "Paris" in got["text"]
    # mlx-lm's own generation loop on the same weights (loaded and cast to float32 by macinfer).
    model, tok, _ = load_model(None)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True)
    want = []
    for resp in stream_generate(model, tok, ids, max_tokens=8):
        if resp.finish_reason == "stop":
            break
        want.append(resp.token)
    assert got["token_ids"] == want


def test_quantized_weights_load_as_float_by_default_without_metal(tiny_models, tmp_path):
    """Without Metal the fast configuration is float32 (docs/platform.md): quantised weights are
    dequantised unless --keep-quantized; kept quantised, the output is mlx-lm's own."""
    import mlx.core as mx

    from macinfer.modelio.loader import dequantize_by_default, load_model
    from macinfer.modelio.quant_config import QuantConfig
    from macinfer.modelio.quantize import quantize

    q = tmp_path / "q4"
    quantize(str(tiny_models("llama")), q, QuantConfig(bits=4, group_size=32))
    if mx.metal.is_available():
        pytest.skip("Metal host: quantised weights stay quantised")
    model, _, info = load_model(str(q))
    assert not any(hasattr(m, "bits") for _, m in model.named_modules())
    assert info.quantization != info.extra["dequantized_from"].split(" ")[0] and "4-bit" in info.extra["dequantized_from"]
    kept, _, kept_info = load_model(str(q), dequantize=False)
    assert any(hasattr(m, "bits") for _, m in kept.named_modules()) and "dequantized_from" not in kept_info.extra
    assert not dequantize_by_default(10**10, True) and not dequantize_by_default(10**6, False)

    r = run(q, PROMPT, "-v", "--no-chat-template", "-n", 6, "--peak-bandwidth", 100)
    assert r.exit_code == 0 and "weights dequantised from 4-bit" in r.stderr
    r = run(q, PROMPT, "--json", "--keep-quantized", "--no-chat-template", "-n", 12, "--peak-bandwidth", 100)
    assert r.exit_code == 0, r.output
    _, tok = mlx_lm_load(str(q))
    assert json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] == mlx_lm_greedy(q, tok.encode(PROMPT), 12)
