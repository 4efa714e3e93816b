"""A thinking model's thought apart from its answer in `macinfer run` and `macinfer chat`.

The tiny DeepSeek-R1-Distill model (tests/families.py) starts every reply inside a thought (its
template opens it in the prompt); a seed whose sampled reply closes the thought early is found
first, then the surfaces are run with it and compared with the split mlx-lm's server makes of the
same tokens (tests/oracle.py). gpt-oss's harmony format goes through `run --json-schema` (the
answer after the analysis message), compared with openai-harmony's parse. The chat UI's thought
block is also driven by the stub engine with a scripted thought (macinfer.tui.stub).
"""

from __future__ import annotations

import json
from functools import partial

import jsonschema
import pytest
from click.testing import CliRunner
from families import build_family_model
from oracle import mlx_lm_load, mlx_lm_server_reply
from test_thinking import ANSWER, harmony_oracle, harmony_vocabulary  # noqa: F401  (autouse: o200k offline)
from test_tui import SIZE, loaded, send, wait_for

from macinfer.cli.main import _prepare, _stream, main
from macinfer.core.sampling_params import SamplingParams
from macinfer.llm import LLM
from macinfer.tui.app import ChatApp
from macinfer.tui.stub import StubBackend
from macinfer.tui.widgets.transcript import Reply, Thought

PROMPT = "Why is the sky blue?"
TEMP = 1.5


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    built = {}

    def get(name):
        if name not in built:
            built[name] = build_family_model(tmp_path_factory.mktemp(name), name)
        return built[name]
    return get


def find_seed(path, n: int, schema=None) -> int:
    """A seed whose reply (sampled at TEMP, n tokens at most, as `run` samples it alone) has both
    a thought and an answer."""
    llm = LLM(str(path), max_num_seqs=1, enable_prefix_cache=False)
    for seed in range(200):
        params = SamplingParams(temperature=TEMP, seed=seed, max_tokens=n)
        ids, params, parser = _prepare(llm, PROMPT, None, False, params, schema, None)
        reply = _stream(llm, ids, params, parser, echo=False)
        if reply.reasoning and reply.text.strip() and (schema is None or reply.output.finish_reason == "stop"):
            return seed
    raise AssertionError("no seed in 200 closes the thought")


def run(path, seed, n, *more):
    r = CliRunner().invoke(main, ["run", str(path), PROMPT, "--temp", str(TEMP), "--seed", str(seed), "-n", str(n),
                                  "--no-prefix-cache", "--peak-bandwidth", "100", *more])
    assert r.exit_code == 0, r.output
    return r


def test_run_prints_the_answer_on_stdout_and_the_thought_on_stderr(models):
    path = models("r1_distill")
    seed = find_seed(path, 40)
    got = json.loads(run(path, seed, 40, "--json").stdout)
    _, tok = mlx_lm_load(str(path))
    want = mlx_lm_server_reply(path, {"messages": [{"role": "user", "content": PROMPT}]}, got["token_ids"],
                               got["finish_reason"])["choices"][0]["message"]
    assert (got["reasoning"], got["text"]) == (want["reasoning"], want["content"]) and got["reasoning"]
    assert got["reasoning_tokens"] == got["token_ids"].index(tok.convert_tokens_to_ids("</think>")) + 1

    shown = run(path, seed, 40)
    assert lines(shown.stdout) == lines(got["text"] + "\n")
    assert lines(got["reasoning"]) in lines(shown.stderr) and f"({got['reasoning_tokens']} thinking)" in shown.stderr
    hidden = run(path, seed, 40, "--hide-thinking")
    assert lines(hidden.stdout) == lines(got["text"] + "\n") and lines(got["reasoning"]) not in lines(hidden.stderr)


def lines(text: str) -> str:
    """Text as a terminal stream reads back (a random model writes carriage returns too)."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def test_run_no_think_renders_the_template_without_a_thought(models):
    path = models("qwen3")
    got = json.loads(run(path, 0, 6, "--json", "--no-think").stdout)
    _, tok = mlx_lm_load(str(path))
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                  enable_thinking=False)
    assert got["prompt_tokens"] == len(ids) and got["reasoning"] is None and got["reasoning_tokens"] == 0


def test_run_harmony_answer_after_the_analysis_message(models, tmp_path):
    path = models("gpt_oss")
    schema_file = tmp_path / "answer.json"
    schema_file.write_text(json.dumps(ANSWER))
    from macinfer.core.grammar import StructuredOutput

    seed = find_seed(path, 60, StructuredOutput(json_schema=ANSWER))
    got = json.loads(run(path, seed, 60, "--json", "--json-schema", schema_file).stdout)
    jsonschema.validate(json.loads(got["text"]), ANSWER)
    want = {m.channel: m.content[0].text for m in harmony_oracle(path, got["token_ids"])}
    assert (got["reasoning"], got["text"]) == (want["analysis"], want["final"])


# -- the chat UI -----------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_chat_shows_the_thought_in_a_block_above_the_reply(models, tmp_path):
    path = models("r1_distill")
    seed = find_seed(path, 40)
    llm = LLM(str(path), max_num_seqs=1, enable_prefix_cache=False)
    ids, params, parser = _prepare(llm, PROMPT, None, False, SamplingParams(temperature=TEMP, seed=seed, max_tokens=40),
                                   None, None)
    want = _stream(llm, ids, params, parser, echo=False)
    app = ChatApp(str(path), peak_bandwidth=100, temperature=TEMP, seed=seed, max_tokens=40,
                  engine_options={"enable_prefix_cache": False, "max_num_seqs": 1})
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, PROMPT)
        await wait_for(pilot, lambda: app.chat.request_id is None, what="the reply")
        (reply,) = app.chat.query(Reply)
        block = reply.query_one(Thought)
        assert (block.text, reply.text) == (want.reasoning, want.text)
        assert block.collapsed and block.title.startswith("thought for ")
        assert block.title.endswith(f"· {want.reasoning_tokens} tokens")
        assert app.session.turns[-1] == {"role": "assistant", "content": want.text, "reasoning": want.reasoning}
        saved = tmp_path / "chat.json"
        await send(pilot, f"/save {saved}")
        assert json.loads(saved.read_text())["messages"][-1]["reasoning"] == want.reasoning


@pytest.mark.anyio
async def test_chat_thought_is_live_then_folds_and_think_off_asks_for_none():
    app = ChatApp(make_backend=partial(StubBackend, rate=40, length=30, thought="Rayleigh scattering, shorter waves."),
                  max_tokens=64)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "Why is the sky blue?")
        await wait_for(pilot, lambda: app.chat.query(Thought), what="the thought block")
        block = app.chat.query_one(Thought)
        await wait_for(pilot, lambda: block.title.startswith("thinking… ") and not block.collapsed, what="live")
        await wait_for(pilot, lambda: app.chat.request_id is None, what="the reply")
        assert block.text.strip() == "Rayleigh scattering, shorter waves." and block.collapsed
        assert block.title.startswith("thought for ") and "<think>" not in app.chat.query(Reply).last().text
        await send(pilot, "/think off")
        assert app.session.think is False
        await send(pilot, "And at sunset?")
        await wait_for(pilot, lambda: app.chat.request_id is None, what="the second reply")
        assert len(app.chat.query(Thought)) == 1  # the stub thinks only when asked to


@pytest.mark.anyio
async def test_chat_on_a_server_shows_the_thought_the_server_split(models):
    """`chat --url`: the server's reasoning_content deltas fill the thought block."""
    import openai

    from macinfer.serve.server import create_app, serve_in_thread

    path = models("r1_distill")
    with serve_in_thread(create_app(LLM(str(path), num_blocks=64), model_name="r1")) as url:
        want = openai.OpenAI(base_url=url + "/v1", api_key="x").chat.completions.create(
            model="r1", messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0).choices[0].message
        app = ChatApp(url=url, max_tokens=8)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot)
            await send(pilot, PROMPT)
            await wait_for(pilot, lambda: app.chat.request_id is None, what="the reply")
            block = app.chat.query_one(Thought)
            assert block.text == want.reasoning_content and block.title.startswith("thought for ")
            assert app.chat.query(Reply).last().text == (want.content or "")
