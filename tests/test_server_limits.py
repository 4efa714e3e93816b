"""What `macinfer serve` refuses before a request reaches the engine, and what must not stall it:
chunked bodies over the size limit (413), a full waiting queue (429 + Retry-After), the API key
(an empty one, the scheme word's case, an open /health), and tokenising off the event loop."""

import json
import socket
import threading
import time

import httpx2 as httpx
import openai
import pytest
from click.testing import CliRunner

from macinfer.errors import MacinferError
from macinfer.llm import LLM
from macinfer.serve.server import create_app, serve_in_thread

MODEL = "tiny-llama"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def errors_counted(url: str, status: int) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f'macinfer_request_errors_total{{status="{status}"}}'):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models("llama")), num_blocks=65, max_num_seqs=1)


@pytest.fixture(scope="module")
def served(llm):
    app = create_app(llm, model_name=MODEL, max_queue=1, max_body_bytes=1 << 20)
    with serve_in_thread(app) as url:
        yield url, app


def test_chunked_body_over_the_limit_gets_413(served):
    """No Content-Length, so only the bytes read can tell (it used to be read whole, then tokenised)."""
    url, _ = served

    def body():  # a generator: httpx sends it chunked
        yield b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "'
        for _ in range(3):
            yield b"x" * (1 << 19)
        yield b'"}]}'

    r = httpx.post(url + "/v1/chat/completions", content=body(), headers={"Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code == 413, r.text
    assert "transfer-encoding" in r.request.headers and "content-length" not in r.request.headers
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and "at most 1,048,576 bytes" in err["message"]
    assert errors_counted(url, 413) == 1
    small = httpx.post(url + "/v1/chat/completions", content=(b'{"model": "tiny-llama", "max_tokens": 2, '
                       b'"messages": [{"role": "user", "content": "hi"}]}' for _ in range(1)),
                       headers={"Content-Type": "application/json"}, timeout=30)
    assert small.status_code == 200, small.text


def test_full_queue_gets_429_with_retry_after(served, llm, monkeypatch):
    """max_num_seqs 1 + max_queue 1: with two requests in (the engine held still), a third is refused."""
    url, app = served
    aengine = app.state.server.engine
    gate, step = threading.Event(), llm.engine.step
    monkeypatch.setattr(aengine, "on_step", lambda dt, deltas: time.sleep(0.2) if any(d.finish_reason == "abort" for d in deltas) else None)
    # Each step waits for the gate, then 10 ms: 480 tokens take seconds, so a loaded host's event loop
    # still sees the hang-up long before the request could end on its own.
    monkeypatch.setattr(llm.engine, "step", lambda: (gate.wait(30), time.sleep(0.01), step())[2])
    results = []
    threads = [threading.Thread(target=lambda: results.append(httpx.post(url + "/v1/chat/completions", json=CHAT,
                                                                         timeout=60)))
               for _ in range(2)]
    try:
        for t in threads:
            t.start()
        while aengine.num_active < 2 and all(t.is_alive() for t in threads):
            threading.Event().wait(0.01)
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["code"] == "queue_full" and "--max-queue" in err["message"] and err["type"] == "server_error"
        assert errors_counted(url, 429) == 1
    finally:
        gate.set()
        for t in threads:
            t.join(60)
    assert [x.status_code for x in results] == [200, 200]
    assert llm.engine.kv_stats()["used_blocks"] == 0


def test_tokenising_runs_off_the_event_loop(served, llm, monkeypatch):
    """While one prompt is being tokenised (a stub that blocks until released), /health and other
    requests are answered: the tokeniser runs on a worker thread, not on the event loop."""
    url, _ = served
    entered, release, encode = threading.Event(), threading.Event(), llm.encode

    def slow_encode(prompt):
        if prompt == "BLOCK":
            entered.set()
            release.wait(30)
        return encode(prompt)

    monkeypatch.setattr(llm, "encode", slow_encode)
    slow = []
    t = threading.Thread(target=lambda: slow.append(httpx.post(
        url + "/v1/completions", json={"model": MODEL, "prompt": "BLOCK", "max_tokens": 2}, timeout=60)))
    t.start()
    try:
        assert entered.wait(30)
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
        other = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3,
                                                          "temperature": 0}, timeout=10)
        assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] >= 1
        assert t.is_alive()  # still tokenising
    finally:
        release.set()
        t.join(60)
    assert slow[0].status_code == 200, slow[0].text


def test_non_streaming_client_that_leaves_aborts_its_request(served, llm, monkeypatch):
    """The client sends a long non-streaming request and hangs up. Tokens then flow without a pause,
    so the disconnect must be noticed between them (it used to be checked only after 0.5 s without
    a token, and BaseHTTPMiddleware hid it anyway): the request is aborted and its blocks freed."""
    url, app = served
    aengine = app.state.server.engine
    aborted = aengine.num_aborted
    gate, step = threading.Event(), llm.engine.step
    monkeypatch.setattr(aengine, "on_step", lambda dt, deltas: time.sleep(0.2) if any(d.finish_reason == "abort" for d in deltas) else None)
    # Each step waits for the gate, then 10 ms: 480 tokens take seconds, so a loaded host's event loop
    # still sees the hang-up long before the request could end on its own.
    monkeypatch.setattr(llm.engine, "step", lambda: (gate.wait(30), time.sleep(0.01), step())[2])
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        # The request must be in the engine (its first step held at the gate) before the hang-up:
        # a hang-up before that leaves nothing to abort.
        deadline = time.monotonic() + 30
        while not llm.engine.has_unfinished() and time.monotonic() < deadline:
            threading.Event().wait(0.01)
    gate.set()  # the client is gone: now let the engine run
    # NOTE: the engine thread counts the abort just after the step that emitted it, by which time the
    # engine may already be idle: wait for the count itself (the request alone would take > 4.8 s).
    deadline = time.monotonic() + 30
    while (aengine.num_aborted == aborted or llm.engine.has_unfinished()) and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    assert aengine.num_aborted == aborted + 1 and aengine.num_active == 0
    assert llm.engine.kv_stats()["used_blocks"] == 0


def test_too_many_stop_strings_is_a_400_naming_stop(served):
    r = httpx.post(served[0] + "/v1/chat/completions", json={**CHAT, "stop": ["x"] * 17}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text


def test_api_key_scheme_health_and_empty_key(tiny_models):
    # An LLM of its own: the module's `served` server still steps the module's one.
    llm = LLM(str(tiny_models("llama")), num_blocks=65, max_num_seqs=1)
    with pytest.raises(MacinferError, match="--api-key is empty"):
        create_app(llm, api_key="")
    with serve_in_thread(create_app(llm, api_key="s3cret", model_name=MODEL)) as url:
        assert httpx.get(url + "/health", timeout=10).status_code == 200  # open by default
        for header in ("bearer s3cret", "BEARER  s3cret", "Bearer s3cret"):
            r = httpx.get(url + "/v1/models", headers={"Authorization": header}, timeout=10)
            assert r.status_code == 200, header
        for header in ("Bearer s3cre", "Basic s3cret", "s3cret", ""):
            assert httpx.get(url + "/v1/models", headers={"Authorization": header}, timeout=10).status_code == 401
        c = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert c.chat.completions.create(model=MODEL, **{k: v for k, v in CHAT.items() if k != "model"}).choices
    with serve_in_thread(create_app(llm, api_key="s3cret", model_name=MODEL, health_auth=True)) as url:
        assert httpx.get(url + "/health", timeout=10).status_code == 401
        assert httpx.get(url + "/health", headers={"Authorization": "Bearer s3cret"}, timeout=10).status_code == 200


def test_serve_cli_refuses_an_empty_key_before_loading():
    from macinfer.cli.main import main

    r = CliRunner().invoke(main, ["serve", "/no/such/model", "--api-key", ""])
    assert r.exit_code != 0 and "--api-key is empty" in r.output and "no such model" not in r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output
