"""The OpenAI API surface clients expect from `macinfer serve`: unknown fields, logprobs,
penalties and logit_bias, n > 1, tool calls; each checked against mlx-lm or a solo run."""

import httpx2 as httpx
import openai
import pytest

from macinfer.llm import LLM
from macinfer.serve.server import create_app, serve_in_thread

MODEL = "tiny-llama"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def served(tiny_models):
    """(base url, LLM, app, model path) for a tiny llama served on a free loopback port."""
    path = tiny_models("llama")
    llm = LLM(str(path), num_blocks=129)
    app = create_app(llm, model_name=MODEL)
    with serve_in_thread(app) as url:
        yield url, llm, app, path


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


# -- unknown fields -------------------------------------------------------------------------
@pytest.mark.parametrize("route, body", [
    ("chat/completions", {**CHAT, "max_token": 5}),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "max_token": 5}),
])
def test_unknown_field_is_a_400_naming_it(served, route, body):
    r = httpx.post(f"{served[0]}/v1/{route}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_token" and err["code"] == "unknown_parameter"
    assert "max_token" in err["message"] and "--lenient" in err["message"]


def test_lenient_server_ignores_unknown_fields_and_keeps_known_ones(served):
    url, _, app, _ = served
    body = {**CHAT, "max_token": 5, "response_format": {"type": "text"}, "metadata": {"a": "b"}}
    app.state.server.lenient = True
    try:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    finally:
        app.state.server.lenient = False
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2  # max_tokens still applies
    # Nested objects keep their extra fields (a message's `name`), strict or not.
    body = {**CHAT, "messages": [{"role": "user", "content": "hi", "name": "me"}]}
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200


def test_serve_cli_has_lenient_flag():
    from click.testing import CliRunner

    from macinfer.cli.main import main

    r = CliRunner().invoke(main, ["serve", "--help"])
    assert r.exit_code == 0 and "--lenient" in r.output
