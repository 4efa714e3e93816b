"""`macinfer chat --url`: the chat UI on a running server (macinfer.tui.remote) and the server panel (macinfer.tui.scrape,
tui.widgets.server).

A tiny model is served with the real app (create_app, serve_in_thread) on a loopback port; the
chat's engine process streams from it with the openai client, and the panel polls its /metrics.
The per-rank rows are checked on a /metrics page of two ranks, served by a stub HTTP server.
"""

from __future__ import annotations

import http.server
import socket
import threading
import time

import openai
import pytest
from click.testing import CliRunner
from textual.app import App

from macinfer.cli.chat import chat_cmd
from macinfer.llm import LLM
from macinfer.serve.server import create_app, serve_in_thread
from test_tui import SIZE, loaded, notices, number, send, wait_for
from macinfer.tui import scrape
from macinfer.tui.app import ChatApp
from macinfer.tui.widgets import MetricsPanel
from macinfer.tui.widgets.server import ServerPanel
from macinfer.tui.widgets.transcript import Reply

MODEL = "tiny-llama"


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def served(tiny_models):
    """(base url, LLM) of a tiny llama served on a free port; its steps paced so a reply lasts long
    enough to cancel (a tiny model writes hundreds of tokens a second)."""
    llm = LLM(str(tiny_models("llama")), num_blocks=65)
    step = llm.engine.step
    llm.engine.step = lambda: (time.sleep(0.01), step())[1]
    with serve_in_thread(create_app(llm, model_name=MODEL)) as url:
        yield url, llm


def greedy(url: str, messages: list[dict], max_tokens: int):
    """The server's own non-streamed greedy answer."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)


def aborted(url: str) -> float:
    """Requests the server aborted because their client left (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(scrape.fetch(url))
    return next(s.value for f in families for s in f.samples if s.name == "macinfer_requests_aborted_total")


@pytest.mark.anyio
async def test_reply_streams_from_the_server_and_equals_its_greedy_answer(served):
    url, llm = served
    app = ChatApp(url=url, max_tokens=24)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        chat = app.chat
        assert chat.model_name == MODEL and chat.card.server == url
        await send(pilot, "What is the capital of France?")
        await wait_for(pilot, lambda: chat.request_id is None, what="the reply")
        want = greedy(url, app.session.messages()[:-1], 24)
        assert chat.query_one(Reply).text == want.choices[0].message.content
        f = chat.query_one(MetricsPanel).figures
        assert f["tokens"] == f"{want.usage.prompt_tokens} in, {want.usage.completion_tokens} out"
        assert number(f["ttft"]) > 0 and number(f["decode"]) > 0  # measured here, the network included
        assert not chat.query_one("#engine").display  # this process has no KV pool to show

        # The server section: its KV pool from /metrics, as the engine counts it (idle: nothing running).
        panel = chat.query_one(ServerPanel)
        s = llm.engine.kv_stats()
        # NOTE: both figures waited for: a scrape taken while `greedy` was in the server's queue shows
        # the idle pool beside "1 wait".
        await wait_for(pilot, lambda: (panel.figures.get("kv") == f"{s['used_blocks']} / {s['num_blocks']}"
                                       and panel.figures.get("requests") == "0 run, 0 wait"),
                       what="a scrape after the reply")
        assert s["num_blocks"] == 64
        assert panel.figures["ranks"] == "1" and not panel.query_one("#server-ranks").display

        # /model asks the server for another model: one it does not serve is one line, the chat goes on.
        await send(pilot, "/model nope")
        await wait_for(pilot, lambda: f"still using {MODEL}" in notices(app), what="the refusal")
        assert f"could not load nope: {url} does not serve nope: it serves {MODEL}" in notices(app)


@pytest.mark.anyio
async def test_escape_closes_the_stream_and_the_server_frees_the_request(served):
    url, llm = served
    app, before = ChatApp(url=url, max_tokens=2000), aborted(url)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        chat = app.chat
        await send(pilot, "Tell me a long story")
        await wait_for(pilot, lambda: chat.reply is not None and chat.reply.chunks, what="the first text")
        await pilot.press("escape")
        await wait_for(pilot, lambda: chat.request_id is None, what="the cancel")
        assert "(reply cancelled)" in notices(app)
        # The server saw the client leave and aborted the request (it would run for seconds more).
        await wait_for(pilot, lambda: aborted(url) == before + 1, timeout=10, what="the server to abort")
        assert not llm.engine.has_unfinished() and llm.engine.kv_stats()["used_blocks"] == 0


@pytest.mark.anyio
async def test_a_refused_request_is_one_line(served):
    url, llm = served
    app, text = ChatApp(url=url, max_tokens=8), "hi " * 5000  # past the tiny model's context: a 400
    n = len(llm.apply_chat_template([{"role": "user", "content": text.strip()}]))
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, text)
        await wait_for(pilot, lambda: app.chat.request_id is None, what="the refusal")
        error = notices(app)[-1]
        assert error == f"{url} answered 400: the prompt is {n} tokens but {MODEL} holds at most 512: shorten it"
        assert app.session.turns == []  # the prompt that got no reply is dropped


# -- the per-rank rows -----------------------------------------------------------------------
TWO_RANKS = """\
# TYPE macinfer_kv_blocks_used gauge
macinfer_kv_blocks_used{model="a"} 12.0
macinfer_kv_blocks_used{model="b"} 99.0
# TYPE macinfer_kv_blocks_total gauge
macinfer_kv_blocks_total{model="a"} 129.0
macinfer_kv_blocks_total{model="b"} 300.0
# TYPE macinfer_requests_running gauge
macinfer_requests_running{model="a"} 2.0
# TYPE macinfer_requests_waiting gauge
macinfer_requests_waiting{model="a"} 1.0
# TYPE macinfer_ranks gauge
macinfer_ranks{model="a"} 2.0
# TYPE macinfer_distributed_plans counter
macinfer_distributed_plans_total{model="a"} 400.0
# TYPE macinfer_distributed_plan_seconds counter
macinfer_distributed_plan_seconds_total{model="a"} 0.6
# TYPE macinfer_rank_active_memory_bytes gauge
macinfer_rank_active_memory_bytes{model="a",rank="0"} 1.5e+09
macinfer_rank_active_memory_bytes{model="a",rank="1"} 2.25e+08
# TYPE macinfer_rank_comm_seconds gauge
macinfer_rank_comm_seconds{model="a",rank="0"} 0.00125
macinfer_rank_comm_seconds{model="a",rank="1"} 0.0031
"""


def test_two_ranks_parse_to_exact_rows_for_the_chatted_model():
    f = scrape.parse(TWO_RANKS, model="a")
    assert (f.kv_used, f.kv_total, f.running, f.waiting, f.ranks) == (12, 129, 2, 1, 2)
    assert [(r.rank, r.memory_bytes, r.comm_seconds) for r in f.per_rank] == [(0, 1.5e9, 0.00125), (1, 2.25e8, 0.0031)]
    assert scrape.show(f) == {"kv": "12 / 129", "requests": "2 run, 1 wait", "ranks": "2", "plan": "1.50 ms",
                              "rank 0": "1.5 GB  1.25 ms", "rank 1": "225.0 MB  3.10 ms"}
    # Plan time per plan since the previous scrape: 100 plans in 0.05 s.
    before = scrape.parse(TWO_RANKS.replace("400.0", "300.0").replace("} 0.6", "} 0.55"), model="a")
    assert scrape.plan_ms(f, before) == pytest.approx(0.5)
    assert scrape.parse(TWO_RANKS, model="b").kv_total == 300 and scrape.parse("", None).empty


class _Page(http.server.BaseHTTPRequestHandler):
    body: str | None = TWO_RANKS  # None: no /metrics (a 404, as mlx_lm.server answers)

    def do_GET(self):
        found = self.path == "/metrics" and self.body is not None
        self.send_response(200 if found else 404)
        self.end_headers()
        self.wfile.write(self.body.encode() if found else b"not found")

    def log_message(self, *args):
        pass


@pytest.fixture
def page():
    """A stub server whose /metrics is `_Page.body` (set it per test); yields its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class PanelApp(App):
    def __init__(self, url: str):
        super().__init__()
        self.url = url

    def compose(self):
        yield ServerPanel(self.url)


@pytest.mark.anyio
async def test_panel_shows_a_row_per_rank(page, monkeypatch):
    monkeypatch.setattr(_Page, "body", TWO_RANKS.replace('model="a",', "").replace('{model="a"}', ""))
    app = PanelApp(page)
    async with app.run_test(size=(40, 20)) as pilot:
        panel = app.query_one(ServerPanel)
        await wait_for(pilot, lambda: panel.figures, timeout=10, what="a scrape")
        lines = str(panel.query_one("#server-ranks").render()).splitlines()
        assert lines == ["2 ranks: memory, comm/fwd", " 0 1.5 GB  1.25 ms", " 1 225.0 MB  3.10 ms",
                         "plan send 1.50 ms"]


@pytest.mark.anyio
async def test_panel_without_metrics_says_so_in_one_line(page, monkeypatch):
    monkeypatch.setattr(_Page, "body", None)
    app = PanelApp(page)
    async with app.run_test(size=(40, 20)) as pilot:
        panel = app.query_one(ServerPanel)
        await wait_for(pilot, lambda: panel.figures, timeout=10, what="a scrape")
        assert panel.figures == {"note": f"no /metrics at {page}: server figures need `macinfer serve`"}
        assert str(panel.query_one("#server-note").render()) == panel.figures["note"]


# -- the command line ------------------------------------------------------------------------
def closed_port() -> int:
    """A port nothing listens on (bound, never listening: a connection is refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    closed_port.held = s  # keep it bound for the test
    return s.getsockname()[1]


@pytest.mark.parametrize("args, message", [
    (["--url", "localhost:8000"], "--url wants a server's address like http://127.0.0.1:8000, got 'localhost:8000'"),
    (["--url", "http://127.0.0.1:1", "--kv-memory", "2GB", "--draft", "ngram"],
     "--kv-memory, --draft: set on a model loaded here; with --url, the server's own settings apply"),
    (["--model", "x"], "--api-key and --model go with --url"),
    (["--url", "http://127.0.0.1:{port}"], "cannot reach http://127.0.0.1:{port}: "),
])
def test_bad_url_or_options_are_one_line_and_start_nothing(args, message):
    port = closed_port()
    r = CliRunner().invoke(chat_cmd, [a.format(port=port) for a in args])
    assert r.exit_code == 1 and r.output.startswith("Error: " + message.format(port=port)), r.output
    assert r.output.count("\n") == 1 and "Traceback" not in r.output


def test_unknown_model_on_the_server_is_one_line(served):
    url, _ = served
    r = CliRunner().invoke(chat_cmd, ["--url", url + "/v1", "--model", "nope"])
    assert r.exit_code == 1 and r.output == f"Error: {url} does not serve nope: it serves {MODEL}\n", r.output
