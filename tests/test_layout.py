"""The package's import graph: every import points down the layers, and nothing imports in a cycle.

Layers, bottom to top (docs/ARCHITECTURE.md draws them):

    base     macinfer._blas, errors, units, paths, timing, staging
    prefix_cache   block hashes and model identity, the disk tier and its directories
    modelio  loading, GGUF import, quantisation, evaluation
    kv       the paged KV cache as models see it (cache adapter, attention, quantised K/V, RoPE)
    core     sequences, sampling, block pool, prefix cache, scheduler, model runner
    spec_decode    speculative decoding (decoder, drafters, the speculator factory)
    engine   the step loop (LLMEngine)
    chat     how a model talks: chat template, thinking, tool calls, their grammars (over the engine's deltas)
    llm      the Python API (macinfer.LLM; the package's own __init__)
    serve / perf   the OpenAI server; bandwidth, benchmarks, the KV calculator
    tui      the Textual app (macinfer.tui, its sources in the top-level tui/ folder)
    cli      the `macinfer` command

A module may import its own layer or any below it. Imports inside functions count
too: they keep start-up fast but hide no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["base", "prefix_cache", "modelio", "kv", "core", "spec_decode", "engine", "chat", "llm", "serve", "tui", "cli"]
BASE = {"macinfer._blas", "macinfer.errors", "macinfer.units", "macinfer.paths", "macinfer.timing", "macinfer.staging"}


def layer(module: str) -> str:
    if module in BASE:
        return "base"
    if module in ("macinfer", "macinfer.llm"):
        return "llm"
    if module == "macinfer.tui" or module.startswith("macinfer.tui."):
        return "tui"
    sub = module.split(".")[1]
    return {"perf": "serve", "__main__": "cli"}.get(sub, sub)


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in (("macinfer", "macinfer"), ("macinfer.tui", "tui")):
        for path in (ROOT / folder).rglob("*.py"):
            parts = (pkg,) + path.relative_to(ROOT / folder).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, known: set[str]) -> set[str]:
    """Every project module `path` imports, at any depth in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, set(mods)) - {name} for name, path in mods.items()}


def test_every_module_has_a_layer():
    for name in modules():
        assert layer(name) in LAYERS, name


def test_imports_point_down():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = [f"{a} ({layer(a)}) imports {b} ({layer(b)})" for a, deps in graph().items() for b in deps
              if rank[layer(b)] > rank[layer(a)]]
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycles():
    g = graph()
    # Package __init__ modules are imported implicitly by their children: not an edge back.
    g = {a: {b for b in deps if not a.startswith(b + ".")} for a, deps in g.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(g):
        if n not in state and (cycle := visit(n)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_no_sys_path_tricks():
    """Scripts are run, never imported: nothing in the package or the tests edits sys.path."""
    offenders = [str(p.relative_to(ROOT)) for d in ("macinfer", "tui", "tests") for p in (ROOT / d).rglob("*.py")
                 if "sys.path" in p.read_text() and p.name != "test_layout.py"]
    assert not offenders, offenders
