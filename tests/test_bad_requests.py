"""Bad requests the issue-42 probe found accepted or badly reported (scripts/probe_server.py runs all 48):
each is a 400 naming the field as OpenAI names it, with a `code`, and the server serves on."""

import httpx2 as httpx
import openai
import pytest

from macinfer.core.sampling_params import SamplingParams
from macinfer.llm import LLM
from macinfer.serve.server import create_app, serve_in_thread

MODEL = "tiny-llama"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def url(tiny_models):
    app = create_app(LLM(str(tiny_models("llama")), num_blocks=65), model_name=MODEL)
    with serve_in_thread(app) as u:
        yield u


def error_of(url: str, body) -> dict:
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(url + "/v1/chat/completions", timeout=60, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and err["code"] and "Traceback" not in r.text
    return err


@pytest.mark.parametrize("extra,param", [
    ({"temperature": 1e9}, "temperature"),                  # OpenAI's range is 0-2: gibberish beyond
    ({"stream": "yes"}, "stream"),                           # a string is not coerced to a bool
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # only with stream: true
    ({"stop": "x" * 100_000}, "stop"),                       # one stop string is capped as a list is
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_out_of_range_or_mistyped_values_are_refused(url, extra, param):
    assert error_of(url, {"model": MODEL, "messages": HI, "max_tokens": 2, **extra})["param"] == param


def test_param_is_named_as_openai_names_it(url):
    assert error_of(url, {"messages": [{"role": "user", "content": 5}]})["param"] == "messages[0].content"
    assert error_of(url, {"messages": [{"role": "wizard", "content": "x"}]})["param"] == "messages[0].role"


@pytest.mark.parametrize("body", [b'{"messages": "\xff\xfe"}', b"[" * 100_000 + b"]" * 100_000],
                         ids=["invalid-utf8", "nested-100000-deep"])
def test_unparsable_bodies_get_a_code(url, body):
    assert error_of(url, body)["code"] == "invalid_json"


def test_a_schema_that_admits_no_reply_is_a_400_naming_response_format(url):
    c = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "loop", "schema": {"$ref": "#"}}})
    assert e.value.body["param"] == "response_format" and "admits no reply" in e.value.body["message"]
    r = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)  # the server serves on
    assert r.choices[0].finish_reason in ("length", "stop")


def test_the_shared_checks_hold_outside_the_server_too():
    with pytest.raises(ValueError, match="temperature must be a number from 0 to 2"):
        SamplingParams(temperature=2.5)
    with pytest.raises(ValueError, match="stop holds a string of 1,001 characters"):
        SamplingParams(stop="x" * 1001)
    assert SamplingParams(temperature=2.0, stop="x" * 1000).stop == ["x" * 1000]
