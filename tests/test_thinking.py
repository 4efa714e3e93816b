"""Models that think and call tools, through `macinfer serve`: the thought apart from the answer,
tool calls after it, forced calls and response formats held after it, and the bad requests.

Tiny random models carry the real families' templates and special tokens (tests/families.py):
Qwen3 (`<think>`, Hermes tool calls), DeepSeek-R1-Distill (the prompt opens the thought; tools in
the generic format) and gpt-oss (harmony). A random model writes no thought by itself, so the
split tests force the reply's shape with a guided_grammar and compare our split with the oracle's
for the same tokens: mlx-lm's own server (replayed, tests/oracle.py) for the `<think>` families,
openai-harmony's whole-completion parser for gpt-oss.
"""

import json

import httpx2 as httpx
import jsonschema
import pytest
from families import build_family_model, write_o200k
from oracle import mlx_lm_load, mlx_lm_server_reply

from macinfer.llm import LLM
from macinfer.serve.server import create_app, serve_in_thread

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": PARAMS}}]
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


@pytest.fixture(scope="module", autouse=True)
def harmony_vocabulary(tmp_path_factory):
    """openai-harmony reads its o200k file from here (nothing downloads)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TIKTOKEN_ENCODINGS_BASE", str(write_o200k(tmp_path_factory.mktemp("tiktoken")).parent))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """family("qwen3") -> (base url, model path, token ids by name), one server per family."""
    served, stack = {}, []

    def get(name):
        if name not in served:
            path = build_family_model(tmp_path_factory.mktemp(name), name)
            server = serve_in_thread(create_app(LLM(str(path), num_blocks=256), model_name="m"))
            stack.append(server)
            _, tok = mlx_lm_load(str(path))
            served[name] = (server.__enter__(), path, tok.get_vocab())
        return served[name]

    yield get
    for server in stack:
        server.__exit__(None, None, None)


def post(url, body):
    return httpx.post(url + "/v1/chat/completions", json={"model": "m", **body}, timeout=120)


def streamed(url, body) -> list[dict]:
    r = post(url, {**body, "stream": True})
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def joined(chunks: list[dict], key: str) -> str | None:
    text = "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])
    return text or None


def stream_calls(chunks: list[dict]) -> list[tuple[str, dict]]:
    """Tool calls from streamed deltas, joined by index as OpenAI's SDK joins them."""
    calls: dict[int, list] = {}
    for c in chunks:
        for i, tc in enumerate((c["choices"][0]["delta"].get("tool_calls") or []) if c["choices"] else []):
            entry = calls.setdefault(tc.get("index", len(calls)), ["", ""])
            entry[0] += tc["function"].get("name") or ""
            entry[1] += tc["function"].get("arguments") or ""
    return [(name, json.loads(args)) for _, (name, args) in sorted(calls.items())]


def message_calls(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]


# -- thought and answer apart, as mlx-lm's server splits the same tokens ----------------------------
def shape(vocab, family_name: str, call: bool) -> str:
    """A guided_grammar forcing a thought, then an answer or a tool call (random text in each)."""
    think, end = f"<[{vocab['<think>']}]>", f"<[{vocab['</think>']}]>"
    opened = "" if family_name == "r1_distill" else think  # R1's prompt opens the thought itself
    if call:
        tc, tce = vocab["<tool_call>"], vocab["</tool_call>"]
        body = (f'<[{tc}]> "\\n{{\\"name\\": \\"get_weather\\", \\"arguments\\": {{\\"city\\": \\"" /[a-z]{{1,8}}/ '
                f'"\\"}}}}\\n" <[{tce}]>')
    else:
        body = '/[a-z][a-z ]{1,12}/'
    return f'start: {opened} /[a-z ]{{3,16}}/ {end} "\\n\\n" {body}'


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name, call", [("qwen3", False), ("qwen3", True), ("r1_distill", False)])
def test_thought_and_answer_apart_as_mlx_lm_server_splits_them(family, name, call, stream):
    url, path, vocab = family(name)
    body = {"messages": MESSAGES, "max_tokens": 120, "temperature": 1.0, "seed": 5,
            **({"tools": TOOLS} if call else {})}
    ours = {**body, "guided_grammar": shape(vocab, name, call), "return_token_ids": True}
    if stream:
        chunks = streamed(url, ours)
        tokens = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids", [])]
        finish = next(c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
        got = (joined(chunks, "reasoning_content"), joined(chunks, "content"), stream_calls(chunks))
        assert joined(chunks, "reasoning") == got[0]
    else:
        r = post(url, ours)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        tokens, finish, m = choice["token_ids"], choice["finish_reason"], choice["message"]
        got = (m.get("reasoning_content"), m["content"] or None, message_calls(m))
        assert m.get("reasoning") == got[0]
        end = tokens.index(vocab["</think>"]) + 1
        assert r.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] == end
    assert finish == ("tool_calls" if call else "stop")
    oracle = mlx_lm_server_reply(path, {**body, "stream": stream}, tokens, "stop")
    if stream:
        want = (joined(oracle, "reasoning"), joined(oracle, "content"), stream_calls(oracle))
    else:
        m = oracle["choices"][0]["message"]
        want = (m.get("reasoning"), m["content"] or None, message_calls(m))
    assert got == want
    assert got[0] and (got[2] if call else got[1])  # a thought, and an answer or a call


def test_enable_thinking_false_renders_without_a_thought(family):
    url, path, vocab = family("qwen3")
    body = {"messages": MESSAGES, "max_tokens": 20, "temperature": 1.0, "seed": 2,
            "chat_template_kwargs": {"enable_thinking": False}}
    r = post(url, {**body, "guided_grammar": "start: /[a-z ]{4,12}/", "return_token_ids": True})
    _, tok = mlx_lm_load(str(path))
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, enable_thinking=False)
    assert tok.decode(prompt).endswith("<think>\n\n</think>\n\n")
    choice = r.json()["choices"][0]
    assert r.json()["usage"]["prompt_tokens"] == len(prompt)
    assert "reasoning_content" not in choice["message"] and choice["message"]["content"]
    oracle = mlx_lm_server_reply(path, body, choice["token_ids"], "stop")["choices"][0]["message"]
    assert oracle.get("reasoning") is None and oracle["content"] == choice["message"]["content"]


# -- forced tool calls and response formats start after the thought ---------------------------------
@pytest.mark.parametrize("name", ["qwen3", "r1_distill", "gpt_oss"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_call_after_the_thought(family, name, choice):
    url, _, vocab = family(name)
    end = vocab["<|end|>" if name == "gpt_oss" else "</think>"]
    for seed in range(3):
        body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False,
                "max_tokens": 200, "temperature": 1.0, "seed": seed, "logit_bias": {str(end): 6}}  # short thoughts
        for chunks in (None, streamed(url, body)):
            if chunks is None:
                r = post(url, body)
                assert r.status_code == 200, r.text
                message, finish = r.json()["choices"][0]["message"], r.json()["choices"][0]["finish_reason"]
                calls, thought = message_calls(message), message.get("reasoning_content") or ""
            else:
                finish = chunks[-1]["choices"][0]["finish_reason"]
                calls, thought = stream_calls(chunks), joined(chunks, "reasoning_content") or ""
            assert finish == "tool_calls" and len(calls) == 1, (seed, calls)
            fn, args = calls[0]
            assert fn == "get_weather" and "<" not in thought
            jsonschema.validate(args, PARAMS)


@pytest.mark.parametrize("name", ["qwen3", "r1_distill", "gpt_oss"])
def test_response_format_after_the_thought(family, name):
    url, _, vocab = family(name)
    end = vocab["<|end|>" if name == "gpt_oss" else "</think>"]
    for rf in ({"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER, "strict": True}},
               {"type": "json_object", "schema": ANSWER}):
        r = post(url, {"messages": MESSAGES, "response_format": rf, "max_tokens": 200, "temperature": 1.0, "seed": 1,
                       "logit_bias": {str(end): 6}})
        message = r.json()["choices"][0]["message"]
        assert r.json()["choices"][0]["finish_reason"] == "stop", message
        jsonschema.validate(json.loads(message["content"]), ANSWER)


# -- gpt-oss: harmony's channels, as openai-harmony parses the same tokens ---------------------------
def harmony_oracle(path, tokens: list[int]):
    """openai-harmony's messages for a whole completion (our tokens' text in harmony's encoding)."""
    from openai_harmony import HarmonyEncodingName, Role, load_harmony_encoding

    _, tok = mlx_lm_load(str(path))
    enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    ids = enc.encode(tok.decode(tokens), allowed_special="all")
    return enc.parse_messages_from_completion_tokens(ids, Role.ASSISTANT)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_harmony_channels_apart_as_openai_harmony_parses_them(family, stream):
    url, path, vocab = family("gpt_oss")
    ch, msg, end, start = (vocab[t] for t in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>"))
    grammar = (f'start: <[{ch}]> "analysis" <[{msg}]> /[a-z ]{{3,16}}/ <[{end}]> <[{start}]> "assistant" '
               f'<[{ch}]> "final" <[{msg}]> /[a-z][a-z ]{{1,12}}/')
    body = {"messages": MESSAGES, "max_tokens": 60, "temperature": 1.0, "seed": 4, "guided_grammar": grammar,
            "return_token_ids": True}
    if stream:
        chunks = streamed(url, body)
        tokens = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids", [])]
        thought, content = joined(chunks, "reasoning_content"), joined(chunks, "content")
    else:
        choice = post(url, body).json()["choices"][0]
        tokens, thought, content = choice["token_ids"], choice["message"]["reasoning_content"], choice["message"]["content"]
    want = {m.channel: m.content[0].text for m in harmony_oracle(path, tokens)}
    assert (thought, content) == (want["analysis"], want["final"]) and thought and content


def test_harmony_tool_call_is_the_commentary_message_openai_harmony_parses(family):
    url, path, vocab = family("gpt_oss")
    r = post(url, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
                   "temperature": 1.0, "seed": 0, "logit_bias": {str(vocab["<|end|>"]): 6}, "return_token_ids": True})
    choice = r.json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    (want,) = [m for m in harmony_oracle(path, choice["token_ids"]) if m.channel == "commentary"]
    assert want.recipient == "functions." + call["function"]["name"]
    assert json.loads(call["function"]["arguments"]) == json.loads(want.content[0].text)


# -- bad requests: a 400 naming the field, the server unharmed ---------------------------------------
@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"response_format": {"type": "json_object", "schema": {"type": "nonsense"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),
])
def test_bad_tool_and_format_requests_are_400s_naming_the_field(family, extra, param):
    url, _, _ = family("qwen3")
    r = post(url, {"messages": MESSAGES, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "\n" not in err["message"], err
    assert post(url, {"messages": MESSAGES, "max_tokens": 2}).status_code == 200


# -- earlier turns: thoughts as each template reads them ---------------------------------------------
CALL_TURN = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


@pytest.mark.parametrize("name, field", [("qwen3", "reasoning_content"), ("qwen3", "reasoning"),
                                         ("gpt_oss", "reasoning_content")])
def test_an_earlier_thought_reaches_the_template(family, name, field):
    url, path, _ = family(name)
    thought = "the user wants the weather so call get weather"
    sent = [MESSAGES[0], {**CALL_TURN, field: thought}, RESULT]
    r = post(url, {"messages": sent, "tools": TOOLS, "max_tokens": 1})
    assert r.status_code == 200, r.text
    _, tok = mlx_lm_load(str(path))
    call = {**CALL_TURN, "tool_calls": [{**CALL_TURN["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}
    key = "thinking" if name == "gpt_oss" else "reasoning_content"  # what each template reads
    ids = tok.apply_chat_template([MESSAGES[0], {**call, key: thought}, RESULT], tools=TOOLS, add_generation_prompt=True)
    assert thought in tok.decode(ids)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_a_forced_call_in_a_syntax_without_a_grammar_is_a_400_naming_it(tmp_path):
    """A template mlx-lm reads as pythonic tool calls: "auto" parses them, a forced call cannot be held."""
    from tiny import CHAT_TEMPLATE, build_tiny_model

    path = build_tiny_model(tmp_path / "pythonic", tokenizer={"chat_template": CHAT_TEMPLATE + "{# <|tool_call_start|> #}"})
    with serve_in_thread(create_app(LLM(str(path), num_blocks=64), model_name="m")) as url:
        r = post(url, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "pythonic" in r.json()["error"]["message"]
        assert post(url, {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2}).status_code == 200


def test_qwen3_coder_xml_call_forced_and_read_back_by_mlx_lm_parser(family):
    """Qwen3-Coder's XML: each parameter in its own tag, read back by type (mlx-lm's qwen3_coder parser)."""
    url, _, _ = family("qwen3_coder")
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                               "unit": {"enum": ["c", "f"]}},
              "required": ["city", "days"]}
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": params}}]
    for seed in range(3):
        body = {"messages": MESSAGES, "tools": tools, "tool_choice": "required", "parallel_tool_calls": False,
                "max_tokens": 300, "temperature": 1.0, "seed": seed}
        choice = post(url, body).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        ((name, args),) = message_calls(choice["message"])
        assert name == "forecast"
        jsonschema.validate(args, params)
        assert stream_calls(streamed(url, body)) == [(name, args)]


def test_harmony_markers_split_across_deltas_are_still_markers(family):
    """A stop string makes the engine hold text back, so a marker's text can arrive in two deltas."""
    url, path, vocab = family("gpt_oss")
    ch, msg, end, start = (vocab[t] for t in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>"))
    grammar = (f'start: <[{ch}]> "analysis" <[{msg}]> /[a-z ]{{3,16}}/ <[{end}]> <[{start}]> "assistant" '
               f'<[{ch}]> "final" <[{msg}]> /[a-z][a-z ]{{1,12}}/')
    body = {"messages": MESSAGES, "max_tokens": 60, "temperature": 1.0, "seed": 4, "guided_grammar": grammar,
            "return_token_ids": True, "stop": ["zzzzzzzzzzzz"]}  # holds back 11 characters
    chunks = streamed(url, body)
    tokens = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids", [])]
    want = {m.channel: m.content[0].text for m in harmony_oracle(path, tokens)}
    assert (joined(chunks, "reasoning_content"), joined(chunks, "content")) == (want["analysis"], want["final"])
