"""Structured output through the server with the official openai client: response_format
json_schema (strict) and json_object, the guided_* extensions, and a 400 for bad ones; on a tiny
random model and on the embedded SmolLM2, 20 seeds each at temperature 1."""

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from test_grammar import MAX_TOKENS, SCHEMA

from macinfer.llm import LLM
from macinfer.serve.server import create_app, serve_in_thread

RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a user as JSON with name, age, role, ok and tags."}]


@pytest.fixture(scope="module")
def tiny_url(tiny_models):
    with serve_in_thread(create_app(LLM(str(tiny_models("llama"))), model_name="tiny")) as url:
        yield url


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def twenty_seeds(url: str, model: str, **kw) -> list:
    """20 concurrent chat completions with response_format json_schema, seeds 0..19, temperature 1."""
    async def main():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(c.chat.completions.create(
                model=model, messages=MESSAGES, temperature=1.0, seed=s, max_tokens=MAX_TOKENS,
                response_format=RESPONSE_FORMAT, **kw) for s in range(20)))

    return asyncio.run(main())


def assert_all_valid(responses) -> None:
    for s, r in enumerate(responses):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (s, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_schema_strict_20_seeds_tiny(tiny_url):
    responses = twenty_seeds(tiny_url, "tiny")
    assert_all_valid(responses)
    assert len({r.choices[0].message.content for r in responses}) > 10


def test_json_schema_streamed_is_the_same_text(tiny_url):
    c = client(tiny_url)
    kw = dict(model="tiny", messages=MESSAGES, temperature=1.0, seed=7, max_tokens=MAX_TOKENS,
              response_format=RESPONSE_FORMAT)
    whole = c.chat.completions.create(**kw).choices[0].message.content
    chunks = list(c.chat.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == whole
    jsonschema.validate(json.loads(whole), SCHEMA)


def test_json_object_and_guided_extensions(tiny_url):
    c = client(tiny_url)
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=300,
                                  response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # any object is unbounded: it may run out of tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    r = c.completions.create(model="tiny", prompt="Code:", max_tokens=20, temperature=1.0, seed=3,
                             extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{4}"})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}", r.choices[0].text)
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=1.0, seed=4,
                                  extra_body={"guided_choice": ["positive", "negative"]})
    assert r.choices[0].message.content in ("positive", "negative") and r.choices[0].finish_reason == "stop"
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=5,
                                  extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                  response_format={"type": "text"})
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_bad_structured_output_is_a_400_naming_the_field(tiny_url, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client(tiny_url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, extra_body=body)
    err = e.value.body
    assert err["param"] == param, err
    assert "\n" not in err["message"]


@pytest.mark.slow
def test_json_schema_strict_20_seeds_embedded_model():
    with serve_in_thread(create_app(LLM(), model_name="smollm2")) as url:
        assert_all_valid(twenty_seeds(url, "smollm2"))
