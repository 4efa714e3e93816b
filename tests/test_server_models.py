"""`macinfer serve` with several models: each answers as it does alone, /v1/models lists them all,
the least recently used is unloaded under a budget (its lease released) once drained, unknown
names are a 404, and /metrics labels each series with its model."""

import asyncio
import json
import threading

import httpx2 as httpx
import openai
import pytest
from oracle import mlx_lm_greedy, mlx_lm_load

from macinfer.llm import LLM
from macinfer.modelio.leases import holders
from macinfer.serve.model_pool import PoolOptions, estimate_bytes, local_models
from macinfer.serve.server import create_app, serve_in_thread

PROMPT = "Paged attention stores the key value cache"


def load(spec):
    return LLM(spec, num_blocks=33)


@pytest.fixture(scope="module")
def paths(tiny_models):
    return {"tiny-llama": tiny_models("llama"), "tiny-qwen2": tiny_models("qwen2"), "tiny-qwen3": tiny_models("qwen3")}


def app_of(paths, **options):
    """A server of tiny-llama (the default) and, loaded on demand, tiny-qwen2 and tiny-qwen3."""
    others = {name: str(p) for name, p in paths.items() if name != "tiny-llama"}
    return create_app(load(str(paths["tiny-llama"])), model_name="tiny-llama",
                      models=PoolOptions(others=others, load=load, **options))


def complete(url, model, max_tokens=8, **extra):
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = c.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                             extra_body={"return_token_ids": True, **extra})
    assert r.model == model
    return r.choices[0].model_extra["token_ids"]


def greedy(path, max_tokens=8):
    _, tok = mlx_lm_load(str(path))
    return mlx_lm_greedy(path, tok.encode(PROMPT), max_tokens)


def loaded(app) -> set:
    return {m.name for m in app.state.server.pool.loaded()}


def test_each_model_answers_as_alone_and_concurrent_requests_share_one_load(paths):
    app = app_of(paths, max_loaded=2)
    pool = app.state.server.pool
    with serve_in_thread(app) as url:
        cards = httpx.get(url + "/v1/models", timeout=30).json()["data"]
        assert [(c["id"], c["loaded"]) for c in cards] == [("tiny-llama", True), ("tiny-qwen2", False),
                                                           ("tiny-qwen3", False)]

        async def three_each():
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
                rs = await asyncio.gather(*(c.completions.create(
                    model=name, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
                    for name in ["tiny-qwen2", "tiny-qwen3"] * 3))
            return [(r.model, r.choices[0].model_extra["token_ids"]) for r in rs]

        got = asyncio.run(three_each())
        assert pool.num_loads == 2 and pool.num_unloads == 0  # one load per model, however many asked
        assert complete(url, "tiny-llama") == greedy(paths["tiny-llama"])
        for name, ids in got:
            assert ids == greedy(paths[name]), name
        assert greedy(paths["tiny-qwen2"]) != greedy(paths["tiny-qwen3"])  # two different models indeed
        # A request without "model" goes to the default; so does one naming its directory.
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                      "return_token_ids": True}, timeout=30).json()
        assert r["model"] == "tiny-llama" and r["choices"][0]["token_ids"] == greedy(paths["tiny-llama"])
        path = str(pool.default.llm.info.path)
        r = httpx.post(url + "/v1/completions", json={"model": path, "prompt": PROMPT, "max_tokens": 2}, timeout=30)
        assert r.json()["model"] == "tiny-llama"
        cards = httpx.get(url + "/v1/models", timeout=30).json()["data"]
        assert all(c["loaded"] for c in cards) and {c["max_model_len"] for c in cards} == {512}


def test_a_budget_of_one_unloads_the_least_recently_used_and_releases_its_lease(paths, tmp_path, monkeypatch):
    monkeypatch.setenv("MACINFER_HOME", str(tmp_path))  # the leases' directory
    app = app_of(paths, max_loaded=1, lease_what="test server")
    pool = app.state.server.pool
    qwen2, qwen3 = paths["tiny-qwen2"], paths["tiny-qwen3"]
    with serve_in_thread(app) as url:
        assert [x.what for x in holders(paths["tiny-llama"])] == ["test server"]  # the default's, at start
        first = complete(url, "tiny-qwen2")
        assert loaded(app) == {"tiny-llama", "tiny-qwen2"}
        assert len(holders(qwen2)) == 1 and holders(qwen3) == []
        assert complete(url, "tiny-qwen3") == greedy(qwen3)
        assert loaded(app) == {"tiny-llama", "tiny-qwen3"}
        assert holders(qwen2) == [] and len(holders(qwen3)) == 1
        assert complete(url, "tiny-qwen2") == first == greedy(qwen2)  # loaded again on demand
        assert loaded(app) == {"tiny-llama", "tiny-qwen2"} and holders(qwen3) == []
        assert (pool.num_loads, pool.num_unloads) == (3, 2)
        assert complete(url, "tiny-llama") == greedy(paths["tiny-llama"])  # pinned: never unloaded
        assert loaded(app) == {"tiny-llama", "tiny-qwen2"}


def test_concurrent_requests_for_two_models_under_a_budget_of_one_all_finish(paths):
    """Each load evicts the other model: a request holding a model that is just loaded is served
    before that model is unloaded (it once waited for an unload that waited for it)."""
    app = app_of(paths, max_loaded=1)
    names = ["tiny-qwen2", "tiny-qwen3"] * 2

    async def all_of(url):
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
            rs = await asyncio.gather(*(c.completions.create(
                model=name, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
                for name in names))
        return [r.choices[0].model_extra["token_ids"] for r in rs]

    with serve_in_thread(app) as url:
        got = asyncio.run(all_of(url))
    assert got == [greedy(paths[name]) for name in names]
    assert len(loaded(app)) == 2 and app.state.server.pool.num_unloads >= 1


def test_an_unload_waits_for_the_models_running_stream(paths):
    """qwen3's request must unload qwen2, which is streaming: qwen2 is drained (it takes no new
    request, its stream runs to its end), then unloaded, then qwen3 loads."""
    gate = threading.Event()
    gate.set()

    def gated(spec):  # qwen2's steps wait for the gate
        llm = load(spec)
        if spec == str(paths["tiny-qwen2"]):
            step = llm.engine.step
            llm.engine.step = lambda: (gate.wait(30), step())[1]
        return llm

    app = app_of(paths, max_loaded=1)
    pool = app.state.server.pool
    pool.options.load = gated
    body = {"model": "tiny-qwen2", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "temperature": 0,
            "stream": True, "return_token_ids": True}
    with serve_in_thread(app) as url, httpx.Client(timeout=60) as h:
        with h.stream("POST", url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            chunks = [next(line for line in lines if line.startswith("data: "))]
            gate.clear()
            other = {}
            t = threading.Thread(target=lambda: other.update(ids=complete(url, "tiny-qwen3")))
            t.start()
            qwen2 = pool.models["tiny-qwen2"]
            while not qwen2.draining:
                t.join(0.01)
            assert qwen2.busy and loaded(app) == {"tiny-llama", "tiny-qwen2"}
            gate.set()
            chunks += [line for line in lines if line.startswith("data: ")]
        t.join(60)
    ids = [i for c in chunks if c != "data: [DONE]" for i in json.loads(c[6:])["choices"][0].get("token_ids", [])]
    assert chunks[-1] == "data: [DONE]" and len(ids) == 200
    alone = greedy(paths["tiny-qwen2"], 200)
    assert ids[:len(alone)] == alone
    assert other["ids"] == greedy(paths["tiny-qwen3"])
    assert loaded(app) == {"tiny-llama", "tiny-qwen3"}


def test_a_memory_budget_unloads_what_does_not_fit_and_refuses_a_model_that_never_fits(paths):
    app = app_of(paths, max_loaded=None)
    pool = app.state.server.pool
    with serve_in_thread(app) as url:
        size = pool.default.nbytes  # weights + KV pool, measured; the three tiny models are within 0.2%
        pool.options.memory, pool.options.estimate = int(2.5 * size), lambda spec: size
        complete(url, "tiny-qwen2")
        assert loaded(app) == {"tiny-llama", "tiny-qwen2"}
        assert complete(url, "tiny-qwen3") == greedy(paths["tiny-qwen3"])
        assert loaded(app) == {"tiny-llama", "tiny-qwen3"}
        pool.options.memory = int(1.5 * size)  # room for the default alone
        r = httpx.post(url + "/v1/completions", json={"model": "tiny-qwen2", "prompt": "x"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_too_large"
        assert "'tiny-qwen2' cannot be loaded" in r.json()["error"]["message"]
        assert loaded(app) == {"tiny-llama"}


def test_estimate_is_the_weight_files_and_the_kv_budget(paths):
    from macinfer.modelio.model_files import dir_size

    path = paths["tiny-qwen2"]
    assert estimate_bytes(str(path), "1MB") == dir_size(path) + 10**6


def test_a_model_that_fails_to_load_is_a_503_and_the_server_serves_on(paths):
    app = create_app(load(str(paths["tiny-llama"])), model_name="tiny-llama",
                     models=PoolOptions(others={"broken": "/no/such/model"}, load=load))
    with serve_in_thread(app) as url:
        r = httpx.post(url + "/v1/completions", json={"model": "broken", "prompt": "x"}, timeout=30)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "model_load_failed" and err["message"].startswith("could not load the model 'broken': ")
        assert "no such model" in err["message"] and "\n" not in err["message"]
        assert complete(url, "tiny-llama") == greedy(paths["tiny-llama"])
        assert loaded(app) == {"tiny-llama"}


def test_unknown_model_is_a_404_naming_it_and_metrics_carry_model_labels(paths):
    app = app_of(paths)
    with serve_in_thread(app) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"model": "gpt-9", "messages": [{"role": "user",
                                                           "content": "hi"}]}, timeout=30)
        assert r.status_code == 404
        err = r.json()["error"]
        assert (err["code"], err["param"], err["type"]) == ("model_not_found", "model", "invalid_request_error")
        assert "'gpt-9'" in err["message"] and "GET /v1/models" in err["message"] and "\n" not in err["message"]
        complete(url, "tiny-llama", max_tokens=3, ignore_eos=True)
        complete(url, "tiny-qwen2", max_tokens=4, ignore_eos=True)
        page = httpx.get(url + "/metrics", timeout=30).text.splitlines()
    for line in ('macinfer_generation_tokens_total{model="tiny-llama"} 3.0',
                 'macinfer_generation_tokens_total{model="tiny-qwen2"} 4.0',
                 'macinfer_requests_total{endpoint="completions",finish_reason="length",model="tiny-qwen2",protocol="openai"} 1.0',
                 'macinfer_kv_blocks_total{model="tiny-llama"} 32.0',
                 'macinfer_kv_blocks_total{model="tiny-qwen2"} 32.0',
                 'macinfer_requests_in_flight{model="tiny-qwen2"} 0.0',
                 'macinfer_request_errors_total{status="404"} 1.0'):
        assert line in page, line
    assert not any(line.startswith("macinfer_kv_blocks_total ") for line in page)


def test_any_model_ls_lists_is_served_by_its_name(paths, tmp_path, monkeypatch):
    monkeypatch.setenv("MACINFER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # nothing there
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "my-qwen3").symlink_to(paths["tiny-qwen3"], target_is_directory=True)
    assert "my-qwen3" in local_models()
    app = create_app(load(str(paths["tiny-llama"])), model_name="tiny-llama",
                     models=PoolOptions(load=load, discover=local_models))
    with serve_in_thread(app) as url:
        cards = {c["id"]: c for c in httpx.get(url + "/v1/models", timeout=30).json()["data"]}
        assert cards["my-qwen3"]["loaded"] is False and cards["tiny-llama"]["loaded"] is True
        assert complete(url, "my-qwen3") == greedy(paths["tiny-qwen3"])
        assert loaded(app) == {"tiny-llama", "my-qwen3"}
        assert httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30).status_code == 404


def test_a_converted_gguf_is_listed_once_under_its_sources_name(paths, tmp_path, monkeypatch):
    """The embedded model's conversions (current and stale) are caches of its GGUF: /v1/models lists
    `smollm2-135m` only, not also the conversion directories."""
    monkeypatch.setenv("MACINFER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    conversions = tmp_path / "home" / "models"
    conversions.mkdir(parents=True)
    for key in ("89126f2891f4", "220d11f96fc0"):
        (conversions / f"SmolLM2-135M-Instruct.Q4_1-{key}").symlink_to(paths["tiny-llama"], target_is_directory=True)
    (tmp_path / "home" / "my-qwen3").symlink_to(paths["tiny-qwen3"], target_is_directory=True)
    listed = local_models()
    assert "my-qwen3" in listed and "smollm2-135m" in listed
    assert not [name for name in listed if name.startswith("SmolLM2-135M-Instruct")], listed


def test_max_loaded_models_0_serves_the_default_only(paths):
    """No model besides the default can ever load: other --model refused at start-up in one line (not a
    503 on every request for them), and nothing else listed."""
    from click.testing import CliRunner

    from macinfer.cli.main import main

    assert PoolOptions(max_loaded=0, discover=local_models).discover is None
    with pytest.raises(ValueError, match="serves the default model only"):
        PoolOptions(others={"tiny-qwen2": str(paths["tiny-qwen2"])}, max_loaded=0)
    r = CliRunner().invoke(main, ["serve", str(paths["tiny-llama"]), "--model", str(paths["tiny-qwen2"]),
                                  "--max-loaded-models", "0", "--port", "0"])
    assert r.exit_code != 0 and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    assert "--max-loaded-models 0 serves the default model only" in r.output


def test_serve_cli_names_a_bad_model_in_one_line():
    from click.testing import CliRunner

    from macinfer.cli.main import main

    r = CliRunner().invoke(main, ["serve", "--model", "/no/such/model", "--model", "/no/such/other"])
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert r.output.strip().splitlines() == [r.output.strip()] and "/no/such/other" in r.output
