"""Across ranks (macinfer.engine.distributed): two local processes under `mlx.launch -n 2 --backend ring`.

The oracle is the same engine in one process: greedy output under 2 ranks (tensor, and
pipeline) is token-for-token the single-process output for a staggered batch of 8 requests
in a KV pool small enough to preempt. Each rank runs tests/dist_worker.py. The CLI under 2 ranks:
`macinfer run` prints the one-process text once, `macinfer serve` answers the openai SDK as
one process does and shows both ranks on /metrics. Bad launch
settings are checked in-process (shard_model reads only the group's size before refusing).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import signal
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from macinfer.core.sampling import SamplingParams
from macinfer.errors import MacinferError

WORKER = Path(__file__).with_name("dist_worker.py")
# 11 usable blocks x 4 tokens for 8 requests of 13 to 34 tokens: preemption.
ENGINE = dict(num_blocks=12, block_size=4, max_num_seqs=8, max_num_batched_tokens=16)


def workload() -> list:
    """(arrival step, prompt ids, params, request id) for tests/driver.run: 8 staggered requests, the
    last one sharing r5's prompt (a prefix-cache hit)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(5 + 3 * i)] for i in range(8)]
    prompts[7] = prompts[5] + [9]
    return [(2 * i, p, SamplingParams(max_tokens=8, ignore_eos=True), f"r{i}") for i, p in enumerate(prompts)]


def _free_port() -> int:
    """A port p with p and p + 1 free (the ring backend listens on one per rank)."""
    for _ in range(50):
        p = random.randrange(20000, 60000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")


@contextmanager
def _launched(*argv: str, stdout=subprocess.PIPE, stderr=subprocess.PIPE):
    """`mlx.launch -n 2 --backend ring -- *argv` (on this checkout's macinfer), in its own process group,
    killed whole on the way out so no rank outlives the test."""
    launch = shutil.which("mlx.launch")
    if launch is None:
        pytest.skip("mlx.launch is not installed (it comes with mlx)")
    cmd = [launch, "-n", "2", "--backend", "ring", "-p", str(_free_port()), "--", *argv]
    env = {**os.environ, "PYTHONPATH": str(WORKER.parent.parent)}  # this checkout's macinfer on every rank
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, text=True, cwd=WORKER.parent,
                            env=env, start_new_session=True)
    try:
        yield proc
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _launch(model: Path, out: Path, parallel: str, options: dict, *extra: str) -> subprocess.CompletedProcess:
    """Each rank runs tests/dist_worker.py; returns when both ended."""
    with _launched(sys.executable, str(WORKER), str(model), str(out), parallel, json.dumps(options), *extra) as proc:
        stdout, stderr = proc.communicate(timeout=240)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _single_process(model: Path, options: dict) -> dict:
    import driver

    from macinfer.llm import LLM

    llm = LLM(str(model), engine="paged", async_scheduling=False, **ENGINE, **options)  # off across ranks: same schedule
    runner, forwards = llm.engine.runner, []
    run = runner.run_forward
    runner.run_forward = lambda *a, **k: forwards.append(len(a[0])) or run(*a, **k)
    outputs = driver.run(llm.engine, workload())
    assert outputs["r7"].metrics.cached_tokens > 0
    return {rid: o.token_ids for rid, o in outputs.items()} | {"preemptions": llm.engine.scheduler.num_preemptions,
                                                                "forwards": len(forwards), "rows": forwards}


@pytest.mark.parametrize("arch,layers,parallel,options", [
    ("llama", 2, "tensor", {"kv_bits": 8}),  # hidden 128: head_dim 32, a KV quantisation group
    ("qwen2", 3, "pipeline", {"micro_batches": 2}),  # 2 + 1 layers
])
def test_two_ranks_match_one_process(tiny_models, tmp_path, arch, layers, parallel, options):
    """Staggered greedy batch with preemption and a prefix-cache hit: 2 ranks == 1 process, token for
    token, with the same schedule (preemptions) and one plan sent per forward; pipelined, each forward
    of several rows ran as 2 micro-batches. Both ranks report a replay of their collectives."""
    model = tiny_models(arch, num_layers=layers, **({"hidden_size": 128} if parallel == "tensor" else {}))
    res = _launch(model, tmp_path / "out.json", parallel, options)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got.pop("ranks_report_memory")  # both ranks' active memory reached rank 0
    assert got.pop("ranks_report_comm")
    built, collectives = got.pop("built"), got.pop("collectives")
    engine_options = {k: v for k, v in options.items() if k != "micro_batches"}
    want = _single_process(model, engine_options)
    rows = want.pop("rows")  # of each forward
    assert want["preemptions"] > 0
    assert got == want
    if parallel == "pipeline":  # rows split 2 ways (the first half larger); a 1-row forward whole
        assert max(rows) > 2
        assert built == [part for n in rows for part in ([n - n // 2, n // 2] if n > 1 else [n])]
        # rank 0 holds the last layers: per micro-batch, it receives the hidden states and all_gathers its own
        assert collectives == ["recv", "all_gather"] * min(2, rows[-1])
    else:
        assert built == rows
        assert collectives == ["all_sum"] * 2 * layers  # attention's output projection, the MLP's down projection
    assert "Traceback" not in res.stderr


def test_a_dying_rank_stops_the_other_with_one_line(tiny_models, tmp_path):
    """Rank 1 is killed mid-generation: rank 0 exits non-zero with one line, no traceback, no hang."""
    res = _launch(tiny_models("llama", num_layers=2), tmp_path / "out.json", "tensor", {}, "20")
    assert "rank 0 exited with code 1" in res.stderr  # mlx.launch's own report (its exit status is 0)
    assert not (tmp_path / "out.json").exists()
    # mlx.launch relays each rank's stderr beside its own colored warnings: a line can arrive
    # glued to one of them ("\x1b[33m[WARN]error: rank 0 ..."), so count the message, not line starts.
    assert res.stderr.count("error: rank 0 of 2") == 1, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


# -- the CLI under 2 ranks -----------------------------------------------------------------------------------
MACINFER = (sys.executable, "-c", "import sys; from macinfer.cli.main import main; sys.argv[0] = 'macinfer'; main()")
SPLITS = [("llama", 2, "tensor"), ("qwen2", 3, "pipeline")]
PROMPT = "The capital of France is"


@pytest.mark.parametrize("arch,layers,parallel", SPLITS[:1])  # pipelined runs: test_two_ranks_match_one_process
def test_run_under_two_ranks_prints_the_one_process_text_once(tiny_models, arch, layers, parallel):
    from click.testing import CliRunner

    from macinfer.cli.main import main

    args = ["run", str(tiny_models(arch, num_layers=layers)), PROMPT, "-n", "6", "--no-chat-template",
            "--peak-bandwidth", "100"]
    want = CliRunner().invoke(main, args)
    assert want.exit_code == 0, want.output
    with _launched(*MACINFER, *args, "--parallel", parallel) as proc:
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "exited with code" not in stderr and "Traceback" not in stderr, stderr[-2000:]
    assert stdout == want.stdout  # rank 0's text, once
    assert stderr.count("generated 6 tok") == 1  # and one stats line


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    import httpx2 as httpx

    for _ in range(600):
        assert proc.poll() is None, log.read_text()[-2000:]
        with suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError("the server did not come up: " + log.read_text()[-2000:])


def _metric(page: str, name: str) -> float:
    return float(next(line.split()[-1] for line in page.splitlines() if line.startswith(name + " ")))


@pytest.mark.parametrize("arch,layers,parallel", SPLITS)
def test_serve_under_two_ranks_answers_as_one_process(tiny_models, tmp_path, arch, layers, parallel):
    """A greedy completion through the openai SDK equals the single-process one; /metrics shows both ranks'
    memory and the plan exchanges; Ctrl+C on rank 0 (uvicorn's shutdown, then STOP at exit) ends both ranks."""
    import httpx2 as httpx
    import openai

    from macinfer.llm import LLM

    model, port, log = tiny_models(arch, num_layers=layers), _free_port(), tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as err, _launched(*MACINFER, "serve", str(model), "--port", str(port), "--parallel", parallel,
                                          stdout=subprocess.DEVNULL, stderr=err) as proc:
        _wait_healthy(url, proc, log)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        name = client.models.list().data[0].id
        got = client.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0,
                                        extra_body={"return_token_ids": True}).choices[0]
        page = httpx.get(url + "/metrics", timeout=30).text
        rank0 = int(re.search(r"Started server process \[(\d+)\]", log.read_text())[1])  # uvicorn's line
        os.kill(rank0, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)  # no rank outlived mlx.launch
    stderr = log.read_text()
    assert "exited with code" not in stderr and "Traceback" not in stderr, stderr[-2000:]
    want = LLM(str(model)).generate([PROMPT], SamplingParams(temperature=0, max_tokens=6))[0]
    assert (got.text, got.token_ids) == (want.text, want.token_ids)
    assert _metric(page, "macinfer_ranks") == 2
    assert min(_metric(page, f'macinfer_rank_active_memory_bytes{{rank="{r}"}}') for r in (0, 1)) > 0
    assert _metric(page, "macinfer_distributed_plans_total") >= len(want.token_ids)  # a plan per forward
    assert _metric(page, "macinfer_distributed_plan_seconds_total") > 0
    assert min(_metric(page, f'macinfer_rank_comm_seconds{{rank="{r}"}}') for r in (0, 1)) > 0  # each rank's replay


class _Group:
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


def _lazy(path):
    from mlx_lm.utils import load_model

    return load_model(Path(path), lazy=True)


@pytest.mark.parametrize("ranks,parallel,arch,message", [
    (4, "tensor", "llama", "its 2 KV heads do not split evenly over 4 ranks"),
    (3, "tensor", "llama", "its 4 attention heads do not split evenly over 3 ranks"),
    (2, "pipeline", "llama", "mlx-lm cannot pipeline llama: try --parallel tensor"),
    (3, "pipeline", "qwen2", "2 layers cannot be split over 3 ranks: use at most 2"),
])
def test_bad_launch_settings_are_one_line(tiny_models, ranks, parallel, arch, message):
    from macinfer.modelio.loader import shard_model

    model, config = _lazy(tiny_models(arch))
    with pytest.raises(MacinferError, match=message):
        shard_model(model, config, "tiny", _Group(ranks), parallel)


def test_auto_is_tensor_where_mlx_lm_can_else_pipeline(tiny_models, monkeypatch):
    from macinfer.modelio.loader import shard_model

    model, config = _lazy(tiny_models("qwen2"))
    with pytest.raises(MacinferError, match="4 attention heads do not split evenly over 3 ranks"):
        shard_model(model, config, "tiny", _Group(3), "auto")
    monkeypatch.delattr(type(model), "shard")
    with pytest.raises(MacinferError, match="2 layers cannot be split over 3 ranks"):
        shard_model(model, config, "tiny", _Group(3), "auto")


def test_metrics_show_the_ranks_and_the_plan_time():
    from macinfer.serve.metrics import ServerMetrics

    class Engine:
        def kv_stats(self):
            return {"ranks": 2, "plans": 7, "plan_seconds": 0.25, "rank_memory_bytes": [3 << 20, 5 << 20],
                    "rank_comm_seconds": [0.002, 0.003]}

    class Loop:
        engine, num_active, peak_batch, num_aborted = Engine(), 0, 1, 0

    metrics = ServerMetrics()
    metrics.attach(Loop())
    page = metrics.render()[0].decode()
    for line in ("macinfer_ranks 2.0", "macinfer_distributed_plans_total 7.0", "macinfer_distributed_plan_seconds_total 0.25",
                 'macinfer_rank_active_memory_bytes{rank="0"} 3.145728e+06',
                 'macinfer_rank_active_memory_bytes{rank="1"} 5.24288e+06',
                 'macinfer_rank_comm_seconds{rank="0"} 0.002', 'macinfer_rank_comm_seconds{rank="1"} 0.003'):
        assert line in page.splitlines()


def test_chat_under_mlx_launch_is_one_line(monkeypatch):
    from click.testing import CliRunner

    from macinfer.cli.main import main

    monkeypatch.setenv("MLX_RANK", "1")
    r = CliRunner().invoke(main, ["chat"])
    assert r.exit_code == 1 and r.output.strip() == (
        "Error: chat runs in one process: under mlx.launch, use `macinfer serve` (rank 0 serves) or `macinfer run`, "
        "and watch it with `macinfer chat --url`")


def test_the_watchdog_ends_a_rank_stuck_in_a_collective_with_one_line():
    """A watched wait that outlives the timeout (a hung peer) ends the process: exit 1, one line."""
    code = ("import time\n"
            "from macinfer.engine.distributed import Ranks\n"
            "class G:\n"
            "    def rank(self): return 1\n"
            "    def size(self): return 2\n"
            "ranks = Ranks(G(), 'tensor', timeout=0.5)\n"
            "with ranks.watch('rank 0 stopped sending plans'):\n"
            "    time.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(WORKER.parent.parent)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=env)
    assert res.returncode == 1
    assert res.stderr.strip() == ("error: rank 1 of 2 (tensor parallel): rank 0 stopped sending plans "
                                  "(nothing for 0.5 s; MACINFER_DIST_TIMEOUT sets the limit); stopping")


def test_the_recorder_notes_each_collective_and_replay_runs_them_again():
    """In one process (a group of 1): calls recorded in order with their shapes, the all_gather's input kept,
    mx.distributed restored; the replay runs them."""
    import mlx.core as mx

    from macinfer.engine.collectives import Recorder, micro_batch_bounds, replay

    group, all_sum = mx.distributed.init(), mx.distributed.all_sum
    recorder = Recorder()
    with recorder.recording():
        h = mx.distributed.all_sum(mx.ones((2, 3)), group=group) * 2
        out = mx.distributed.all_gather(h, group=group)[:2]
    assert [(op, shape, dtype, peer) for op, shape, dtype, peer in recorder.calls] == [
        ("all_sum", (2, 3), mx.float32, None), ("all_gather", (2, 3), mx.float32, None)]
    assert len(recorder.gathered) == 1 and recorder.gathered[0] is h and mx.distributed.all_sum is all_sum
    assert out.tolist() == [[2.0] * 3] * 2
    assert replay(recorder.calls, group) > 0
    assert micro_batch_bounds(5, 2) == [(0, 3), (3, 5)] and micro_batch_bounds(1, 2) == [(0, 1)]


def test_pipelined_forwards_split_into_micro_batches_when_each_gets_32_tokens_or_as_asked():
    from macinfer.engine.distributed import Ranks

    class Group(_Group):
        def rank(self):
            return 0

    auto, three = Ranks(Group(2), "pipeline"), Ranks(Group(2), "pipeline", micro_batches=3)
    decode, prefill, one = [[5]] * 8, [[5] * 40, [5] * 24], [[5] * 100]
    assert [auto._plan_split(t) for t in (decode, prefill, one)] == [1, 2, 1]
    assert [three._plan_split(t) for t in (decode, prefill, one)] == [3, 2, 1]
    assert Ranks(Group(2), "tensor", micro_batches=2)._plan_split(prefill) == 1
    with pytest.raises(MacinferError, match="--micro-batches must be at least 1, got 0"):
        Ranks(Group(2), "pipeline", micro_batches=0)
