"""The engine's seams, kept by the source itself (docs/ARCHITECTURE.md, "One step"):

- callers type against the Engine protocol: nothing probes an engine with getattr;
- no code reads a private member of another module's object;
- in macinfer/engine and macinfer/core, collaborators arrive through constructors: nothing
  assigns one onto another object after it was built;
- the scheduler is the one writer of a sequence's computed tokens.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(list((ROOT / "macinfer").rglob("*.py")) + list((ROOT / "tui").rglob("*.py")))

# Collaborators an object gets in its constructor; assigning one onto another object is the
# seam this test keeps closed.
COLLABORATORS = {"evaluator", "decode_graph", "attention_fn", "fill_masks", "slot_of", "release", "on_evict",
                 "store", "enable_caching", "cache_root", "verifier", "hidden_sink", "honours_lengths",
                 "fallback_reason", "spec", "runner", "scheduler", "output", "block_pool", "grammars"}

# Private members read across objects on purpose, each for a reason the code states.
ALLOWED_PRIVATE = {
    ("macinfer/kv/rope.py", "module._freqs"),  # mlx-lm's RoPE variants keep their frequencies only there
    ("macinfer/kv/state_cache.py", "self.store._record"),  # SlotCache and StateStore: one module, one noun
    ("macinfer/core/evaluator.py", "ev._idle_exit"),  # the worker loop and its StepEvaluator: one module
    ("macinfer/core/sequence.py", "Sequence._counter"),  # the class's own counter
}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_no_getattr_probes_of_an_engine():
    probes = [f"{_rel(p)}:{i}: {line.strip()}" for p in SOURCES
              for i, line in enumerate(p.read_text().splitlines(), 1)
              if re.search(r"getattr\(\s*[\w.]*engine\s*,", line)]
    assert not probes, "\n".join(probes)


def test_no_private_member_of_another_object():
    found = []
    for p in SOURCES:
        for node in ast.walk(ast.parse(p.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls", "os"):  # os._exit: the stdlib's own
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            text = ast.unparse(node)
            if (_rel(p), text) not in ALLOWED_PRIVATE:
                found.append(f"{_rel(p)}:{node.lineno}: {text}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("package", ["engine", "core"])
def test_collaborators_arrive_through_constructors(package):
    attached = []
    for p in sorted((ROOT / "macinfer" / package).rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for tt in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if (isinstance(tt, ast.Attribute) and tt.attr in COLLABORATORS
                            and not (isinstance(tt.value, ast.Name) and tt.value.id == "self")):
                        attached.append(f"{_rel(p)}:{tt.lineno}: {ast.unparse(tt)}")
    assert not attached, "\n".join(attached)


def test_only_the_schedulers_write_computed_tokens():
    """vLLM's rule: the runner reports, the scheduler updates (the drafters' own draft states aside)."""
    writers = set()
    for p in (ROOT / "macinfer").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AugAssign) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr == "num_computed_tokens":
                    owner = ast.unparse(t.value)
                    if owner not in ("st", "self"):  # a drafter's DraftState; Sequence itself
                        writers.add(_rel(p))
    assert writers == {"macinfer/core/scheduler.py", "macinfer/core/async_scheduler.py",
                       "macinfer/engine/dense_engine.py"}, writers
