"""`macinfer serve` through the official openai client: exact greedy output under load,
disconnects abort and free blocks, every bad request is a 4xx and the server keeps serving."""

import asyncio
import time

import httpx2 as httpx
import openai
import pytest
from oracle import mlx_lm_greedy, mlx_lm_load

from macinfer.llm import LLM
from macinfer.serve.server import create_app, serve_in_thread

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def served(tiny_models):
    """(base url, LLM, app) for a tiny llama served on a free loopback port."""
    path = tiny_models("llama")
    llm = LLM(str(path), num_blocks=257)  # 256 usable blocks x 16 tokens
    app = create_app(llm, model_name=MODEL)
    with serve_in_thread(app) as url:
        yield url, llm, app, path


def client(url, **kw):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60, **kw)


def chat_ids(path, messages):
    _, tok = mlx_lm_load(str(path))
    return list(tok.apply_chat_template(messages, add_generation_prompt=True))


def test_chat_non_streaming_is_mlx_lm_greedy(served):
    url, llm, _, path = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    r = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            extra_body={"return_token_ids": True})
    ids = chat_ids(path, messages)
    want = mlx_lm_greedy(path, ids, 16)
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == want
    assert choice.message.role == "assistant"
    assert choice.finish_reason == ("length" if len(want) == 16 else "stop")
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(want)
    assert r.usage.total_tokens == len(ids) + len(want)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.model == MODEL and r.id.startswith("chatcmpl-")


def test_completion_streaming_with_usage_matches_non_streaming(served):
    url, llm, _, path = served
    c = client(url)
    prompt = "Paged attention stores the key value cache"
    plain = c.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                 extra_body={"return_token_ids": True})
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    ids = [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra.get("token_ids", [])]
    _, tok = mlx_lm_load(str(path))
    want = mlx_lm_greedy(path, tok.encode(prompt), 20)
    assert ids == want == plain.choices[0].model_extra["token_ids"]
    assert text == plain.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == plain.choices[0].finish_reason
    # include_usage: one last chunk with no choices and the usage; `usage: null` before it.
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want)
    assert chunks[-1].usage.prompt_tokens == len(tok.encode(prompt))
    assert all(ch.usage is None for ch in chunks[:-1])


def test_64_concurrent_streaming_clients_each_get_their_solo_greedy_output(served):
    """64 streams at once through the official async client: each is its prompt's solo greedy
    output (mlx-lm's), none fails, they were batched, and every block is back in the pool."""
    url, llm, app, path = served
    aengine = app.state.server.engine
    aengine.peak_batch = 0
    prompts = [f"Request {i}: continuous batching schedules every request at the token level." * (1 + i % 3)
               for i in range(8)]
    max_tokens = [6 + i % 11 for i in range(64)]  # client i streams prompts[i % 8]

    async def one(c, i):
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompts[i % 8]}], max_tokens=max_tokens[i],
            temperature=0, stream=True, extra_body={"return_token_ids": True})
        got = []
        async for ch in stream:
            if ch.choices:
                got += ch.choices[0].model_extra.get("token_ids", [])
        return got

    async def main():
        # Closed inside its own event loop: a client left open is closed when garbage-collected,
        # possibly inside a later test's event loop, which then fails with "Event loop is closed".
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)), return_exceptions=True)

    results = asyncio.run(main())
    assert [r for r in results if isinstance(r, BaseException)] == []
    # Greedy with fewer tokens is a prefix of greedy with more: one oracle run per prompt.
    solo = [mlx_lm_greedy(path, chat_ids(path, [{"role": "user", "content": p}]), max(max_tokens)) for p in prompts]
    for i, got in enumerate(results):
        assert got == solo[i % 8][:max_tokens[i]], f"client {i}"
    assert aengine.peak_batch > 1, "requests were not batched together"
    assert llm.engine.kv_stats()["used_blocks"] == 0


def test_disconnecting_client_aborts_and_frees_blocks(served):
    url, llm, app, _ = served
    aengine = app.state.server.engine
    aborted = aengine.num_aborted
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few tokens in, then hang up
    assert any(line.startswith("data: ") for line in got)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (aengine.num_aborted == aborted or llm.engine.requests):
        time.sleep(0.02)
    assert aengine.num_aborted == aborted + 1
    assert not llm.engine.requests
    assert llm.engine.kv_stats()["used_blocks"] == 0
    # and it keeps serving
    r = client(url).completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"model": MODEL}, 400, "messages"),
    ({**CHAT, "messages": "hi"}, 400, "messages"),
    ({**CHAT, "messages": []}, 400, "messages"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({**CHAT, "model": "gpt-9"}, 404, "model"),
    ({**CHAT, "max_tokens": -5}, 400, "max_tokens"),
    ({**CHAT, "max_completion_tokens": 0}, 400, "max_tokens"),
    ({**CHAT, "temperature": -1}, 400, "temperature"),
    ({**CHAT, "temperature": "hot"}, 400, "temperature"),
    ({**CHAT, "top_p": 1.5}, 400, "top_p"),
    ({**CHAT, "top_k": -1}, 400, "top_k"),
    ({**CHAT, "seed": 2**64}, 400, "seed"),
    ({**CHAT, "n": 17}, 400, "n"),
    ({**CHAT, "n": 0}, 400, "n"),
    ({**CHAT, "top_logprobs": 3}, 400, "top_logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({**CHAT, "presence_penalty": 3}, 400, "presence_penalty"),
    ({**CHAT, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content"),
    ({**CHAT, "messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages"),
])
def test_bad_chat_requests_get_4xx_with_error_body(served, body, status, param):
    url = served[0]
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(url + "/v1/chat/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == param


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
    ({"model": MODEL, "prompt": [1, 2, 10**9]}, "prompt"),
    ({"model": MODEL, "prompt": "x " * 600}, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "echo": True}, "echo"),
])
def test_bad_completion_requests_get_400(served, body, param):
    r = httpx.post(served[0] + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_openai_client_raises_its_own_errors_and_server_keeps_serving(served):
    c = client(served[0])
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="prompt is"):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 600}], stream=True)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.choices[0].message.content is not None


def test_models_health_and_metrics(served):
    url = served[0]
    models = client(url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(url + "/health").json()["status"] == "ok"
    text = httpx.get(url + "/metrics").text
    for name in ("macinfer_requests_total", "macinfer_generation_tokens_total",
                 "macinfer_time_to_first_token_seconds_bucket", "macinfer_engine_step_seconds_bucket",
                 "macinfer_kv_blocks_used", "macinfer_kv_blocks_total 256.0", "macinfer_prefix_cache_hits_total",
                 "macinfer_draft_acceptance_ratio"):
        assert name in text, name
    assert httpx.get(url + "/nowhere").json()["error"]["message"]


def test_api_key_is_checked_on_every_request(tiny_models):
    llm = LLM(str(tiny_models("llama")), num_blocks=65)
    with serve_in_thread(create_app(llm, api_key="s3cret", model_name=MODEL)) as url:
        with pytest.raises(openai.AuthenticationError):
            client(url).models.list()
        r = httpx.get(url + "/metrics")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["WWW-Authenticate"].startswith("Bearer")  # RFC 7235: a 401 names its scheme
        c = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.usage.completion_tokens <= 2


def test_serve_cli_help_and_one_line_error():
    from click.testing import CliRunner

    from macinfer.cli.main import main

    r = CliRunner().invoke(main, ["serve", "--help"])
    assert r.exit_code == 0 and "macinfer serve ./my-mlx-model" in r.output
    r = CliRunner().invoke(main, ["serve", "/no/such/model", "--port", "0"])
    assert r.exit_code != 0 and "no such model" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_oversized_body_is_refused_before_it_is_read(served):
    """A 9 MB body gets OpenAI's error body with 413 at once (it used to stall the server while parsed),
    counted in the metrics, and the server keeps serving."""
    url = served[0]
    body = b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "' + b"x" * (9 << 20) + b'"}]}'
    r = httpx.post(url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and "at most 8,388,608" in err["message"]
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert 'macinfer_request_errors_total{status="413"} 1.0' in httpx.get(url + "/metrics", timeout=10).text
