"""`macinfer bench`: the statistics, the prompts, and the CLI in-process, over HTTP and vs mlx-lm."""

import json

import pytest
from click.testing import CliRunner

from macinfer.perf import bench
from macinfer.cli.main import main


def test_summary_percentiles_and_throughput():
    sc = bench.Scenario(concurrency=4, prompt_tokens=10, prefix="unique", max_tokens=11)
    # TTFT 0.1..0.4 s; each request decodes 10 tokens after the first in 1, 2, 4, 5 s.
    reqs = [bench.RequestResult(10, 11, ttft, ttft + d) for ttft, d in ((0.1, 1), (0.2, 2), (0.3, 4), (0.4, 5))]
    s = bench.ScenarioResult(sc, wall=5.4, requests=reqs).summary()
    assert s["requests"] == 4 and s["output_tokens"] == 44
    assert s["throughput_tps"] == pytest.approx(44 / 5.4)
    assert s["ttft_p50_s"] == pytest.approx(0.25)
    assert s["ttft_p99_s"] == pytest.approx(0.397)
    # decode rates 10, 5, 2.5, 2 tok/s: p50 is the median, p95 the slow tail (5th percentile).
    assert s["decode_tps_p50"] == pytest.approx(3.75)
    assert s["decode_tps_p95"] == pytest.approx(2.075)
    assert s["tpot_p50_ms"] == pytest.approx(300.0)


def test_repeats_report_the_median_run_and_the_median_of_paired_ratios():
    def summary(tps, ttft):
        return {"concurrency": 16, "prompt_tokens": 64, "prefix": "unique", "throughput_tps": tps,
                "decode_tps_p50": tps / 16, "ttft_p50_s": ttft}

    ours = bench.median_summary([summary(100, 0.2), summary(300, 0.1), summary(200, 0.4)])
    base = bench.median_summary([summary(50, 0.4), summary(150, 0.3), summary(400, 0.2)])
    assert ours["throughput_tps"] == 200 and len(ours["repeats"]) == 3  # the median run, all kept
    (row,) = bench.ratios([ours], [base])
    # Paired per repeat: 100/50, 300/150, 200/400 -> median 2.0 (the ratio of medians would be 200/150).
    assert row["throughput_x"] == pytest.approx(2.0) and row["repeats"] == 3
    assert row["ttft_p50_speedup"] == pytest.approx(2.0)  # 0.4/0.2, 0.3/0.1, 0.2/0.4
    assert bench.median_summary([summary(1, 1)]) == summary(1, 1)  # one run: as it was


def test_token_prompts_have_exact_lengths_and_shared_prefixes(tiny_models):
    from oracle import mlx_lm_load

    _, tok = mlx_lm_load(str(tiny_models("llama")))
    shared = bench.make_token_prompts(bench.Scenario(3, 100, "shared", 4), 0, tok)
    unique = bench.make_token_prompts(bench.Scenario(3, 100, "unique", 4), 0, tok)
    assert [len(p) for p in shared + unique] == [100] * 6
    assert shared[0][:84] == shared[1][:84] == shared[2][:84] and shared[0] != shared[1]
    assert unique[0][:20] != unique[1][:20]


def test_cli_in_process_with_mlx_lm_comparison_json_and_plot(tiny_models, tmp_path):
    png = tmp_path / "bench.png"
    r = CliRunner().invoke(main, ["bench", str(tiny_models("llama")), "-c", "1,4", "-p", "8,64", "-n", "6",
                                  "--compare", "mlx-lm", "--json", "--plot", str(png)])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert [(s["concurrency"], s["prompt_tokens"]) for s in out["scenarios"]] == [(1, 8), (4, 8), (1, 64), (4, 64)]
    for s in out["scenarios"] + out["baseline"]:
        assert s["output_tokens"] == 6 * s["requests"] and s["requests"] == s["concurrency"]
        assert s["mean_prompt_tokens"] == s["prompt_tokens"]
        assert s["throughput_tps"] > 0 and s["ttft_p50_s"] > 0 and s["decode_tps_p50"] > 0
    assert [b["label"] for b in out["baseline"]] == ["mlx-lm"] * 4
    assert len(out["ratios"]) == 4 and all(x["throughput_x"] > 0 for x in out["ratios"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_repeats_alternate_with_the_baseline_on_fresh_prompts(tiny_models):
    r = CliRunner().invoke(main, ["bench", str(tiny_models("llama")), "-c", "2", "-p", "40", "-n", "3",
                                  "--compare", "mlx-lm", "--repeats", "2", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    (ours,), (base,), (row,) = out["scenarios"], out["baseline"], out["ratios"]
    assert len(ours["repeats"]) == len(base["repeats"]) == 2 and row["repeats"] == 2
    # Each repeat's prompts are new: nothing of the second came from the first's prefix cache.
    assert [x["cached_tokens"] for x in ours["repeats"]] == [0, 0]


def test_cli_against_a_server_url(tiny_models):
    from macinfer.llm import LLM
    from macinfer.serve.server import create_app, serve_in_thread

    llm = LLM(str(tiny_models("llama")), num_blocks=65)
    with serve_in_thread(create_app(llm)) as url:
        r = CliRunner().invoke(main, ["bench", "--url", url, "-c", "2", "-p", "8", "-n", "5", "--prefix", "both"])
    assert r.exit_code == 0, r.output
    assert "unique" in r.stdout and "shared" in r.stdout and "tok/s" in r.stdout


def test_cli_bad_input_is_one_line():
    r = CliRunner().invoke(main, ["bench", "--url", "http://127.0.0.1:9", "-c", "0"])
    assert r.exit_code != 0 and "--concurrency" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["bench", "--url", "http://127.0.0.1:9", "-c", "1", "-p", "8", "-n", "2"])
    assert r.exit_code != 0 and "cannot reach" in r.output


def test_predicted_speedup_limits():
    """The cost model (docs/speculation.md): with a verify step as cheap as a plain one and free drafts,
    every verify step is worth its 1 + m tokens; with verify cost growing with every token (quantised
    matmul on a CPU), the same acceptance loses; steps that drafted nothing count as plain steps."""
    from macinfer.spec_decode.step_cost import predicted_speedup

    flat, linear = (lambda tokens: 0.05), (lambda tokens: 0.05 * tokens)
    assert predicted_speedup(flat, 0.0, 1, 10, 30, 12, 0) == pytest.approx(2.2)
    assert predicted_speedup(linear, 0.0, 1, 10, 30, 12, 0) == pytest.approx(2.2 / 4)
    assert predicted_speedup(flat, 0.0, 1, 10, 30, 12, 22) == pytest.approx(44 / 32)  # half the tokens plain
    assert predicted_speedup(flat, 0.01, 1, 10, 30, 12, 0) < 2.2  # draft rounds cost time
    # ... and so does running verify steps synchronously: 22 tokens in 10 x (50 + 5) ms
    assert predicted_speedup(flat, 0.0, 1, 10, 30, 12, 0, sync_s=0.005) == pytest.approx(2.2 / 1.1)
    assert predicted_speedup(flat, 0.0, 1, 0, 0, 0, 20) is None


def test_cli_draft_prints_the_predicted_beside_the_measured(tiny_models):
    r = CliRunner().invoke(main, ["bench", str(tiny_models("llama")), "-c", "1,2", "-p", "16", "-n", "12",
                                  "--draft", "ngram", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert sorted(s["label"] for s in out["scenarios"]) == ["macinfer", "macinfer", "macinfer+ngram", "macinfer+ngram"]
    rows = out["speculation"]
    assert [x["concurrency"] for x in rows] == [1, 2] and all(x["measured_x"] > 0 for x in rows)
    for x in rows:  # predicted where something was drafted, from that run's own counts and costs
        assert (x["predicted_x"] is None) == (x["k"] is None)
    text = CliRunner().invoke(main, ["bench", str(tiny_models("llama")), "-c", "1", "-p", "16", "-n", "12",
                                     "--draft", "ngram"])
    assert text.exit_code == 0 and "predicted x" in text.output and "measured x" in text.output
