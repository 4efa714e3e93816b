"""Images through `serve` (the openai SDK), `run --image`, and bad input, on a tiny gemma3 vision model.

The answers are checked against mlx-vlm's own greedy generation for the same text and image
(tests/test_vision.py's oracle); every bad input is a 400 (or one line on the command line) and
the server keeps answering.
"""

from __future__ import annotations

import base64
import json

import pytest

import macinfer  # noqa: F401  (OpenBLAS before mlx)

pytest.importorskip("mlx_vlm")

import openai  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from macinfer.cli.main import main  # noqa: E402
from macinfer.llm import LLM  # noqa: E402
from macinfer.modelio import images as images_module  # noqa: E402
from macinfer.modelio.images import read_image  # noqa: E402
from macinfer.serve.server import create_app, serve_in_thread  # noqa: E402
from test_vision import MAX_TOKENS, messages, oracle  # noqa: E402
from tiny_vision import build_tiny_vlm, write_images  # noqa: E402

MODEL = "tiny-gemma3-vision"


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    """(model path, image paths, LLM, mlx-vlm model, mlx-vlm processor)."""
    from mlx_vlm.utils import load

    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm-gemma3"), "gemma3")
    pics = write_images(tmp_path_factory.mktemp("pics"), 2)
    llm = LLM(str(path), engine="paged", num_blocks=64, block_size=4)
    return (path, pics, llm, *load(str(path)))


@pytest.fixture(scope="module")
def served(vision, tiny_models):
    """Base URLs of the vision model's server and of a text-only model's."""
    llm = vision[2]
    text = LLM(str(tiny_models("llama")), num_blocks=64)
    with serve_in_thread(create_app(llm, model_name=MODEL)) as url, \
            serve_in_thread(create_app(text, model_name="tiny-text")) as text_url:
        yield url, text_url


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def chat(url, content, model=MODEL, **kw):
    return client(url).chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True}, **kw)


def test_openai_sdk_sends_a_base64_image_and_gets_mlx_vlm_s_answer(vision, served):
    path, pics, llm, vmodel, processor = vision
    url, _ = served
    content = [{"type": "image_url", "image_url": {"url": data_url(pics[0])}},
               {"type": "text", "text": "Describe the fox"}]
    r = chat(url, content)
    want = oracle(vmodel, processor, llm, "Describe the fox", [read_image(pics[0])])[1]
    assert r.choices[0].message.content == llm.tokenizer.decode(want)
    assert r.usage.completion_tokens == MAX_TOKENS
    # The same image as a local path, streamed: the same answer, and the image's blocks come from the cache.
    stream = client(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(pics[0])}},
                                                            {"type": "text", "text": "Describe the fox"}]}],
        max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("part, model, match", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}, MODEL, "not an image"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, MODEL, "base64"),
    ({"type": "image_url", "image_url": {"url": "/no/such/file.png"}}, MODEL, "cannot read"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, MODEL, "--allow-remote-images"),
    ("tall", MODEL, "megapixels"),
    ("ok", "tiny-text", "does not take images"),
    ("nine", MODEL, "at most 8"),
])
def test_bad_images_are_a_400_and_the_server_keeps_serving(vision, served, part, model, match, monkeypatch):
    url, text_url = served
    pics = vision[1]
    ok = {"type": "image_url", "image_url": {"url": data_url(pics[1])}}
    if part == "tall":  # the limit lowered under the test images' size, rather than a 50-megapixel file built
        monkeypatch.setattr(images_module, "MAX_IMAGE_PIXELS", 1000)
    named = {"tall": [{"type": "image_url", "image_url": {"url": data_url(pics[0])}}], "ok": [ok], "nine": [ok] * 9}
    content = (named[part] if isinstance(part, str) else [part]) + [{"type": "text", "text": "What is it?"}]
    with pytest.raises(openai.BadRequestError) as e:
        chat(url if model == MODEL else text_url, content, model=model)
    assert match in e.value.body["message"] and "\n" not in e.value.body["message"]
    monkeypatch.undo()
    assert chat(url, [ok, {"type": "text", "text": "And now?"}]).choices[0].message.content  # still serving


def test_run_image_prints_mlx_vlm_s_answer_and_bad_files_are_one_line(vision, tmp_path):
    path, pics, llm, vmodel, processor = vision
    runner = CliRunner()
    r = runner.invoke(main, ["run", str(path), "--image", str(pics[0]), "Describe the fox", "-n", str(MAX_TOKENS),
                             "--json", "--no-prefix-cache"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    want = oracle(vmodel, processor, llm, "Describe the fox", [read_image(pics[0])])[1]
    eos = set(llm.engine.eos_token_ids)
    assert out["token_ids"] == (want[: next((i for i, t in enumerate(want) if t in eos), len(want))])
    bad = tmp_path / "bad.jpg"
    bad.write_text("not a jpeg")
    r = runner.invoke(main, ["run", str(path), "--image", str(bad), "Describe it"])
    assert r.exit_code != 0 and "not an image" in r.output and "Traceback" not in r.output


def test_messages_with_images_render_through_the_model_s_template(vision):
    """The image part lands where the template puts it, and the placeholder count matches the images."""
    path, pics, llm, *_ = vision
    ids, mm = llm.image_prompt(messages("Two?", 2), [read_image(p) for p in pics])
    assert mm.num_images == 2 and [ids[a] for a, _ in mm.spans] == [llm.images.image_token_id] * 2
    assert all(ids[b - 1] == llm.images.end_token_id for _, b in mm.spans)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_chat_image_attaches_shows_and_saves_the_picture(vision, tmp_path):
    """`/image FILE` then a message: the transcript names the image, the reply is mlx-vlm's, and /save
    keeps the attachment (/load shows it again)."""
    from macinfer.tui.app import ChatApp
    from test_tui import loaded, notices, send, wait_for

    path, pics, llm, vmodel, processor = vision
    app = ChatApp(str(path), peak_bandwidth=100, max_tokens=MAX_TOKENS)
    async with app.run_test(size=(100, 30)) as pilot:
        await loaded(pilot)
        await send(pilot, "/image /no/such.png")
        assert "cannot read" in notices(app)[-1]
        await send(pilot, f"/image {pics[0]}")
        assert "[image: image0.png]" in notices(app)[-1]
        await send(pilot, "Describe the fox")
        await wait_for(pilot, lambda: app.chat.request_id is None, what="the reply")
        user = [str(w.render()) for w in app.chat.query(".user")]
        assert user[-1].startswith("[image: image0.png]") and user[-1].endswith("Describe the fox")
        want = oracle(vmodel, processor, llm, "Describe the fox", [read_image(pics[0])])[1]
        eos = set(llm.engine.eos_token_ids)
        want = want[: next((i for i, t in enumerate(want) if t in eos), len(want))]
        assert app.session.turns[-1]["content"] == llm.tokenizer.decode(want)
        assert app.chat.attached == []  # it went with that message
        saved = tmp_path / "chat.json"
        await send(pilot, f"/save {saved}")
        assert json.loads(saved.read_text())["messages"][0]["images"] == [str(pics[0].resolve())]
        await send(pilot, "/clear")
        await send(pilot, f"/load {saved}")
        await wait_for(pilot, lambda: any("[image: image0.png]" in str(w.render()) for w in app.chat.query(".user")),
                       what="the loaded turn")


# -- images through the other protocols: Responses' input_image, Anthropic's image blocks, Ollama's images --
def _until_eos(llm, tokens: list[int]) -> str:
    eos = set(llm.engine.eos_token_ids)
    return llm.tokenizer.decode(tokens[: next((i for i, t in enumerate(tokens) if t in eos), len(tokens))])


def test_each_protocol_sends_an_image_and_gets_mlx_vlm_s_answer(vision, served):
    """The same image and question through the openai SDK's responses, anthropic's messages (streamed
    too) and ollama's chat and generate: mlx-vlm's greedy answer each time; a stored Responses turn
    keeps its image, so the next turn's prompt (image included) comes from the prefix cache."""
    import anthropic
    import ollama

    path, pics, llm, vmodel, processor = vision
    url, _ = served
    want = _until_eos(llm, oracle(vmodel, processor, llm, "Describe the fox", [read_image(pics[0])])[1])
    b64 = base64.b64encode(pics[0].read_bytes()).decode()

    r = client(url).responses.create(model=MODEL, max_output_tokens=MAX_TOKENS, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(pics[0])},
                                     {"type": "input_text", "text": "Describe the fox"}]}])
    assert r.output_text == want
    again = client(url).responses.create(model=MODEL, max_output_tokens=2, temperature=0, previous_response_id=r.id,
                                         input="And its colour?")
    block_size = 4  # the fixture's engine: all but the first prompt's last partial block is read back
    assert again.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens - block_size

    a = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
              {"type": "text", "text": "Describe the fox"}]
    greedy = {"temperature": 0}  # today's SDK takes sampling fields in extra_body only
    m = a.messages.create(model=MODEL, max_tokens=MAX_TOKENS, extra_body=greedy,
                          messages=[{"role": "user", "content": blocks}])
    assert m.content[0].text == want
    with a.messages.stream(model=MODEL, max_tokens=MAX_TOKENS, extra_body=greedy,
                           messages=[{"role": "user", "content": blocks}]) as s:
        assert "".join(s.text_stream) == want

    o = ollama.Client(host=url)
    greedy = {"temperature": 0, "num_predict": MAX_TOKENS}
    reply = o.chat(model=MODEL, options=greedy,
                   messages=[{"role": "user", "content": "Describe the fox", "images": [pics[0]]}])
    assert reply.message.content == want
    assert o.generate(model=MODEL, prompt="Describe the fox", images=[pics[0].read_bytes()], options=greedy,
                      ).response == want
    assert "vision" in o.show(MODEL).capabilities  # Ollama's clients offer an image upload by it


def test_each_protocol_refuses_images_for_a_model_that_does_not_see(served):
    """A text-only model: a 400 in each protocol's own shape, naming the part in its own words."""
    import anthropic
    import httpx
    import ollama

    _, text_url = served
    png = "iVBORw0KGgo="
    with pytest.raises(openai.BadRequestError) as e:
        client(text_url).responses.create(model="tiny-text", input=[{"role": "user", "content": [
            {"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": "data:image/png;base64," + png}]}])
    assert "does not take images" in e.value.body["message"] and e.value.body["param"] == "input[0].content[1]"
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic.Anthropic(base_url=text_url, api_key="unused", max_retries=0).messages.create(
            model="tiny-text", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "does not take images" in e.value.body["error"]["message"]
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=text_url).chat(model="tiny-text", messages=[
            {"role": "user", "content": "what is this?", "images": [png]}])
    assert e.value.status_code == 400 and "does not take images" in e.value.error
    assert "vision" not in ollama.Client(host=text_url).show("tiny-text").capabilities
    # A file part is refused by name; the server serves on.
    r = httpx.post(text_url + "/v1/responses", json={"model": "tiny-text", "input": [{"role": "user", "content": [
        {"type": "input_file", "file_id": "file-1"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0]"
    assert httpx.post(text_url + "/api/generate", json={"model": "tiny-text", "prompt": "hi", "stream": False,
                                                        "options": {"num_predict": 2}}).json()["done"]


def test_anthropic_tool_result_images_reach_the_model(vision, served):
    """An agent's tool returns an image (Claude Code reading a picture, a screenshot): the model sees it,
    as it sees the same image sent in the user turn right after the tool result (whose answer is
    mlx-vlm's, above); a text-only model gets a 400."""
    import anthropic

    path, pics, *_ = vision
    url, text_url = served
    b64 = base64.b64encode(pics[0].read_bytes()).decode()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}
    def turns(result: list, after: list) -> list:
        return [{"role": "user", "content": "Describe fox.png"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read_file",
                                                   "input": {"path": "fox.png"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": result}] + after}]

    a = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    ask = dict(model=MODEL, max_tokens=MAX_TOKENS, extra_body={"temperature": 0})
    in_result = a.messages.create(messages=turns([{"type": "text", "text": "fox.png:"}, image], []), **ask)
    after = a.messages.create(messages=turns([{"type": "text", "text": "fox.png:"}], [image]), **ask)
    without = a.messages.create(messages=turns([{"type": "text", "text": "fox.png:"}], []), **ask)
    def prompt_tokens(m) -> int:
        return m.usage.input_tokens + m.usage.cache_read_input_tokens

    assert in_result.content == after.content and prompt_tokens(in_result) == prompt_tokens(after)
    assert prompt_tokens(in_result) > prompt_tokens(without)  # the image's tokens are in the prompt
    counted = a.messages.count_tokens(model=MODEL, messages=turns([image], [])).input_tokens
    assert counted == a.messages.count_tokens(model=MODEL, messages=turns([], [image])).input_tokens
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic.Anthropic(base_url=text_url, api_key="unused", max_retries=0).messages.create(
            **(ask | {"model": "tiny-text"}), messages=turns([{"type": "text", "text": "fox.png:"}, image], []))
    assert "does not take images" in e.value.body["error"]["message"]


def test_count_tokens_reads_a_remote_image_where_messages_would(vision, tmp_path):
    """With --allow-remote-images, count_tokens counts an image by URL as /v1/messages renders it:
    as many tokens as the same image sent as base64."""
    import functools
    import http.server
    import threading

    import anthropic

    path, pics, *_ = vision
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(pics[0].parent))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    b64 = base64.b64encode(pics[0].read_bytes()).decode()
    sources = [{"type": "base64", "media_type": "image/png", "data": b64},
               {"type": "url", "url": f"http://127.0.0.1:{httpd.server_address[1]}/{pics[0].name}"}]
    llm = LLM(str(path), engine="paged", num_blocks=64, block_size=4)
    try:
        with serve_in_thread(create_app(llm, model_name=MODEL, allow_remote_images=True)) as url:
            a = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
            counts = [a.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [
                {"type": "image", "source": s}, {"type": "text", "text": "Describe the fox"}]}]).input_tokens
                for s in sources]
    finally:
        httpd.shutdown()
    assert counts[0] == counts[1] > 0
