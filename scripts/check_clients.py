"""The client-library cases of tests/test_clients.py over 10 seeds: one line per client, k of 10 valid.

    python scripts/check_clients.py            # the embedded SmolLM2 through `macinfer serve`, temperature 0.7

Each case (openai's parse, forced tool calls required / named, streamed and not, instructor's
TOOLS and JSON_SCHEMA modes, LangChain's with_structured_output json_schema and function_calling,
a pydantic-ai Agent with an output_type) runs its 10 seeds concurrently against one server.
"""

import importlib.util
import time
from pathlib import Path

SEEDS = range(10)


def load_cases():
    path = Path(__file__).resolve().parents[1] / "tests" / "test_clients.py"
    spec = importlib.util.spec_from_file_location("test_clients", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    import macinfer  # noqa: F401  (OpenBLAS before MLX)
    from macinfer.llm import LLM
    from macinfer.serve.server import create_app, serve_in_thread

    cases = load_cases()
    with serve_in_thread(create_app(LLM(), model_name="smollm2")) as url:
        for name, case in cases.CASES.items():
            start = time.perf_counter()
            results = cases.each_seed(case, url, SEEDS)
            valid = sum(isinstance(r, cases.Weather) for r in results)
            failures = [f"seed {s}: {r!r}"[:160] for s, r in zip(SEEDS, results) if not isinstance(r, cases.Weather)]
            print(f"{name:28s} {valid} of {len(SEEDS)} valid ({time.perf_counter() - start:.1f} s)"
                  + (f"  [{'; '.join(failures[:2])}]" if failures else ""), flush=True)


if __name__ == "__main__":
    main()
