"""The documentation stays true: the README is a first hour's read, every page is reachable, every
link lands, every `macinfer ...` example parses with the command's own options, and every module,
name and file the docs and docstrings point at exists."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import click
import pytest

from macinfer.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
README_LIMIT = 10 * 1024


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading; a trailing `{#id}` names it explicitly."""
    explicit = re.search(r"\{#([\w-]+)\}\s*$", heading)
    if explicit:
        return explicit.group(1)
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    """Headings' anchors, and every `{#id}` (platform.md names list items that way)."""
    text = page.read_text()
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)} | set(re.findall(r"\{#([\w-]+)\}", text))


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [m.group(1) for m in re.finditer(r"\]\(([^)\s]+)\)", text)]


def test_readme_is_a_first_hours_read():
    assert len((ROOT / "README.md").read_bytes()) <= README_LIMIT


def test_every_doc_page_is_linked_from_the_readme():
    linked = {(ROOT / link.split("#")[0]).resolve() for link in _links(ROOT / "README.md")}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_land(page):
    broken = []
    for link in _links(page):
        if re.match(r"[a-z]+:", link):
            continue  # http(s), mailto
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(link)
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(link)
    assert not broken, broken


def _examples(page: Path) -> list[tuple[str, bool]]:
    """`macinfer ...` command lines of the page: (line, whole) for shell blocks (whole: every
    required argument shown) and inline code (options only); lines with placeholders skipped."""
    text = page.read_text()
    lines = [(line, True) for block in re.findall(r"```(?:sh|bash|console)?\n(.*?)```", text, re.S)
             for line in block.splitlines()]
    lines += [(" ".join(span.split()), False) for span in re.findall(r"`(macinfer [^`]+)`", text)]
    out = []
    for line, whole in lines:
        line = re.sub(r"^\$ ", "", line.strip())
        if " -- macinfer " in line:
            line = line[line.index(" -- macinfer ") + 4:]
        if not line.startswith("macinfer "):
            continue
        line = re.split(r"\s+#\s", line)[0].split(" | ")[0].split(" && ")[0]
        if re.search(r"\[|\.\.\.|<|\b(MODEL|SRC|OUT|PROMPT|FILE|NAME|N)\b", line):
            continue  # a usage line with placeholders, not an example
        out.append((line, whole))
    return out


EXAMPLES = [(p.name, line, whole) for p in PAGES for line, whole in _examples(p)]


def test_the_docs_have_examples():
    assert sum(whole for _, _, whole in EXAMPLES) > 30


@pytest.mark.parametrize("page,line,whole", EXAMPLES, ids=[f"{p}:{i}" for i, (p, _, _) in enumerate(EXAMPLES)])
def test_example_parses(page, line, whole):
    """The command exists and accepts every option shown, with the values shown; a shell block's
    line also has every argument the command requires."""
    name, cmd, args = "macinfer", main, shlex.split(line)[1:]
    while isinstance(cmd, click.Group) and args and not args[0].startswith("-"):
        sub = cmd.get_command(click.Context(cmd), args[0])
        assert sub is not None, f"no command {args[0]!r} in {name}"
        name, cmd, args = args[0], sub, args[1:]
    cmd.make_context(name, args, resilient_parsing=not whole or isinstance(cmd, click.Group))


# -- names the docs and docstrings point at ----------------------------------------------------
SOURCES = sorted(list((ROOT / "macinfer").rglob("*.py")) + list((ROOT / "tui").rglob("*.py")))
DOTTED = re.compile(r"\bmacinfer(?:\.[A-Za-z_]\w*)+")
FILE = re.compile(r"(?<![\w./-])((?:macinfer|tui|tests|scripts|docs|models)/[\w./-]*\w)")


def _module_path(parts: list[str]) -> tuple[Path | None, list[str]]:
    """The longest prefix of a dotted name that is a module: (its file, the names after it)."""
    for n in range(len(parts), 0, -1):
        rel = ["tui"] + parts[2:n] if parts[:2] == ["macinfer", "tui"] else parts[:n]
        base = ROOT.joinpath(*rel)
        for f in (base.with_suffix(".py"), base / "__init__.py"):
            if f.is_file():
                return f, parts[n:]
    return None, parts


def _names(tree: ast.AST) -> set[str]:
    """Every name a module or class defines (functions, classes, assignments, imports)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for x in ast.walk(t):
                    if isinstance(x, ast.Name):
                        out.add(x.id)
                    elif isinstance(x, ast.Attribute):
                        out.add(x.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return out


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    path, rest = _module_path(parts)
    if path is None:
        return False
    return not rest or rest[0] in _names(ast.parse(path.read_text()))


def _texts():
    for page in PAGES:
        yield page.relative_to(ROOT), page.read_text()
    for src in SOURCES:
        tree = ast.parse(src.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                yield src.relative_to(ROOT), node.value
        yield src.relative_to(ROOT), "\n".join(l for l in src.read_text().splitlines() if l.strip().startswith("#"))


NOT_MODULES = {"macinfer.head_ids"}  # a tensor's name in a shipped draft's safetensors


def test_every_dotted_path_named_exists():
    missing = sorted({f"{where}: {d}" for where, text in _texts() for d in DOTTED.findall(text)
                      if d not in NOT_MODULES and not d.endswith(".py") and not _resolves(d.rstrip("."))})
    assert not missing, "\n".join(missing)


def test_every_file_named_exists():
    missing = sorted({f"{where}: {f}" for where, text in _texts() for f in FILE.findall(text)
                      if "*" not in f and not f.startswith("macinfer/_models")  # the wheel's name for models/
                      and not (ROOT / f).exists() and not (ROOT / f.rstrip(".")).exists()})
    assert not missing, "\n".join(missing)
