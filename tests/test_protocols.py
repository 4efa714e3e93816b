"""OpenAI Responses, Anthropic Messages and Ollama's API on `macinfer serve`, through their official
clients (openai, anthropic, ollama), on a tiny random llama.

The oracle for a reply is the same request through chat completions, whose greedy tokens are
mlx-lm's (checked here once, and in tests/test_server.py): at temperature 0 every protocol must
say exactly what chat completions says, and render the same prompt (the same prompt tokens).
Its chat template has no tool calling, so tools take the generic JSON format, a forced call held
to the tool's schema by the grammar (jsonschema checks it).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import anthropic
import httpx2 as httpx
import jsonschema
import ollama
import openai
import pytest
from families import build_family_model
from oracle import mlx_lm_greedy, mlx_lm_load

from macinfer.llm import LLM
from macinfer.serve.model_pool import PoolOptions
from macinfer.serve.response_store import ResponseStore
from macinfer.serve.server import create_app, serve_in_thread

MODEL = "tiny"
PROMPT = "What is the capital of France? Answer in one short sentence, please."
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}
LIMIT = 1 << 16  # bytes a body may have here


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    """(url, path, app) of a tiny llama; stored responses on disk; a second model for keep_alive."""
    # 2,048 positions: the generic tool format's instructions alone take ~400 of this tokenizer's tokens
    path, other = tiny_models("llama", max_position_embeddings=2048), tiny_models("qwen2")
    store = ResponseStore(tmp_path_factory.mktemp("responses"), limit=8)
    app = create_app(LLM(str(path), num_blocks=257), model_name=MODEL, response_store=store, max_body_bytes=LIMIT,
                     models=PoolOptions(others={"other": str(other)}, load=lambda spec: LLM(spec, num_blocks=65)))
    with serve_in_thread(app) as url:
        yield url, path, app


def oai(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def claude(url, key="unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)


def llama(url) -> ollama.Client:
    return ollama.Client(host=url, timeout=60)


def chat_reply(url, messages, n, **kw):
    """The oracle: (text, prompt tokens, token ids) from chat completions at temperature 0."""
    r = oai(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=n, temperature=0,
                                         extra_body={"return_token_ids": True}, **kw)
    return r.choices[0].message.content, r.usage.prompt_tokens, r.choices[0].model_extra["token_ids"]


def test_the_oracle_is_mlx_lm(served):
    url, path, _ = served
    messages = [{"role": "user", "content": PROMPT}]
    _, tok = mlx_lm_load(str(path))
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True))
    text, prompt_tokens, token_ids = chat_reply(url, messages, 12)
    assert token_ids == mlx_lm_greedy(path, ids, 12) and prompt_tokens == len(ids)


# -- OpenAI Responses ------------------------------------------------------------------------------
def test_responses_text_streamed_and_not(served):
    url = served[0]
    want, prompt_tokens, _ = chat_reply(url, [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": PROMPT}], 12)
    kw = dict(model=MODEL, instructions="Be brief.", input=PROMPT, max_output_tokens=12, temperature=0)
    r = oai(url).responses.create(**kw)
    assert r.output_text == want and r.usage.input_tokens == prompt_tokens and r.usage.output_tokens <= 12
    assert r.status in ("completed", "incomplete") and r.id.startswith("resp_") and r.model == MODEL

    events = list(oai(url).responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if r.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == want == events[-1].response.output_text


def weather_tool() -> dict:
    return {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": CITY}


def test_responses_function_tool_round_trip_streamed_and_not(served):
    url = served[0]
    c = oai(url)
    kw = dict(model=MODEL, tools=[weather_tool()], tool_choice={"type": "function", "name": "get_weather"},
              temperature=0, max_output_tokens=200)
    r = c.responses.create(input=PROMPT, **kw)
    (call,) = [i for i in r.output if i.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), CITY)

    events = list(c.responses.create(input=PROMPT, stream=True, **kw))
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert streamed == done.arguments == call.arguments and done.name == "get_weather"

    # the result goes back; the answer is what chat completions says to the same conversation
    turn = [{"role": "user", "content": PROMPT}, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "22 C and sunny"}]
    answer = c.responses.create(model=MODEL, input=turn, tools=[weather_tool()], tool_choice="none", temperature=0,
                                max_output_tokens=10)
    as_chat = [{"role": "user", "content": PROMPT},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": call.call_id, "type": "function", "function": {"name": call.name,
                                                                          "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "22 C and sunny"}]
    text, prompt_tokens, _ = chat_reply(url, as_chat, 10, tools=[{"type": "function", "function": {
        "name": "get_weather", "parameters": CITY}}], tool_choice="none")
    assert (answer.output_text, answer.usage.input_tokens) == (text, prompt_tokens)
    streamed = "".join(e.delta for e in c.responses.create(model=MODEL, input=turn, tools=[weather_tool()],
                                                           tool_choice="none", temperature=0, max_output_tokens=10,
                                                           stream=True) if e.type == "response.output_text.delta")
    assert streamed == text


@pytest.mark.parametrize("stream", [False, True])
def test_previous_response_id_continues_and_hits_the_prefix_cache(served, stream):
    url = served[0]
    c = oai(url)
    first = c.responses.create(model=MODEL, input=PROMPT + f" ({stream})", max_output_tokens=8, temperature=0)
    kw = dict(model=MODEL, previous_response_id=first.id, input="And of Italy?", max_output_tokens=8, temperature=0)
    if stream:
        second = [e for e in c.responses.create(stream=True, **kw) if e.type.startswith("response.")][-1].response
    else:
        second = c.responses.create(**kw)
    text, prompt_tokens, _ = chat_reply(url, [{"role": "user", "content": PROMPT + f" ({stream})"},
                                              {"role": "assistant", "content": first.output_text},
                                              {"role": "user", "content": "And of Italy?"}], 8)
    assert second.output_text == text and second.usage.input_tokens == prompt_tokens
    # the first turn's prompt and reply are whole KV blocks in the prefix cache: the second reads them
    assert second.usage.input_tokens_details.cached_tokens >= 16
    assert second.previous_response_id == first.id

    got = c.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == text
    c.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(second.id)
    with pytest.raises(openai.BadRequestError, match="previous response"):
        c.responses.create(model=MODEL, previous_response_id=second.id, input="more", max_output_tokens=2)


def test_stored_responses_are_bounded_and_survive_a_restart(tmp_path):
    store = ResponseStore(tmp_path, limit=2)
    ids = [f"resp_{i:032x}" for i in range(3)]
    for i, rid in enumerate(ids):
        store.put(rid, {"response": {"n": i}, "messages": []})
    assert store.get(ids[0]) is None and len(store) == 2  # the oldest went
    again = ResponseStore(tmp_path, limit=2)  # a restarted server
    assert again.get(ids[2])["response"] == {"n": 2} and again.get(ids[1])["response"] == {"n": 1}
    (tmp_path / f"{ids[1]}.json").write_text("{not json")
    assert ResponseStore(tmp_path, limit=2).get(ids[1]) is None  # unreadable: dropped, never half-read
    assert ResponseStore(tmp_path).get("../etc/passwd") is None
    other, rid = ResponseStore(tmp_path, limit=2), f"resp_{9:032x}"  # a second server on the same directory
    again.put(rid, {"response": {"n": 9}, "messages": []})
    assert other.get(rid)["response"] == {"n": 9}
    rid = f"resp_{10:032x}"
    again.put(rid, {"response": {"n": 10}, "messages": []})
    assert other.delete(rid) and again.get(rid) is None  # deleted by the server that did not store it
    stale = tmp_path / f".{ids[2]}.json.123.tmp"  # a killed server's half-written record
    stale.write_text("{")
    os.utime(stale, (0, 0))
    ResponseStore(tmp_path, limit=2)
    assert not stale.exists()
    memory = ResponseStore(None, limit=1)
    memory.put(ids[0], {"response": {}, "messages": []})
    assert not memory.persistent and memory.get(ids[0]) is not None


def test_stored_responses_are_bounded_in_bytes(tmp_path):
    """Records holding images are large: the store keeps at most max_bytes of them, the oldest going
    first, on disk and after a restart; one record over the budget alone is not kept."""
    image = "data:image/png;base64," + "A" * 4000
    record = {"response": {}, "messages": [{"role": "user", "content": [{"type": "image_url",
                                                                          "image_url": {"url": image}}]}]}
    ids = [f"resp_{i:032x}" for i in range(4)]
    store = ResponseStore(tmp_path, limit=100, max_bytes=10_000)
    for rid in ids:
        store.put(rid, record)
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("resp_*.json"))
    assert len(store) == 2 and store.bytes == on_disk <= 10_000  # two of ~4.1 KB fit
    assert store.get(ids[1]) is None and store.get(ids[3]) is not None
    for t, rid in enumerate(ids[2:], 1):  # the files' order as written (mtimes can tie within a tick)
        os.utime(tmp_path / f"{rid}.json", (t, t))
    again = ResponseStore(tmp_path, limit=100, max_bytes=5_000)  # restarted with a smaller budget
    assert len(again) == 1 and again.get(ids[3]) is not None and again.get(ids[2]) is None
    again.put(f"resp_{9:032x}", {**record, "extra": "x" * 6000})
    assert again.get(f"resp_{9:032x}") is None and again.get(ids[3]) is not None


def test_a_stored_response_is_on_disk_before_it_takes_its_name(tmp_path, monkeypatch):
    """The record's bytes are fsynced in the temporary file, then renamed: a crash or power loss
    leaves the record whole or absent, never an empty file under its name."""
    synced = []
    real = os.fsync

    def fsync(fd):
        name = Path(os.readlink(f"/proc/self/fd/{fd}"))
        synced.append((name.name, name.stat().st_size, (tmp_path / f"{rid}.json").exists()))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    rid = f"resp_{7:032x}"
    ResponseStore(tmp_path).put(rid, {"response": {"n": 7}, "messages": []})
    size = (tmp_path / f"{rid}.json").stat().st_size
    assert synced == [(f".{rid}.json.{os.getpid()}.tmp", size, False)]


def test_stored_responses_from_many_threads_keep_the_store_consistent(tmp_path):
    """The server stores and reads records on worker threads: the index and its byte count stay exact."""
    from concurrent.futures import ThreadPoolExecutor

    store = ResponseStore(tmp_path, limit=20)
    ids = [f"resp_{i:032x}" for i in range(200)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda rid: (store.put(rid, {"response": {"id": rid}, "messages": []}), store.get(rid)), ids))
    on_disk = sorted(p.stem for p in tmp_path.glob("resp_*.json"))
    assert len(store) == 20 and sorted(store._ids) == on_disk
    assert store.bytes == sum((tmp_path / f"{rid}.json").stat().st_size for rid in on_disk)


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_in_responses_and_anthropic(served, stream):
    url = served[0]
    # room for the most whitespace the grammar allows: it ends the reply once the JSON is whole
    kw = dict(model=MODEL, input="Which city? Answer in JSON.", max_output_tokens=200, temperature=0.7,
              text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
              extra_body={"seed": 1})
    if stream:
        text = "".join(e.delta for e in oai(url).responses.create(stream=True, **kw)
                       if e.type == "response.output_text.delta")
    else:
        text = oai(url).responses.create(**kw).output_text
    jsonschema.validate(json.loads(text), CITY)
    m = claude(url).messages.create(model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "Which city?"}],
                                    output_config={"format": {"type": "json_schema", "schema": CITY}})
    jsonschema.validate(json.loads(m.content[0].text), CITY)


# -- Anthropic Messages ----------------------------------------------------------------------------
def test_anthropic_messages_create_and_stream(served):
    url, path, _ = served
    want, prompt_tokens, _ = chat_reply(url, [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": PROMPT}], 12)
    # Anthropic's SDK no longer has sampling arguments: older clients' temperature goes in the body
    kw = dict(model=MODEL, max_tokens=12, system="Be brief.", messages=[{"role": "user", "content": PROMPT}],
              extra_body={"temperature": 0})
    m = claude(url).messages.create(**kw)
    assert m.content[0].type == "text" and m.content[0].text == want and m.role == "assistant"
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt_tokens
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens <= 12
    with claude(url).messages.stream(**kw) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == want == final.content[0].text and final.stop_reason == m.stop_reason
    assert claude(url).messages.count_tokens(model=MODEL, system="Be brief.",
                                             messages=[{"role": "user", "content": PROMPT}]).input_tokens == prompt_tokens
    # a stop sequence the greedy reply meets: the text before it, and which one stopped it
    stop = want[3:6]
    cut = claude(url).messages.create(stop_sequences=["\x00never", stop], **kw)
    assert (cut.stop_reason, cut.stop_sequence, cut.content[0].text) == ("stop_sequence", stop, want[:want.index(stop)])


def test_anthropic_tool_round_trip_streamed_and_not(served):
    url = served[0]
    tools = [{"name": "get_weather", "description": "The weather in a city", "input_schema": CITY}]
    kw = dict(model=MODEL, max_tokens=200, tools=tools, tool_choice={"type": "tool", "name": "get_weather"},
              messages=[{"role": "user", "content": PROMPT}], extra_body={"temperature": 0})
    m = claude(url).messages.create(**kw)
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, CITY)
    with claude(url).messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [use.input]
    assert claude(url).messages.count_tokens(model=MODEL, tools=tools, messages=kw["messages"]).input_tokens == \
        m.usage.input_tokens + m.usage.cache_read_input_tokens

    turn = kw["messages"] + [{"role": "assistant", "content": [use.model_dump()]},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                           "content": "22 C and sunny"}]}]
    answer = claude(url).messages.create(model=MODEL, max_tokens=10, tools=tools, tool_choice={"type": "none"},
                                         messages=turn, extra_body={"temperature": 0})
    as_chat = [{"role": "user", "content": PROMPT},
               {"role": "assistant", "content": "", "tool_calls": [{"id": use.id, "type": "function", "function": {
                   "name": "get_weather", "arguments": json.dumps(use.input)}}]},
               {"role": "tool", "tool_call_id": use.id, "content": "22 C and sunny"}]
    text, prompt_tokens, _ = chat_reply(url, as_chat, 10, tools=[{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city", "parameters": CITY}}], tool_choice="none")
    assert answer.content[0].text == text
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == prompt_tokens


def test_anthropic_x_api_key(tiny_models):
    llm = LLM(str(tiny_models("llama")), num_blocks=65)
    with serve_in_thread(create_app(llm, api_key="s3cret", model_name=MODEL)) as url:
        with pytest.raises(anthropic.AuthenticationError) as e:
            claude(url, key="wrong").messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["error"]["type"] == "authentication_error"
        m = claude(url, key="s3cret").messages.create(model=MODEL, max_tokens=2,
                                                      messages=[{"role": "user", "content": "hi"}])
        assert m.usage.output_tokens <= 2
        assert httpx.get(url + "/api/tags", headers={"x-api-key": "s3cret"}).status_code == 200
        r = httpx.get(url + "/api/tags")
        assert r.status_code == 401 and "API key" in r.json()["error"]


# -- Ollama -------------------------------------------------------------------------------------------
def test_ollama_chat_and_generate_streamed_and_not(served):
    url, path, _ = served
    want, prompt_tokens, ids = chat_reply(url, [{"role": "user", "content": PROMPT}], 12)
    options = {"temperature": 0, "num_predict": 12}
    r = llama(url).chat(model=MODEL + ":latest", messages=[{"role": "user", "content": PROMPT}], options=options)
    assert r.message.content == want and r.done and r.prompt_eval_count == prompt_tokens and r.eval_count == len(ids)
    assert r.done_reason in ("stop", "length")
    parts = list(llama(url).chat(model=MODEL, messages=[{"role": "user", "content": PROMPT}], options=options,
                                 stream=True))
    assert "".join(p.message.content for p in parts) == want and parts[-1].done and not parts[0].done
    g = llama(url).generate(model=MODEL, prompt=PROMPT, options=options)
    assert g.response == want and g.context[-len(ids):] == ids
    assert "".join(p.response for p in llama(url).generate(model=MODEL, prompt=PROMPT, options=options,
                                                           stream=True)) == want
    raw = llama(url).generate(model=MODEL, prompt="Paged attention stores", raw=True, options=options)
    plain = oai(url).completions.create(model=MODEL, prompt="Paged attention stores", max_tokens=12, temperature=0)
    assert raw.response == plain.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_chat_format_as_a_schema(served, stream):
    url = served[0]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Which city? Answer in JSON."}], format=CITY,
              options={"temperature": 0.7, "seed": 3, "num_predict": 200})
    if stream:
        text = "".join(p.message.content for p in llama(url).chat(stream=True, **kw))
    else:
        text = llama(url).chat(**kw).message.content
    jsonschema.validate(json.loads(text), CITY)


def test_ollama_models_list_show_ps_version_and_keep_alive(served):
    url = served[0]
    c = llama(url)
    names = [m.model for m in c.list().models]
    assert names[:2] == ["tiny:latest", "other:latest"]
    shown = c.show(MODEL)
    assert shown.details.family == "llama" and shown.modelinfo["llama.context_length"] > 0
    assert "completion" in shown.capabilities and "<|im_start|>" in shown.template
    assert [m.model for m in c.ps().models] == ["tiny:latest"]
    assert httpx.get(url + "/api/version").json()["version"]
    assert httpx.head(url + "/").status_code == 200 and httpx.get(url + "/").text == "Ollama is running"

    c.generate(model="other", prompt="hi", options={"num_predict": 2})  # loads it
    assert [m.model for m in c.ps().models] == ["tiny:latest", "other:latest"]
    gone = c.generate(model="other:latest", keep_alive=0)  # an empty prompt with keep_alive 0: unload now
    assert gone.done_reason == "unload"
    _wait_for(lambda: [m.model for m in c.ps().models] == ["tiny:latest"])
    pool = served[2].state.server.pool
    loads = pool.num_loads
    assert c.generate(model="other", keep_alive=0).done_reason == "unload"  # `ollama stop` on a model not loaded
    assert pool.num_loads == loads  # loads nothing (which could unload another model to make room)
    c.chat(model="other", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2}, keep_alive="1s")
    assert [m.expires_at is not None for m in c.ps().models] == [False, True]
    _wait_for(lambda: [m.model for m in c.ps().models] == ["tiny:latest"])
    c.chat(model="other", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 1}, keep_alive=1e12)
    assert [m.expires_at for m in c.ps().models] == [None, None]  # past any date: kept, as a negative one
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="other", messages=[{"role": "user", "content": "hi"}], keep_alive="nan")
    assert e.value.status_code == 400 and "keep_alive" in e.value.error
    c.generate(model="other", keep_alive=0)
    _wait_for(lambda: [m.model for m in c.ps().models] == ["tiny:latest"])


def test_a_reply_while_a_keep_alive_unload_waits_keeps_the_model_as_it_asks(served):
    """keep_alive 0 on `other` while the pool is busy loading (its lock held here, as a load of
    another model holds it): the unload waits; a reply meanwhile asking to keep the model wins."""
    import asyncio

    url, _, app = served
    pool, c = app.state.server.pool, llama(url)
    held = {}

    async def lock():  # on the server's loop, as a load would
        pool._lock = pool._lock or asyncio.Lock()
        await pool._lock.acquire()

    async def unlock():
        pool._lock.release()
        async with pool._lock:  # FIFO: whatever waited for the lock has run by now
            held["models"] = [m.name for m in pool.loaded()]

    app.post("/test/lock")(lock)
    app.post("/test/unlock")(unlock)

    def reply(keep_alive):
        c.chat(model="other", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 1},
               keep_alive=keep_alive)

    reply(-1)
    assert httpx.post(url + "/test/lock").status_code == 200
    try:
        reply(0)  # its unload now waits for the lock
        reply(-1)  # and this one asks to keep the model
    finally:
        assert httpx.post(url + "/test/unlock").status_code == 200
    assert held["models"] == ["tiny", "other"]
    c.generate(model="other", keep_alive=0)
    _wait_for(lambda: [m.model for m in c.ps().models] == ["tiny:latest"])


def _wait_for(cond, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_ollama_pull_streams_its_progress_and_delete_removes(served, monkeypatch, tmp_path):
    """macinfer's pull over a stand-in for the hub that holds the download until the test has read
    a progress line with the bytes on disk so far; then /api/delete removes the model."""
    import huggingface_hub
    from test_models_cli import add_hf_repo

    url, path, _ = served
    hub, repo = tmp_path / "hub", "mlx-community/Tiny-Llama"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    release = threading.Event()

    def snapshot_download(repo_id, *, allow_patterns=None, cache_dir=None, dry_run=False, **kw):
        if dry_run:
            return [type("File", (), {"filename": f.name})() for f in path.iterdir()]
        if allow_patterns != ["config.json"]:
            partial = Path(cache_dir) / ("models--" + repo_id.replace("/", "--")) / "blobs" / "x.incomplete"
            partial.write_bytes(b"w" * 1000)
            release.wait(60)
            partial.unlink()
        return str(add_hf_repo(Path(cache_dir), repo_id, path, allow_patterns))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    lines = []
    with httpx.stream("POST", url + "/api/pull", json={"model": repo}, timeout=60) as r:
        for line in r.iter_lines():
            lines.append(json.loads(line))
            if lines[-1].get("completed"):
                release.set()
    assert lines[0] == {"status": "pulling manifest"} and lines[-1] == {"status": "success"}
    assert any(x.get("completed", 0) >= 1000 for x in lines)
    assert (hub / "models--mlx-community--Tiny-Llama" / "snapshots").is_dir()
    assert llama(url).delete(repo).status == "success"
    assert not (hub / "models--mlx-community--Tiny-Llama").exists()
    with pytest.raises(ollama.ResponseError) as e:
        llama(url).delete(repo)
    assert e.value.status_code == 404


def test_ollama_delete_of_a_model_ls_lists_takes_it_off_the_list(tiny_models, tmp_path, monkeypatch):
    """A deleted model is not listed (nor served: a request naming it would download it again)."""
    from test_models_cli import add_hf_repo

    from macinfer.serve.model_pool import local_models

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("MACINFER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = "mlx-community/Tiny-Qwen"
    add_hf_repo(tmp_path / "hub", repo, tiny_models("qwen2"))
    app = create_app(LLM(str(tiny_models("llama")), num_blocks=65), model_name=MODEL,
                     models=PoolOptions(discover=local_models, load=lambda spec: LLM(spec, num_blocks=65)))
    with serve_in_thread(app) as url:
        c = llama(url)
        assert repo + ":latest" in [m.model for m in c.list().models]
        assert c.delete(repo).status == "success"
        with pytest.raises(ollama.ResponseError) as e:
            c.chat(model=repo, messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 404
        assert repo + ":latest" not in [m.model for m in c.list().models]


def test_ollama_delete_during_a_first_load_waits_for_it(tiny_models, tmp_path, monkeypatch):
    """A delete while a request's first load of the model reads its files: the load finishes and that
    request is answered, then the model is unloaded and removed (its files were not taken from under
    the load)."""
    from concurrent.futures import ThreadPoolExecutor

    from test_models_cli import add_hf_repo

    from macinfer.serve.model_pool import local_models

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("MACINFER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo, started, gate = "mlx-community/Tiny-Qwen", threading.Event(), threading.Event()
    add_hf_repo(tmp_path / "hub", repo, tiny_models("qwen2"))
    cached = tmp_path / "hub" / ("models--" + repo.replace("/", "--"))

    def load(spec):
        started.set()
        assert gate.wait(60)
        return LLM(spec, num_blocks=65)

    app = create_app(LLM(str(tiny_models("llama")), num_blocks=65), model_name=MODEL,
                     models=PoolOptions(discover=local_models, load=load))
    with serve_in_thread(app) as url, ThreadPoolExecutor(2) as pool:
        c = llama(url)
        chat = pool.submit(c.chat, model=repo, messages=[{"role": "user", "content": "hi"}], options={"num_predict": 3})
        assert started.wait(60)
        deleted = pool.submit(c.delete, repo)
        time.sleep(1.0)
        assert not deleted.done() and cached.is_dir()  # waiting for the load, files in place
        gate.set()
        assert chat.result(60).done and deleted.result(60).status == "success"
        assert not cached.exists()
        assert repo + ":latest" not in [m.model for m in c.list().models]


def test_ollama_pull_delete_and_what_is_not_served(served):
    url = served[0]
    c = llama(url)
    with pytest.raises(ollama.ResponseError) as e:
        c.pull("smollm2-135m")  # the embedded model: macinfer's pull says there is nothing to pull
    assert e.value.status_code == 400 and "embedded" in e.value.error
    lines = [json.loads(x) for x in httpx.post(url + "/api/pull", json={"model": "smollm2-135m"}).text.splitlines()]
    assert lines[0] == {"status": "pulling manifest"} and "embedded" in lines[-1]["error"]
    with pytest.raises(ollama.ResponseError) as e:
        c.delete("no-such-model")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        c.delete(MODEL)
    assert e.value.status_code == 400 and "default model" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        c.embed(model=MODEL, input="hello")
    assert e.value.status_code == 501 and "embeddings" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model=MODEL, messages=[{"role": "user", "content": "what is this?", "images": [b"\x89PNG"]}])
    assert e.value.status_code == 400 and "does not take images" in e.value.error


# -- errors: each protocol's shape, and the server serves on ----------------------------------------
BIG = "x" * (LIMIT + 1)
OK = {"responses": {"model": MODEL, "input": "hi", "max_output_tokens": 2},
      "anthropic": {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
      "ollama": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False,
                 "options": {"num_predict": 2}}}
ROUTES = {"responses": "/v1/responses", "anthropic": "/v1/messages", "ollama": "/api/chat"}
BAD = {
    "responses": [({"max_output_tokens": "many"}, 400), ({"tool_choice": {"type": "function", "name": "nope"},
                                                          "tools": [weather_tool()]}, 400),
                  ({"input": None}, 400), ({"input": BIG}, 413), ({"temperature": 9}, 400)],
    "anthropic": [({"max_tokens": "many"}, 400), ({"tool_choice": {"type": "tool", "name": "nope"},
                                                   "tools": [{"name": "get_weather", "input_schema": CITY}]}, 400),
                  ({"max_tokens": None}, 400), ({"system": BIG}, 413), ({"temperature": 1.5}, 400)],
    "ollama": [({"options": {"num_predict": "many"}}, 400), ({"tools": [{"type": "retrieval"}]}, 400),
               ({"model": None}, 400), ({"messages": [{"role": "user", "content": BIG}]}, 413),
               ({"options": {"mirostat": 2}}, 400)],
}


def _shape(protocol: str, body: dict) -> str:
    """The error's message, if the body is in the protocol's error shape."""
    if protocol == "anthropic":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return body["error"]["message"]
    if protocol == "ollama":
        assert set(body) == {"error"} and isinstance(body["error"], str)
        return body["error"]
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]["message"]


@pytest.mark.parametrize("protocol", list(BAD))
def test_bad_input_gets_the_protocols_error_shape_and_the_server_serves_on(served, protocol):
    url = served[0]
    for change, status in BAD[protocol]:
        body = {k: v for k, v in (OK[protocol] | change).items() if v is not None}
        r = httpx.post(url + ROUTES[protocol], json=body, timeout=30)
        assert r.status_code == status, (change, r.text)
        message = _shape(protocol, r.json())
        assert message and "\n" not in message and "Traceback" not in message
        assert httpx.post(url + ROUTES[protocol], json=OK[protocol], timeout=30).status_code == 200
    if protocol == "anthropic":  # and through the client: its own exception class, the body parsed
        with pytest.raises(anthropic.BadRequestError) as e:
            claude(url).messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": 5}])
        assert e.value.body["error"]["type"] == "invalid_request_error"
        with pytest.raises(anthropic.NotFoundError):
            claude(url).messages.create(model="nope", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    if protocol == "responses":
        with pytest.raises(openai.BadRequestError) as e:
            oai(url).responses.create(model=MODEL, input=[{"type": "web_search_call", "id": "x"}])
        assert e.value.body["param"] == "input[0].type"


def test_metrics_label_requests_by_protocol(served):
    url = served[0]
    for protocol in OK:
        assert httpx.post(url + ROUTES[protocol], json=OK[protocol], timeout=30).status_code == 200
    page = httpx.get(url + "/metrics").text.splitlines()
    for protocol, endpoint in (("responses", "responses"), ("anthropic", "messages"), ("ollama", "api/chat")):
        assert any(line.startswith(f'macinfer_requests_total{{endpoint="{endpoint}",') and
                   f'protocol="{protocol}"' in line for line in page), protocol


# -- thinking: the thought apart from the answer, as each protocol carries it -------------------------
@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """(url, seed, thought, answer) of the tiny DeepSeek-R1-Distill (its template opens the thought in
    the prompt): a seed whose reply closes the thought and then answers, found through chat completions."""
    path = build_family_model(tmp_path_factory.mktemp("r1"), "r1_distill")
    with serve_in_thread(create_app(LLM(str(path), num_blocks=257), model_name=MODEL)) as url:
        for seed in range(200):
            r = oai(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=40, temperature=1.0, seed=seed)
            m = r.choices[0].message
            if m.model_extra.get("reasoning_content") and (m.content or "").strip():
                yield url, seed, m.model_extra["reasoning_content"], m.content
                return
        raise AssertionError("no seed in 200 closes the thought")


def test_the_thought_through_each_protocol(thinker):
    url, seed, thought, answer = thinker
    messages = [{"role": "user", "content": PROMPT}]
    r = oai(url).responses.create(model=MODEL, input=PROMPT, max_output_tokens=40, temperature=1.0,
                                  reasoning={"effort": "medium", "summary": "auto"}, extra_body={"seed": seed})
    (item,) = [i for i in r.output if i.type == "reasoning"]
    assert (item.content[0].text, item.summary[0].text, r.output_text) == (thought, thought, answer)
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(oai(url).responses.create(model=MODEL, input=PROMPT, max_output_tokens=40, temperature=1.0,
                                            stream=True, extra_body={"seed": seed}))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought

    body = dict(model=MODEL, max_tokens=40, messages=messages, thinking={"type": "enabled", "budget_tokens": 1024},
                extra_body={"temperature": 1.0, "seed": seed})
    m = claude(url).messages.create(**body)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == \
        [("thinking", thought), ("text", answer)]
    with claude(url).messages.stream(**body) as s:
        assert [b.type for b in s.get_final_message().content] == ["thinking", "text"]

    options = {"temperature": 1.0, "seed": seed, "num_predict": 40, "top_k": 0, "top_p": 1}
    o = llama(url).chat(model=MODEL, messages=messages, think=True, options=options)
    assert (o.message.thinking, o.message.content) == (thought, answer)
    parts = list(llama(url).chat(model=MODEL, messages=messages, think=True, options=options, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == thought


def test_think_on_a_model_that_does_not_think_is_refused(served):
    with pytest.raises(ollama.ResponseError) as e:
        llama(served[0]).chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], think=True)
    assert e.value.status_code == 400 and "does not support thinking" in e.value.error
