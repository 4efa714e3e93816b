"""The OpenAI API surface clients expect from `macinfer serve`: unknown fields, logprobs,
penalties and logit_bias, n > 1, tool calls; each checked against mlx-lm or a solo run."""

import json

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


# -- logprobs and penalties -------------------------------------------------------------------
def oracle(path, prompt_ids, n, **penalties):
    """mlx-lm's greedy tokens and (V,) logprobs for the prompt, with its processors for `penalties`."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors
    from oracle import mlx_lm_load

    model, _ = mlx_lm_load(str(path))
    procs = make_logits_processors(penalties.get("logit_bias"), penalties.get("repetition_penalty"), 20,
                                   penalties.get("presence_penalty"), 20, penalties.get("frequency_penalty"), 20)
    return [(int(t), lp) for t, lp in generate_step(mx.array(prompt_ids), model, max_tokens=n, logits_processors=procs)]


def top(lp, k):
    import mlx.core as mx

    return [(i, lp[i].item()) for i in mx.argsort(-lp).tolist()[:k]]


def test_chat_logprobs_streamed_and_whole_are_mlx_lm_log_softmax(served):
    from oracle import mlx_lm_load

    url, llm, _, path = served
    _, tok = mlx_lm_load(str(path))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    r = client(url).chat.completions.create(**kw)
    want = oracle(path, tok.apply_chat_template(messages, add_generation_prompt=True), 8)
    assert r.choices[0].model_extra["token_ids"] == [t for t, _ in want]
    content = r.choices[0].logprobs.content
    assert len(content) == len(want)
    for item, (t, lp) in zip(content, want):
        assert item.token == tok.decode([t]) and item.bytes == list(item.token.encode())
        assert item.logprob == pytest.approx(lp[t].item(), abs=1e-4)
        assert [(x.token, x.logprob) for x in item.top_logprobs] == [
            (tok.decode([i]), pytest.approx(v, abs=1e-4)) for i, v in top(lp, 3)]
    chunks = list(client(url).chat.completions.create(stream=True, **kw))
    streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    # (the second run starts from the prefix cache: the same numbers to float rounding)
    assert [(x.token, x.logprob, len(x.top_logprobs)) for x in streamed] == [
        (x.token, pytest.approx(x.logprob, abs=1e-4), 3) for x in content]


def test_completion_logprobs_in_the_legacy_shape(served):
    from oracle import mlx_lm_load

    url, llm, _, path = served
    _, tok = mlx_lm_load(str(path))
    prompt = "Paged attention stores"
    r = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
                                       extra_body={"ignore_eos": True})
    want = oracle(path, tok.encode(prompt), 6)
    lp = r.choices[0].logprobs
    assert lp.tokens == [tok.decode([t]) for t, _ in want]
    assert lp.token_logprobs == pytest.approx([v[t].item() for t, v in want], abs=1e-4)
    # (a dict: two byte pieces that both decode to U+FFFD share a key)
    assert [list(d) for d in lp.top_logprobs] == [list(dict.fromkeys(tok.decode([i]) for i, _ in top(v, 2)))
                                                  for _, v in want]
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert "".join(lp.tokens) == r.choices[0].text


def test_penalties_and_logit_bias_through_the_api_are_mlx_lm_processors(served):
    from oracle import mlx_lm_load

    url, llm, _, path = served
    _, tok = mlx_lm_load(str(path))
    prompt = "The quick brown fox"
    pen = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.4}
    r = client(url).completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, presence_penalty=0.5, frequency_penalty=0.4,
        logit_bias={"5": 3, "7": -100}, extra_body={"repetition_penalty": 1.3, "return_token_ids": True,
                                                     "ignore_eos": True})
    got = r.choices[0].model_extra["token_ids"]
    assert got == [t for t, _ in oracle(path, tok.encode(prompt), 16, logit_bias={5: 3.0, 7: -100.0}, **pen)]
    assert got != [t for t, _ in oracle(path, tok.encode(prompt), 16)]


# -- n > 1 ------------------------------------------------------------------------------------
def test_n_choices_each_equal_a_solo_request_with_seed_plus_i(served):
    url, llm, app, _ = served
    c = client(url)
    kw = dict(model=MODEL, max_tokens=10, temperature=0.9, extra_body={"return_token_ids": True, "ignore_eos": True})
    messages = [{"role": "user", "content": "Tell me about paged attention and continuous batching."}]
    r = c.chat.completions.create(messages=messages, n=3, seed=11, logprobs=True, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    solo = [c.chat.completions.create(messages=messages, seed=11 + i, **kw).choices[0].model_extra["token_ids"]
            for i in range(3)]
    assert [ch.model_extra["token_ids"] for ch in r.choices] == solo
    assert len({tuple(s) for s in solo}) > 1
    assert all(len(ch.logprobs.content) == 10 for ch in r.choices)
    assert r.usage.completion_tokens == 30
    # Streamed: the chunks of the three choices interleave; each choice's tokens are its own.
    got = {0: [], 1: [], 2: []}
    finish = {}
    for ch in c.chat.completions.create(messages=messages, n=3, seed=11, stream=True, **kw):
        for choice in ch.choices:
            got[choice.index] += choice.model_extra.get("token_ids", [])
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert [got[i] for i in range(3)] == solo and finish == {0: "length", 1: "length", 2: "length"}
    assert not llm.engine.requests and llm.engine.kv_stats()["used_blocks"] == 0


# -- tool calls -------------------------------------------------------------------------------
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def tool_served(tiny_models):
    """A tiny model whose chat template has tool calling and whose vocabulary holds CALL as one token."""
    path = tiny_models("llama", tool_call=CALL)
    llm = LLM(str(path), num_blocks=65)
    with serve_in_thread(create_app(llm, model_name=MODEL)) as url:
        yield url, llm, path


def forced_call(llm):
    """Greedy output forced to CALL then EOS: CALL is biased up, EOS a little less; once CALL is the
    last token, a repetition penalty over the last token halves its logit, and EOS wins."""
    call = llm.tokenizer.convert_tokens_to_ids(CALL)
    (eos,) = llm.tokenizer.eos_token_ids
    return dict(temperature=0, max_tokens=4, logit_bias={str(call): 100, str(eos): 95},
                extra_body={"repetition_penalty": 2.0, "repetition_context_size": 1})


def test_tool_call_round_trip_with_the_openai_sdk(tool_served):
    from oracle import mlx_lm_load

    url, llm, path = tool_served
    c = client(url)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, **forced_call(llm))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"} and call.id
    # The result goes back: the assistant's call (arguments as JSON text) and the tool's answer,
    # rendered by the chat template with the arguments as an object.
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r2 = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=3, temperature=0)
    assert r2.choices[0].finish_reason in ("length", "stop")
    _, tok = mlx_lm_load(str(path))
    rendered = [messages[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        messages[2]]
    assert r2.usage.prompt_tokens == len(tok.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True))


def test_tool_calls_stream_as_deltas(tool_served):
    url, llm, _ = tool_served
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    stream = client(url).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, stream=True,
                                                 **forced_call(llm))
    calls, content, finish = [], "", None
    for ch in stream:
        d = ch.choices[0].delta
        content += d.content or ""
        calls += d.tool_calls or []
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    (call,) = calls
    assert call.index == 0 and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_tool_choice_none_renders_and_parses_no_tools(tool_served):
    url, llm, path = tool_served
    from oracle import mlx_lm_load

    body = {**CHAT, "tools": TOOLS, "tool_choice": "none", **{k: v for k, v in forced_call(llm).items()
                                                              if k != "extra_body"}, **forced_call(llm)["extra_body"]}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200
    message = r.json()["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"] == CALL  # the call's text, as text
    _, tok = mlx_lm_load(str(path))
    assert r.json()["usage"]["prompt_tokens"] == len(tok.apply_chat_template(CHAT["messages"], add_generation_prompt=True))


def test_logit_bias_outside_the_vocabulary_is_a_400(served):
    r = httpx.post(served[0] + "/v1/chat/completions", json={**CHAT, "logit_bias": {"100000": 5}}, timeout=30)
    assert r.status_code == 400 and "logit_bias names token 100000" in r.json()["error"]["message"]
