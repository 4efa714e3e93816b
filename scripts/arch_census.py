"""Architecture census: which of mlx-lm's model types macinfer runs, and how exactly.

For every model type in the installed mlx-lm (every module of mlx_lm/models/ with a
Model class), build a tiny random-weight model from mlx-lm's own test configuration
(tests/arch_configs.json), written as an mlx-lm directory with the tiny tokenizer of
tests/tiny.py, and run a staggered batch of 4 prompts through macinfer's LLM (engine
"auto", max_num_batched_tokens 8 so prefill is chunked; request i arrives at step 2i),
comparing every token with mlx-lm's own single-stream greedy decoding (generate_step).
Each architecture runs in its own subprocess (some crash mlx-lm on CPU).

One line per architecture:
    identical (paged)                 the paged engine, token for token mlx-lm's
    identical (fallback: <reason>)    the paged engine refuses it (reason); mlx-lm's
                                      BatchGenerator behind LLMEngine's API matches
    mismatch (<engine>: ...)          tokens differ from mlx-lm's (for the fallback: whether
                                      mlx-lm's BatchGenerator alone, same schedule, differs too)
    refused: <reason>                 neither engine can run it
    error: <what>                     macinfer failed (exception, crash, timeout)
    skipped: <why>                    mlx-lm itself cannot build or run it (or no config)

    python scripts/arch_census.py                   # all, 2 jobs
    python scripts/arch_census.py --only llama,lfm2 --jobs 1
    python scripts/arch_census.py --markdown > scripts/arch_census.md
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "arch_configs.json"
PROMPTS = [
    "The quick brown fox",
    "Paged attention stores the key value cache in fixed size blocks. Continuous batching",
    "What is",
    "Once upon a time there was a little model that wanted to run on a Mac. The capital of France is",
]
MAX_TOKENS = 8
CHUNK = 8  # max_num_batched_tokens: prompts are prefilled in several chunks
TIMEOUT = 600  # per type: the slowest (jamba, whose mamba v1 scan is exp-bound on the CPU) takes minutes on 2 cores
# Not model types: helpers that live next to the models in mlx_lm/models/.
NOT_MODELS = {"base", "cache", "activations", "rope_utils", "switch_layers", "ssm", "pipeline", "gated_delta",
              "mla", "bitlinear_layers"}


def model_types() -> list[str]:
    """Every model type: mlx_lm/models/ modules with a Model, plus every configured type."""
    spec = importlib.util.find_spec("mlx_lm.models")
    models_dir = Path(spec.submodule_search_locations[0])
    found = set()
    for f in models_dir.glob("*.py"):
        name = f.stem
        if name.startswith("_") or name in NOT_MODELS:
            continue
        src = f.read_text()
        if "class Model(" in src or "class ModelArgs" in src:
            found.add(name)
    return sorted(found | set(load_configs()), key=str.lower)


def load_configs() -> dict:
    return json.loads(CONFIGS.read_text())["configs"]


# -- the child: one architecture -----------------------------------------------------------
def phase(name: str) -> None:
    print(f"PHASE {name}", flush=True)


def build(config: dict, out: Path) -> Path:
    """tests/tiny.py's build_from_config (a script may load the tests' helper by its path)."""
    spec = importlib.util.spec_from_file_location("tiny", ROOT / "tests" / "tiny.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    return tiny.build_from_config(out, config)


def staggered(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Request i arrives at step 2i; greedy, EOS ignored. Returns each request's tokens."""
    from macinfer.core.sampling import SamplingParams

    rids, outs, step = [], {}, 0
    while len(rids) < len(prompts) or engine.has_unfinished():
        if len(rids) < len(prompts) and step == 2 * len(rids):
            rids.append(engine.add_request(prompts[len(rids)], SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        for d in engine.step():
            if d.output is not None:
                outs[d.request_id] = d.output.token_ids
        step += 1
        if step > 10_000:
            raise RuntimeError("the engine did not finish")
    return [outs[r] for r in rids]


def raw_batchgenerator(model, prompts: list[list[int]], max_tokens: int, serial: bool) -> list[list[int]]:
    """The same staggered schedule on mlx-lm's BatchGenerator alone, set up as DenseEngine sets it up."""
    from mlx_lm.generate import BatchGenerator

    from macinfer.engine.dense_engine import batchable

    rows = 1 if serial else 4
    gen = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=rows, prefill_step_size=CHUNK,
                         prefill_batch_size=rows if batchable(model) else 1)
    uids, outs, step = [], {}, 0
    while len(uids) < len(prompts) or any(len(outs[u]) < max_tokens for u in uids):
        if len(uids) < len(prompts) and step == 2 * len(uids):
            (uid,) = gen.insert([prompts[len(uids)]])
            uids.append(uid)
            outs[uid] = []
        for r in gen.next()[1]:
            outs[r.uid].append(int(r.token))
        step += 1
    gen.close()
    return [outs[u] for u in uids]


def child(name: str, engine: str = "auto") -> dict:
    import macinfer  # noqa: F401  (OpenBLAS before MLX)

    configs = load_configs()
    if name not in configs:
        return {"verdict": "skipped: no configuration in mlx-lm's tests/test_models.py"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        phase("build")
        try:
            build(configs[name], path)
        except (Exception, SystemExit) as e:  # noqa: BLE001  (some model modules sys.exit when a package is missing)
            return {"verdict": f"skipped: mlx-lm cannot build it ({one_line(e)})"}
        phase("oracle")
        try:
            import mlx.core as mx
            import mlx_lm
            from mlx_lm.generate import generate_step

            model, tok = mlx_lm.load(str(path))
            prompts = [tok.encode(p) for p in PROMPTS]
            want = [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=MAX_TOKENS)] for p in prompts]
            del model
        except Exception as e:  # noqa: BLE001
            return {"verdict": f"skipped: mlx-lm cannot run it ({one_line(e)})"}
        phase("macinfer")
        import contextlib
        import io

        from macinfer.errors import MacinferError
        from macinfer.llm import LLM

        try:
            with contextlib.redirect_stderr(io.StringIO()) as err:
                llm = LLM(str(path), engine=engine, max_num_seqs=4, max_num_batched_tokens=CHUNK, kv_memory="256MiB")
        except MacinferError as e:
            return {"verdict": f"refused: {strip_type(str(e), name)}"}
        except Exception as e:  # noqa: BLE001
            return {"verdict": f"error: {one_line(e)}"}
        kind = llm.engine_kind
        reason = (strip_type(llm.engine.fallback_reason or "--engine mlx-lm", llm.info.model_type)
                  if kind == "mlx-lm" else None)
        try:
            got = staggered(llm.engine, prompts, MAX_TOKENS)
        except Exception as e:  # noqa: BLE001
            return {"verdict": f"error: {kind} engine: {one_line(e)}"}
        if got != want:
            i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
            pos = next((j for j, (a, b) in enumerate(zip(got[i], want[i])) if a != b), min(len(got[i]), len(want[i])))
            where = f"request {i}, token {pos}"
            if kind == "mlx-lm" and raw_batchgenerator(llm.model, prompts, MAX_TOKENS, llm.engine.serial) != want:
                where += "; mlx-lm's BatchGenerator alone differs too"
            return {"verdict": f"mismatch ({'paged' if kind == 'paged' else 'fallback'}: {where})",
                    "stderr": err.getvalue()}
        return {"verdict": "identical (paged)" if kind == "paged" else f"identical (fallback: {reason})"}


def one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}"[:200]


def strip_type(msg: str, model_type: str) -> str:
    msg = msg.splitlines()[0]
    return msg[len(model_type) + 2:] if msg.startswith(model_type + ": ") else msg


# -- the parent ---------------------------------------------------------------------------
def run_one(name: str, timeout: float, engine: str = "auto") -> str:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--engine", engine]
    # The child imports this checkout's macinfer, not whichever one is installed.
    path = os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    env = {**os.environ, "PYTHONPATH": path, "MACINFER_PREFIX_CACHE_DIR": tempfile.gettempdir() + "/arch-census-prefix"}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return crashed(out, f"timed out after {timeout:.0f} s")
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])["verdict"]
    how = f"killed by signal {-p.returncode}" if p.returncode < 0 else f"exit {p.returncode}"
    said = [line for line in p.stderr.strip().splitlines() + p.stdout.strip().splitlines() if not line.startswith("PHASE ")]
    tail = (said or [""])[-1][:160]
    return crashed(p.stdout, how + (f" ({tail})" if tail else ""))


def crashed(stdout: str, how: str) -> str:
    phases = [line[6:] for line in stdout.splitlines() if line.startswith("PHASE ")]
    last = phases[-1] if phases else "build"
    if last in ("build", "oracle"):
        return f"skipped: mlx-lm crashed ({how})"
    return f"error: crashed ({how})"


KINDS = ["identical (paged)", "identical (fallback", "mismatch", "refused", "error", "skipped"]


def summary(results: dict[str, str]) -> str:
    counts = {k: sum(v.startswith(k) for v in results.values()) for k in KINDS}
    names = {"identical (fallback": "identical (fallback)"}
    return f"{len(results)} model types: " + ", ".join(f"{counts[k]} {names.get(k, k)}" for k in KINDS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="Comma-separated model types (default: all).")
    ap.add_argument("--jobs", type=int, default=2, help="Architectures run at once (one subprocess each).")
    ap.add_argument("--markdown", action="store_true", help="Print a Markdown table (for the README).")
    ap.add_argument("--timeout", type=float, default=TIMEOUT, help="Seconds per architecture.")
    ap.add_argument("--engine", choices=["auto", "paged", "mlx-lm"], default="auto",
                    help="The engine macinfer runs each model on (as `macinfer run --engine`).")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.engine)), flush=True)
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else model_types()
    width = max(len(n) for n in names)
    t0 = time.time()
    results: dict[str, str] = {}
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for name, verdict in zip(names, pool.map(lambda n: run_one(n, args.timeout, args.engine), names)):
            results[name] = verdict
            # With --markdown the table comes at the end; progress goes to stderr meanwhile.
            print(f"{name:<{width}}  {verdict}", file=sys.stderr if args.markdown else sys.stdout, flush=True)
    if args.markdown:
        import mlx_lm

        print(f"Architecture census: mlx-lm {mlx_lm.__version__}, tiny random-weight models from mlx-lm's test "
              f"configurations, a staggered batch of {len(PROMPTS)} prompts ({MAX_TOKENS} greedy tokens each, "
              f"prefill in chunks of {CHUNK}) compared token by token with mlx-lm's single-stream greedy decoding "
              f"(`python scripts/arch_census.py --markdown`).\n")
        print("| model type | verdict |\n|---|---|")
        for name, verdict in results.items():
            print(f"| `{name}` | {verdict.replace('|', '/')} |")
        print(f"\n{summary(results)}")
    else:
        print(f"{summary(results)} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
