"""Other tools' GGUF stores, laid out as those tools lay them out, through `macinfer ls / run / show / rm`.

- Ollama: `$OLLAMA_MODELS/manifests/registry.ollama.ai/library/<model>/<tag>` (a Docker-style
  JSON manifest whose `application/vnd.ollama.image.model` layer names the blob) and
  `blobs/sha256-<hex>` (the GGUF itself, named by its digest).
- LM Studio: `~/.lmstudio/models/<publisher>/<repo>/<file>.gguf` (and a vision projector
  `mmproj-*.gguf` beside it, which is not a model).
- The Hugging Face cache: a GGUF repo as huggingface_hub stores it (blobs, snapshot links).

The stores must be byte-for-byte and timestamp-for-timestamp unchanged after listing,
converting, running, showing and removing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from test_gguf_families import BASE, FAMILIES, write_family_gguf
from test_models_cli import add_hf_repo, cli, one_line_error
from tiny import build_from_config

MIX = ["Q4_K", "Q6_K", "Q4_K", "Q8_0"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny qwen3 in a Q4_K_M-like mix, written with gguf's writer."""
    tmp = tmp_path_factory.mktemp("gguf")
    src = build_from_config(tmp / "src", {**BASE, **FAMILIES["qwen3"]})
    path = tmp / "tiny-qwen3-Q4_K_M.gguf"
    write_family_gguf("qwen3", src, path, lambda name, i: MIX[i % len(MIX)])
    return path


def _ollama_store(root: Path, gguf: Path) -> None:
    data = gguf.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    blobs = root / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"sha256-{digest}").write_bytes(data)
    template = b"{{ .Prompt }}"
    (blobs / f"sha256-{hashlib.sha256(template).hexdigest()}").write_bytes(template)
    layers = [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": len(data)},
              {"mediaType": "application/vnd.ollama.image.template",
               "digest": f"sha256:{hashlib.sha256(template).hexdigest()}", "size": len(template)}]
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                           "digest": "sha256:" + "0" * 64, "size": 2}, "layers": layers}
    lib = root / "manifests" / "registry.ollama.ai" / "library"
    for model, tag in (("tinyqwen", "latest"), ("tinyqwen", "q4")):
        (lib / model).mkdir(parents=True, exist_ok=True)
        (lib / model / tag).write_text(json.dumps(manifest))
    (lib / "broken").mkdir()
    (lib / "broken" / "latest").write_text("{not json")
    gone = dict(manifest, layers=[dict(layers[0], digest="sha256:" + "f" * 64)])
    (lib / "gone").mkdir()
    (lib / "gone" / "latest").write_text(json.dumps(gone))


@pytest.fixture
def stores(tmp_path, monkeypatch, tiny_gguf):
    home, hub = tmp_path / "user", tmp_path / "hub"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("MACINFER_HOME", str(tmp_path / "macinfer"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _ollama_store(tmp_path / "ollama", tiny_gguf)
    lms = home / ".lmstudio" / "models" / "someone" / "Tiny-Qwen3-GGUF"
    lms.mkdir(parents=True)
    shutil.copy(tiny_gguf, lms / tiny_gguf.name)
    (lms / "mmproj-tiny-f16.gguf").write_bytes(b"GGUF-not-a-model")
    repo_src = tmp_path / "repo"
    repo_src.mkdir()
    shutil.copy(tiny_gguf, repo_src / tiny_gguf.name)
    (repo_src / "README.md").write_text("a GGUF repo")
    hub.mkdir()
    add_hf_repo(hub, "someone/Tiny-Qwen3-GGUF", repo_src)
    roots = [tmp_path / "ollama", home / ".lmstudio", hub]
    return {"roots": roots, "macinfer": tmp_path / "macinfer", "gguf": tiny_gguf}


def snapshot(roots: list[Path]) -> dict:
    """Every file and link under the stores: content digest, size, mtime (a change anywhere shows)."""
    out = {}
    for root in roots:
        for p in sorted(root.rglob("*")):
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else None
            out[str(p)] = (digest, st.st_size, st.st_mtime_ns, os.readlink(p) if p.is_symlink() else None)
    return out


NAMES = ["ollama:tinyqwen:latest", "ollama:tinyqwen:q4", "lmstudio:someone/Tiny-Qwen3-GGUF/tiny-qwen3-Q4_K_M.gguf",
         "hf:someone/Tiny-Qwen3-GGUF/tiny-qwen3-Q4_K_M.gguf"]


def test_ls_lists_the_stores_and_run_show_rm_leave_them_untouched(stores):
    before = snapshot(stores["roots"])
    r = cli("ls", "--json")
    assert r.exit_code == 0, r.output
    models = {m["name"]: m for m in json.loads(r.output)["models"]}
    for name in NAMES:
        m = models[name]
        assert (m["architecture"], m["quantization"], m["downloaded"]) == ("qwen3", "GGUF Q4_K", True), m
    assert models[NAMES[0]]["kind"] == "ollama" and models[NAMES[2]]["kind"] == "lmstudio"
    assert models[NAMES[3]]["kind"] == "hf-gguf"
    assert not any("mmproj" in n or "broken" in n or "gone" in n for n in models)
    assert "Ollama" in cli("ls").output

    outputs = set()
    for name in NAMES:
        r = cli("run", name, "Hello", "-n", "4")
        assert r.exit_code == 0, r.output
        outputs.add(r.stdout.strip())  # the first run also draws (and clears) the conversion bar
    assert len(outputs) == 1  # one model, whichever store it is read from
    conversions = [p for p in (stores["macinfer"] / "models").iterdir() if not p.name.startswith(".")]
    assert len(conversions) == 1, conversions  # one file's digest: one conversion

    show = cli("show", NAMES[0])
    assert show.exit_code == 0, show.output
    assert "Q4_K:" in show.output and "Q6_K:" in show.output and "tensors" in show.output
    assert "Q6_K -> 8-bit affine g32: re-quantised" in show.output and "kept exactly" in show.output

    r = cli("rm", NAMES[0], "-y")
    assert r.exit_code == 0 and "the GGUF file stays" in r.output, r.output
    assert not any(p.exists() for p in conversions)
    one_line_error(cli("rm", NAMES[2], "-y"), "reads in place", "nothing of macinfer's to remove")
    assert snapshot(stores["roots"]) == before


def test_broken_ollama_entries_are_one_line_naming_the_manifest(stores):
    one_line_error(cli("run", "ollama:broken", "Hello"), "manifests/registry.ollama.ai/library/broken/latest",
                   "broken Ollama manifest")
    one_line_error(cli("show", "ollama:gone:latest"), "library/gone/latest", "blob", "missing")
    one_line_error(cli("run", "ollama:nosuch:7b", "Hello"), "no Ollama model 'nosuch:7b'")
    one_line_error(cli("run", "lmstudio:someone/Tiny-Qwen3-GGUF/mmproj-tiny-f16.gguf", "Hello"), "no GGUF model")


def test_ollama_names_off_the_library_and_the_registry(tmp_path, monkeypatch, tiny_gguf):
    from macinfer.modelio.gguf_stores import find_stored, ollama_models

    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    _ollama_store(tmp_path, tiny_gguf)
    manifests = tmp_path / "manifests"
    lib = manifests / "registry.ollama.ai" / "library" / "tinyqwen" / "latest"
    for where in ("registry.ollama.ai/someone/tiny/7b", "hf.co/someone/Tiny-GGUF/Q4_K_M"):
        (manifests / where).parent.mkdir(parents=True)
        shutil.copy(lib, manifests / where)
    names = {m.name for m in ollama_models()}
    assert {"ollama:someone/tiny:7b", "ollama:hf.co/someone/Tiny-GGUF:Q4_K_M", "ollama:tinyqwen:q4"} <= names
    assert find_stored("ollama:tinyqwen").path == find_stored("ollama:tinyqwen:latest").path
    assert find_stored("ollama:hf.co/someone/Tiny-GGUF:Q4_K_M").digest == hashlib.sha256(
        tiny_gguf.read_bytes()).hexdigest()


def test_serve_discovers_a_stored_gguf_and_serves_it_by_name(stores):
    """`macinfer serve` lists Ollama's model among its own and answers with it as mlx-lm does on the conversion."""
    import httpx2 as httpx
    import openai

    from macinfer.llm import LLM
    from macinfer.modelio.embedded import converted_path
    from macinfer.modelio.gguf_stores import find_stored
    from macinfer.serve.model_pool import PoolOptions, local_models
    from macinfer.serve.server import create_app, serve_in_thread
    from oracle import mlx_lm_greedy, mlx_lm_load

    before = snapshot(stores["roots"])
    name = "ollama:tinyqwen:q4"
    assert name in local_models()
    load = lambda spec: LLM(spec, num_blocks=33)  # noqa: E731
    app = create_app(load(NAMES[2]), model_name=NAMES[2], models=PoolOptions(load=load, discover=local_models))
    with serve_in_thread(app) as url:
        assert name in {c["id"] for c in httpx.get(url + "/v1/models", timeout=30).json()["data"]}
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = c.completions.create(model=name, prompt="Paged attention stores", max_tokens=6, temperature=0,
                                 extra_body={"return_token_ids": True})
    stored = find_stored(name)
    conv = converted_path(stored.path, name, stored.digest)
    _, tok = mlx_lm_load(str(conv))
    assert r.choices[0].model_extra["token_ids"] == mlx_lm_greedy(conv, tok.encode("Paged attention stores"), 6)
    assert snapshot(stores["roots"]) == before
