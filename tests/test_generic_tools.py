"""The generic tool format, for templates without tool calling (llama.cpp's generic handler's shape):
the reply is one JSON object, a call or a response, and what the server returns is that JSON read
back (json.loads of the reply's own text is the oracle)."""

import json

import httpx2 as httpx
import jsonschema
import pytest

from macinfer.chat.request import ChatRequest, prepare
from macinfer.llm import LLM
from macinfer.serve.server import create_app, serve_in_thread

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": PARAMS}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tiny_models):
    llm = LLM(str(tiny_models("llama")), num_blocks=128)
    with serve_in_thread(create_app(llm, model_name="m")) as url:
        yield url, llm


def post(url, body):
    r = httpx.post(url + "/v1/chat/completions", json={"model": "m", **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json() if not body.get("stream") else \
        [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("lean", ["t", "r"], ids=["call", "response"])
def test_auto_replies_are_a_call_or_a_response_read_back_from_the_json(served, seed, lean):
    url, llm = served
    # Lean the model to "tool_call" (tokens starting with t: it picks "response" by itself), and to short strings.
    bias = {str(i): 30 for t, i in llm.tokenizer.get_vocab().items() if t.startswith(lean) and lean == "t"}
    bias[str(llm.tokenizer.encode('"')[0])] = 4
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 120, "temperature": 1.0, "seed": seed,
            "return_token_ids": True, "logit_bias": bias}
    choice = post(url, body)["choices"][0]
    raw = json.loads(llm.tokenizer.decode(choice["token_ids"]))
    assert ("tool_call" if lean == "t" else "response") in raw
    message = choice["message"]
    if "tool_call" in raw:
        (call,) = message["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and message["content"] is None
        assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == \
            (raw["tool_call"]["name"], raw["tool_call"]["arguments"])
        jsonschema.validate(raw["tool_call"]["arguments"], PARAMS)
    else:
        assert message["content"] == raw["response"] and "tool_calls" not in message
    chunks = post(url, {**body, "stream": True})
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    args = "".join(tc["function"].get("arguments") or "" for c in chunks if c["choices"]
                   for tc in c["choices"][0]["delta"].get("tool_calls") or [])
    if "tool_call" in raw:
        assert json.loads(args) == raw["tool_call"]["arguments"] and not content
    else:
        assert content == raw["response"] and not args


def test_a_conversation_with_calls_renders_them_as_the_json_the_model_writes(served):
    _, llm = served
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    prompt = llm.tokenizer.decode(prepare(llm.tokenizer, ChatRequest(history, tools=TOOLS)).prompt_ids)
    assert '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}' in prompt
    assert '{"tool_response": {"tool_call_id": "call_1", "content": "sunny"}}' in prompt
    assert '"name": "get_weather", "description": "The weather in a city"' in prompt  # the tools, described
