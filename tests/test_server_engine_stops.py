"""The engine stopping in the middle of a reply (a bug or out of memory in its thread), through each
protocol's official client: a reply not streamed is a 503 in the protocol's error shape, a streamed
one ends with the protocol's own error event, which the client raises (openai, anthropic, ollama)
or reads as the response failing (the Responses API's `response.failed`).

The engine is stopped by its step raising once the reply's first tokens are out.
"""

from __future__ import annotations

import anthropic
import ollama
import openai
import pytest

from macinfer.llm import LLM
from macinfer.serve.server import create_app, serve_in_thread

FAULT = "simulated fault in the engine"
MESSAGES = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]


@pytest.fixture
def url(tiny_models):
    """A server whose engine stops at its third step: the reply has begun by then."""
    llm = LLM(str(tiny_models("llama")), num_blocks=65)
    step, calls = llm.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) >= 3:
            raise RuntimeError(FAULT)
        return step()

    llm.engine.step = failing_step
    with serve_in_thread(create_app(llm, model_name="tiny")) as u:
        yield u
    assert len(calls) >= 3  # it did stop mid-reply


def _says_it(e: Exception) -> None:
    assert "the engine stopped" in str(e) and FAULT in str(e), str(e)


def test_chat_completions(url):
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as e:
        c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=64, temperature=0)
    assert e.value.status_code == 503 and e.value.body["code"] == "engine_unavailable"
    _says_it(e.value)


def test_chat_completions_streamed(url):
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    got = []
    with pytest.raises(openai.APIError) as e:
        for chunk in c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=64, temperature=0,
                                               stream=True):
            got.append(chunk)
    assert got  # the reply had begun
    _says_it(e.value)


def test_responses(url):
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as e:
        c.responses.create(model="tiny", input="Tell me a long story.", max_output_tokens=64, temperature=0)
    assert e.value.status_code == 503
    _says_it(e.value)


def test_responses_streamed(url):
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    events = list(c.responses.create(model="tiny", input="Tell me a long story.", max_output_tokens=64,
                                     temperature=0, stream=True))
    kinds = [ev.type for ev in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.failed"
    assert "response.output_text.delta" in kinds  # the reply had begun
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    _says_it(Exception(failed.error.message))


def test_anthropic_messages(url):
    c = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(anthropic.APIStatusError) as e:
        c.messages.create(model="tiny", max_tokens=64, messages=MESSAGES)
    assert e.value.status_code == 503 and e.value.body["type"] == "error"
    _says_it(e.value)


def test_anthropic_messages_streamed(url):
    c = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)
    kinds = []
    with pytest.raises(anthropic.APIStatusError) as e:
        # Greedy (this SDK takes temperature in the body only), as the other protocols' tests: sampled,
        # the two tokens before the fault decoded to no text 2 times in 25, and no delta came first.
        with c.messages.stream(model="tiny", max_tokens=64, messages=MESSAGES,
                               extra_body={"temperature": 0}) as stream:
            for ev in stream:
                kinds.append(ev.type)
    assert "content_block_delta" in kinds or "text" in kinds  # the reply had begun
    assert e.value.body["error"]["type"] == "overloaded_error"
    _says_it(e.value)


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_chat(url, stream):
    c = ollama.Client(host=url, timeout=60)
    got = []
    with pytest.raises(ollama.ResponseError) as e:
        reply = c.chat(model="tiny", messages=MESSAGES, stream=stream, options={"temperature": 0, "num_predict": 64})
        for part in (reply if stream else [reply]):
            got.append(part)
    if stream:
        assert got  # the reply had begun
    else:
        assert e.value.status_code == 503
    _says_it(e.value)
