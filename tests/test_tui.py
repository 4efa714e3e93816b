"""`macinfer chat`: headless pilot tests on a tiny model, and snapshots of the main and help screens.

The app runs its real engine process (macinfer.tui.engine_process, macinfer.tui.runner) on a tiny random
model, so these test the whole path: prompt -> chat template -> LLMEngine -> Messages ->
pipe -> widgets. Backends are injected as picklable factories (functools.partial of a
class defined here), since the engine process builds them; tests look at the engine
through `app.engine.call` (see `on_engine`).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from operator import attrgetter, methodcaller

import pytest
from click.testing import CliRunner

from macinfer.tui.app import ChatApp
from macinfer.tui.backend import ChatBackend
from macinfer.tui.screens.help import HelpScreen
from macinfer.tui.stub import StubBackend
from macinfer.tui.widgets import MetricsPanel
from macinfer.tui.widgets.transcript import Reply

SIZE = (80, 24)


@pytest.fixture
def anyio_backend():
    return "asyncio"  # async tests run under anyio's pytest plugin, on asyncio (Textual's loop)


async def wait_for(pilot, condition, timeout: float = 90.0, what: str = "condition"):
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def loaded(pilot):
    await wait_for(pilot, lambda: pilot.app.chat.model_name is not None and pilot.app.chat.loading_what is None,
                   what="the model to load")


async def send(pilot, text: str):
    pilot.app.chat.query_one("#prompt").set_text(text)
    await pilot.press("enter")


def notices(app) -> list[str]:
    return [str(w.render()) for w in app.chat.query(".notice")]


def status(app) -> str:
    return str(app.chat.query_one("#status").render())


def number(figure: str) -> float:
    return float(figure.split()[0].rstrip("%"))


async def on_engine(app, fn, *args):
    """fn(backend, *args), run in the engine process (fn must pickle)."""
    return await asyncio.wrap_future(app.engine.call(fn, *args))


class PacedBackend(ChatBackend):
    """A tiny model on a quiet machine writes a whole reply between two UI refreshes
    (text arrives at 20 Hz): pace engine steps so streaming and cancelling are observable."""

    def step(self):
        time.sleep(0.02)
        return super().step()


@pytest.fixture
def paced():
    return partial(PacedBackend, peak_bandwidth=100)


def template_length(backend, messages) -> int:
    return len(backend.llm.apply_chat_template(messages))


@pytest.fixture
def tiny(tiny_models):
    return str(tiny_models("llama"))


@pytest.mark.anyio
async def test_streamed_reply_metrics_and_history(tiny, paced):
    app = ChatApp(tiny, max_tokens=48, make_backend=paced)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        chat, panel = app.chat, app.chat.query_one(MetricsPanel)
        assert panel.figures["decode"] == "-" and panel.figures["kv_blocks"].startswith("0 / ")

        await send(pilot, "What is the capital of France?")
        await wait_for(pilot, lambda: chat.request_id is None, what="the reply")
        reply = chat.query_one(Reply)
        assert len(reply.chunks) >= 2, "the reply should arrive in several streamed pieces"
        assert reply.text and app.session.turns[-1] == {"role": "assistant", "content": reply.text}
        f = panel.figures
        for name in ("ttft", "prefill", "decode", "bandwidth"):
            assert number(f[name]) > 0, (name, f[name])
        assert f["tokens"].endswith("48 out") and f["peak"] == "100.0 GB/s (flag)"
        assert f["acceptance"] == "off"  # speculation is off by default
        assert panel.query_one("#decode-spark").data

        # Second turn: the whole history goes through the chat template.
        await send(pilot, "And of Italy?")
        await wait_for(pilot, lambda: chat.request_id is None, what="the second reply")
        history = app.session.messages()[:-1]
        assert [m["role"] for m in history] == ["user", "assistant", "user"]
        want = await on_engine(app, template_length, history)
        assert f["tokens"].startswith(f"{want} in")
        # The second prompt starts with the first: the prefix cache serves its full blocks.
        assert await on_engine(app, attrgetter("prefix_cache")) and int(f["prefix_hit"].split()[0]) >= 16, f["prefix_hit"]


@pytest.mark.anyio
async def test_escape_cancels_and_frees_every_block(tiny, paced):
    app = ChatApp(tiny, max_tokens=400, make_backend=paced)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        chat = app.chat
        await send(pilot, "Tell me a long story")
        await wait_for(pilot, lambda: chat.reply is not None and chat.reply.chunks, what="the first text")
        assert (await on_engine(app, methodcaller("kv_stats"))).used_blocks > 0
        await pilot.press("escape")
        await wait_for(pilot, lambda: chat.request_id is None, what="the cancel")
        assert not await on_engine(app, methodcaller("has_unfinished"))  # the Abort came first
        kv = await on_engine(app, methodcaller("kv_stats"))
        assert kv.used_blocks == 0 and kv.tokens_held == 0
        assert kv.free_blocks == await on_engine(app, attrgetter("engine.block_pool.num_usable_blocks"))
        assert "(reply cancelled)" in notices(app)
        generated = int(chat.query_one(MetricsPanel).figures["tokens"].split(",")[1].split()[0])
        assert 0 < generated < 400
        assert app.session.turns[-1]["role"] == "assistant"  # the partial reply stays in the history
        # The engine still serves the next prompt.
        app.session.max_tokens = 4
        await send(pilot, "Hi")
        await wait_for(pilot, lambda: chat.request_id is None, what="the next reply")
        assert app.session.turns[-1]["role"] == "assistant"


@pytest.mark.anyio
async def test_slash_commands(tiny, tmp_path):
    app = ChatApp(tiny, peak_bandwidth=100, max_tokens=8)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "/temp 0.7")
        assert app.session.temperature == 0.7 and "temperature 0.7" in notices(app)
        assert "temp 0.7" in status(app)
        await send(pilot, "/temp -1")
        assert app.session.temperature == 0.7 and "temperature must be a number from 0 to 2" in notices(app)[-1]
        await send(pilot, "/max-tokens 5")
        assert app.session.max_tokens == 5 and "max 5 tok" in status(app)
        await send(pilot, "/max-tokens lots")
        assert app.session.max_tokens == 5 and "expected a whole number" in notices(app)[-1]
        await send(pilot, "/system Be brief.")
        assert app.session.messages()[0] == {"role": "system", "content": "Be brief."}
        assert "system prompt set" in status(app)
        await send(pilot, "/prefix-cache off")
        await wait_for(pilot, lambda: app.chat.card.prefix_cache is False, what="the engine rebuild")
        assert notices(app)[-1] == "prefix cache off"
        assert app.chat.query_one(MetricsPanel).figures["prefix_hit"] == "off"
        await send(pilot, "/spec")
        await wait_for(pilot, lambda: app.chat.card.speculation, what="speculation on")
        assert notices(app)[-1] == "speculative decoding on (ngram drafter)"
        await send(pilot, "/spec maybe")
        assert "expected on or off" in notices(app)[-1]
        await send(pilot, "/nope")
        assert "unknown command /nope" in notices(app)[-1]

        app.session.temperature = 0
        await send(pilot, "Hello")
        await wait_for(pilot, lambda: app.chat.request_id is None, what="the reply")
        out = tmp_path / "chat.md"
        await send(pilot, f"/export {out}")
        text = out.read_text()
        assert "## System\n\nBe brief." in text and "## User\n\nHello" in text and "## Assistant" in text
        assert not list(tmp_path.glob(".*tmp"))  # written atomically, no temp file left
        await send(pilot, "/save")
        assert "give a file name" in notices(app)[-1]

        await send(pilot, "/clear")
        assert app.session.turns == [] and app.session.system == "Be brief."
        assert not app.chat.query(Reply) and "conversation cleared" in notices(app)[-1]

        await send(pilot, "/help")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)

        await send(pilot, "/model /no/such/model")
        await wait_for(pilot, lambda: app.chat.loading_what is None, what="the failed load")
        assert any("could not load /no/such/model" in n for n in notices(app))
        assert app.chat.model_name is not None and "still using" in notices(app)[-1]  # old model kept


@pytest.mark.anyio
async def test_prompt_keys_and_load_progress(tiny, monkeypatch):
    from macinfer.tui.widgets.loading import LoadingBar

    shown = []
    real_show = LoadingBar.show
    monkeypatch.setattr(LoadingBar, "show", lambda self, what, done=0, total=None: (
        shown.append(what), real_show(self, what, done, total)))
    app = ChatApp(tiny, peak_bandwidth=100, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert "loading weights" in shown and not app.chat.query_one(LoadingBar).display
        await pilot.press("a", "ctrl+j", "b")
        prompt = app.chat.query_one("#prompt")
        assert prompt.text == "a\nb"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.chat.request_id is None, what="the reply")
        assert app.session.turns[0] == {"role": "user", "content": "a\nb"} and prompt.text == ""


def test_chat_help_lists_an_example():
    from macinfer.cli.main import main

    r = CliRunner().invoke(main, ["chat", "--help"])
    assert r.exit_code == 0 and "macinfer chat" in r.output and "Examples" in r.output
    r = CliRunner().invoke(main, ["chat", "--temp", "-1"])
    assert r.exit_code == 2 and "--temp" in r.output and "Traceback" not in r.output


# -- a fast engine: the stub ----------------------------------------------------------
def stub_app(rate: float, length: int | None = None, **kwargs) -> ChatApp:
    """A ChatApp on macinfer.tui.stub.StubBackend (no model): its deltas take the real runner and Messages."""
    return ChatApp(make_backend=partial(StubBackend, rate=rate, length=length), **kwargs)


async def emitted(app) -> list[list[str]]:
    """The text deltas the stub handed out, per request, oldest request first."""
    return list((await on_engine(app, attrgetter("emitted"))).values())


@pytest.mark.anyio
async def test_fast_stream_shows_every_delta_in_few_markdown_updates():
    """At thousands of tok/s the reply batches text into far fewer Markdown updates than deltas,
    and the finished reply (widget text, Markdown document, history) is exactly the deltas joined."""
    from macinfer.tui.stub import SAMPLE

    n = 1500
    app = stub_app(rate=3000, max_tokens=n)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "Tell me about the sea")
        await wait_for(pilot, lambda: app.chat.request_id is None, what="the reply")
        reply = app.chat.query_one(Reply)
        (deltas,) = await emitted(app)
        assert len(deltas) == n
        want = "".join(deltas)
        assert want.startswith(SAMPLE) and len(want) > 3 * len(SAMPLE)  # it repeats: no piece may go missing
        assert reply.text == want and reply.source == want  # nothing lost, nothing twice, in order
        assert app.session.turns[-1] == {"role": "assistant", "content": want}
        assert 1 <= reply.updates <= n // 10, reply.updates
        assert not reply.pending
        assert "(reply cut at the 1500-token limit" in notices(app)[-1]


@pytest.mark.anyio
async def test_escape_cancels_a_fast_stream():
    app = stub_app(rate=1000, max_tokens=1_000_000)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        chat = app.chat
        await send(pilot, "Go on forever")
        await wait_for(pilot, lambda: chat.reply is not None and len(chat.reply.text) > 200, what="streamed text")
        reply = chat.reply
        await pilot.press("escape")
        await wait_for(pilot, lambda: chat.request_id is None, what="the cancel")
        assert not await on_engine(app, methodcaller("has_unfinished"))
        assert "(reply cancelled)" in notices(app)
        (deltas,) = await emitted(app)
        assert 0 < len(deltas) < 1_000_000
        assert reply.text == reply.source == "".join(deltas)  # what streamed before Esc, all of it
        assert app.session.turns[-1] == {"role": "assistant", "content": reply.text}
        app.session.max_tokens = 20
        await send(pilot, "Hi")  # the engine serves the next prompt
        await wait_for(pilot, lambda: chat.request_id is None and chat.reply is None, what="the next reply")
        assert app.session.turns[-1]["role"] == "assistant" and app.session.turns[-2]["content"] == "Hi"


@pytest.mark.anyio
async def test_clear_during_a_fast_stream():
    """/clear mid-stream cancels the reply and drops it from the screen; the next prompt streams in full."""
    app = stub_app(rate=1000, max_tokens=1_000_000)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        chat = app.chat
        await send(pilot, "Go on forever")
        await wait_for(pilot, lambda: chat.reply is not None and chat.reply.updates, what="streamed text")
        await send(pilot, "/clear")
        assert not await on_engine(app, methodcaller("has_unfinished"))  # /clear's Abort came first
        assert not chat.query(Reply) and app.session.turns == []
        app.session.max_tokens = 300
        await send(pilot, "Hi")
        await wait_for(pilot, lambda: chat.request_id is None, what="the next reply")
        (reply,) = chat.query(Reply)
        assert reply.source == reply.text == "".join((await emitted(app))[-1])
        assert [t["role"] for t in app.session.turns] == ["user", "assistant"]


def test_complete_blocks_split_after_the_last_blank_line_outside_a_fence():
    from macinfer.tui.widgets.transcript import complete_blocks

    assert complete_blocks("# Hi\n\nSome te") == ("# Hi\n\n", "Some te")
    assert complete_blocks("no blank line yet") == ("", "no blank line yet")
    fenced = "Intro\n\n```py\nx = 1\n\ny = 2"  # the blank line in the code is not a block's end
    assert complete_blocks(fenced) == ("Intro\n\n", "```py\nx = 1\n\ny = 2")
    closed = fenced + "\n```\n\nAfter"
    assert complete_blocks(closed) == (closed[:-len("After")], "After")


def markdown_shape(md) -> list[tuple[str, str | None]]:
    """Every widget under a Markdown widget, with the text it shows: what the reader sees."""
    from textual.widgets import Static

    return [(type(w).__name__, str(w.visual) if isinstance(w, Static) else None) for w in md.query("*")]


@pytest.mark.anyio
async def test_reply_shows_every_delta_at_once_and_lays_out_a_few_times(monkeypatch):
    """600 stub tokens arrive in 40 pieces, one every 1/16 s (300 tok/s). Each piece shows at once,
    in the tail (a repaint) or with the complete blocks moved into the Markdown (a layout, at most
    every LAYOUT_INTERVAL); at every point the document plus the tail is exactly the text so far.
    The finished document is the one the whole text makes in one go."""
    from textual.app import App
    from textual.widgets import Markdown

    from macinfer.tui.stub import SAMPLE_TOKENS
    from macinfer.tui.widgets import Transcript

    monkeypatch.setattr(Reply, "_run", lambda self: asyncio.Event().wait())  # the test's clock paces it

    tokens = [SAMPLE_TOKENS[i % len(SAMPLE_TOKENS)] for i in range(600)]
    pieces = ["".join(tokens[i:i + 15]) for i in range(0, 600, 15)]

    class One(App):
        def compose(self):
            yield Transcript()

    async with One().run_test(size=SIZE) as pilot:
        transcript = pilot.app.query_one(Transcript)
        reply = await transcript.add_reply()
        reply.LAYOUT_INTERVAL, reply.BUDGET = 0.25, 1.0  # layouts paced by the clock alone
        layouts = 0
        for i, piece in enumerate(pieces):
            repaints = reply.repaints
            reply.write(piece)
            await reply.show(now=i / 16)
            layouts += reply.repaints == repaints
            tail = "".join(reply.pending)
            assert reply.source + tail == "".join(pieces[:i + 1])
            assert str(reply.tail.visual) == tail + "\n" * reply.SLACK
        assert (layouts, reply.repaints) == (10, 30)  # at 0, 0.25, ... 2.25 s; repaints in between
        assert 2 <= reply.updates <= layouts  # Markdown appends: at layouts that found a complete block
        assert await reply.finish() == "".join(pieces)
        assert reply.source == reply.text and not reply.pending and not reply.tail.display
        whole = Markdown("".join(pieces), classes="turn assistant")
        await transcript.mount(whole)
        await pilot.pause()
        assert markdown_shape(reply.markdown) == markdown_shape(whole)


# -- the engine process ------------------------------------------------------------------
def engine_pid(backend) -> int:
    return os.getpid()


@pytest.mark.anyio
async def test_engine_runs_in_its_own_process_and_ends_with_the_app():
    app = stub_app(rate=1000, max_tokens=50)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        process = app.engine.process
        assert await on_engine(app, engine_pid) == process.pid != os.getpid()
        await send(pilot, "Hi")
        await wait_for(pilot, lambda: app.chat.request_id is None, what="the reply")
    assert not process.is_alive()
    assert process.exitcode == 0  # it closed its backend and returned: not killed, no MLX abort


def _gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaped yet (it has exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


UI_THAT_DIES = """
import queue, sys
from functools import partial
from macinfer.tui.engine_process import EngineProcess
from macinfer.tui.runner import Load
from macinfer.tui.stub import StubBackend

if __name__ == "__main__":
    got = queue.Queue()
    engine = EngineProcess(partial(StubBackend, rate=100), got.put)
    engine.start()
    engine.submit(Load(None))
    while type(got.get(timeout=120)).__name__ != "ModelLoaded":
        pass
    print(engine.pid, flush=True)
    got.get()  # blocks until the test kills this process
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["ui-killed", "ctrl-c"])
def test_engine_process_exits_when_the_ui_process_dies(tmp_path, sig):
    """No orphan: a UI killed outright (or interrupted by Ctrl+C, which the engine, in its own
    session, never receives) leaves no engine process behind."""
    script = tmp_path / "ui.py"
    script.write_text(UI_THAT_DIES)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    ui = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env,
                          start_new_session=True)
    try:
        child = int(ui.stdout.readline())
        os.killpg(ui.pid, sig)  # the UI's whole process group, as a terminal's Ctrl+C does
        ui.wait(timeout=60)
        deadline = time.monotonic() + 60
        while not _gone(child):
            assert time.monotonic() < deadline, "the engine process outlived its UI"
            time.sleep(0.05)
    finally:
        if ui.poll() is None:
            ui.kill()


class CrashingBackend(StubBackend):
    """Stands in for a crash in native code (MLX, Metal): the first step kills its process."""

    def step(self):
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.anyio
async def test_engine_crash_is_one_line_and_model_restarts_it():
    app = ChatApp(make_backend=CrashingBackend, max_tokens=50)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        before = len(notices(app))
        await send(pilot, "Hi")
        await wait_for(pilot, lambda: app.chat.request_id is None, what="the crash to end the reply")
        new = notices(app)[before:]
        assert new == ["the engine process stopped (killed by SIGKILL): /model MODEL starts it again"]
        assert app.chat.model_name is None and "no model" in status(app)
        assert app.session.turns == []  # the prompt got no reply: out of the history
        crashed = app.engine.pid
        await send(pilot, "/model stub")
        await loaded(pilot)
        assert app.engine.pid != crashed and app.engine.alive()


def test_stub_tokens_join_back_to_the_text():
    from macinfer.tui.stub import SAMPLE, SAMPLE_TOKENS, tokens_of

    assert "".join(SAMPLE_TOKENS) == SAMPLE and len(SAMPLE_TOKENS) > 100
    assert tokens_of("a  bcdefgh\n\n") == ["a", "  bcdef", "gh", "\n\n"]


# -- snapshots -------------------------------------------------------------------------
class SteadyBackend(ChatBackend):
    """Peak memory is process-wide (other tests raise it): pin it so snapshots repeat."""

    def peak_memory(self) -> int:
        return 123_400_000


@pytest.fixture
def snapshot_app(tiny, tmp_path):
    # A fixed directory name, so the model name in the snapshot does not depend on pytest's tmp naming.
    model = tmp_path / "tiny-chat"
    shutil.copytree(tiny, model)
    return ChatApp(str(model), make_backend=partial(SteadyBackend, peak_bandwidth=100))


async def steady(pilot):
    await loaded(pilot)
    pilot.app.chat.query_one("#prompt").cursor_blink = False  # else the cursor cell flips between runs
    await pilot.pause()


def test_snapshot_main_screen(snap_compare, snapshot_app):
    assert snap_compare(snapshot_app, terminal_size=SIZE, run_before=steady)


def test_snapshot_help_screen(snap_compare, snapshot_app):
    async def open_help(pilot):
        await steady(pilot)
        await pilot.press("f1")
        await pilot.pause()

    assert snap_compare(snapshot_app, terminal_size=SIZE, run_before=open_help)


def _stats_runner(**backend):
    """An EngineRunner over a fake backend: 1 GB read per decode step, no KV bytes, 100 GB/s peak."""
    from types import SimpleNamespace

    import macinfer.tui.runner as runner_mod
    from macinfer.perf.bandwidth import PeakBandwidth

    b = SimpleNamespace(**{"peak": PeakBandwidth(100.0, "flag"), "prefix_cache": False,
                           "info": SimpleNamespace(bytes_per_decode_step=1e9, kv_bytes_per_token=0.0),
                           "kv_stats": lambda: None, "peak_memory": lambda: None,
                           "request_metrics": lambda rid: None, **backend})
    runner = runner_mod.EngineRunner(lambda spec: b, lambda message: None)
    runner.backend = b
    return runner


def test_live_figures_count_steps_not_tokens(monkeypatch):
    """While a reply streams, one engine step can bring several deltas (a verify step's accepted
    drafts, each with its text). They share the step's clock: the step's sparkline rate counts all
    its tokens, and bandwidth counts the step once (one forward reads the weights once)."""
    import macinfer.tui.runner as runner_mod
    from macinfer.core.outputs import StreamDelta

    steps = iter([(10.0, [[5]]), (11.0, [[6], [7], [8]]), (12.0, [[9]]), (14.0, [[10], [11]])])
    clock = [10.0]

    def step():
        clock[0], ids = next(steps)
        return [StreamDelta("r", "x", t) for t in ids]

    runner = _stats_runner(step=step, speculation=True)
    runner.live["r"] = runner_mod._Live("r", prompt_tokens=4, arrival=9.5)
    monkeypatch.setattr(runner_mod.time, "perf_counter", lambda: clock[0])
    for _ in range(4):
        runner._step()
    live = runner.live["r"]
    stats = runner._stats(live, clock[0])
    assert (live.tokens, live.steps) == (7, 3)
    assert list(stats.step_tps) == pytest.approx([3.0, 1.0, 1.0])  # tokens of the step / its seconds
    assert stats.decode_tps == pytest.approx(6 / 4)
    assert stats.bandwidth == pytest.approx(1e9 * (3 / 4) / 100e9)  # 3 forwards in 4 s, not 6 tokens


def test_a_fast_stream_reaches_the_ui_in_few_pipe_writes(monkeypatch):
    """600 one-token steps at 300 tok/s: the text and the live figures go up the pipe together, at
    most every TEXT_INTERVAL (each write wakes the UI's reader, a context switch the engine pays
    for); every piece of text arrives once and in order, and the finish comes last."""
    import macinfer.tui.runner as runner_mod
    from macinfer.core.outputs import StreamDelta
    from macinfer.tui.messages import ReplyFinished, ReplyText, StatsUpdate

    clock = [10.0]
    n = 600

    def step():
        clock[0] += 1 / 300
        k = int(round((clock[0] - 10.0) * 300))
        delta = StreamDelta("r", f"t{k} ", [k])
        delta.finish_reason = "stop" if k == n else None
        return [delta]

    runner = _stats_runner(step=step, speculation=False)
    posted = []
    runner.post = posted.append
    runner.live["r"] = runner_mod._Live("r", prompt_tokens=4, arrival=9.5)
    monkeypatch.setattr(runner_mod.time, "perf_counter", lambda: clock[0])
    for _ in range(n):
        runner._step()
    messages = [m for p in posted for m in (p if isinstance(p, list) else [p])]
    seconds = n / 300
    assert len(posted) <= seconds / runner_mod.TEXT_INTERVAL + 2
    assert "".join(m.text for m in messages if isinstance(m, ReplyText)) == "".join(f"t{k} " for k in range(1, n + 1))
    assert 1 <= sum(isinstance(m, StatsUpdate) for m in messages) <= seconds / runner_mod.STATS_INTERVAL + 1
    assert isinstance(messages[-1], ReplyFinished) and not runner.live


def test_live_figures_at_a_clock_reading_of_zero():
    """A first token stamped at exactly 0.0 (a clock that starts there) is still a first token."""
    import macinfer.tui.runner as runner_mod

    runner = _stats_runner(speculation=False)
    live = runner_mod._Live("r", prompt_tokens=4, arrival=-0.5, first_token=0.0, last_token=2.0, tokens=3, steps=2)
    stats = runner._stats(live, 2.0)
    assert stats.ttft == pytest.approx(0.5)
    assert stats.decode_tps == pytest.approx(1.0)  # 2 tokens after the first, in 2 s
    assert stats.bandwidth == pytest.approx(1e9 * 1.0 / 100e9)


@pytest.mark.anyio
@pytest.mark.parametrize("cached, prompt_cached", [(0, False), (32, False), (48, True)])
async def test_live_prefill_counts_computed_tokens_and_says_when_the_prompt_was_cached(monkeypatch, cached,
                                                                                       prompt_cached):
    """The prefill figure counts only the prompt tokens the engine computed; when the prefix cache
    held the whole prompt there is no rate to show, and the panel says so."""
    import macinfer.tui.runner as runner_mod
    from macinfer.core.metrics import RequestMetrics
    from macinfer.core.outputs import StreamDelta

    m = RequestMetrics(prompt_tokens=50, cached_tokens=cached, prompt_cached=prompt_cached)
    runner = _stats_runner(step=lambda: [StreamDelta("r", "x", [5])], speculation=False,
                           request_metrics=lambda rid: m if rid == "r" else None)
    runner.live["r"] = runner_mod._Live("r", prompt_tokens=50, arrival=9.5)
    monkeypatch.setattr(runner_mod.time, "perf_counter", lambda: 10.0)
    runner._step()
    stats = runner._stats(runner.live["r"], 10.0)
    assert stats.prompt_cached is prompt_cached
    assert stats.prefill_tps == (None if prompt_cached else pytest.approx((50 - cached) / 0.5))
    from textual.app import App

    class PanelApp(App):
        def compose(self):
            yield MetricsPanel()

    async with PanelApp().run_test() as pilot:
        panel = pilot.app.query_one(MetricsPanel)
        panel.update_stats(stats)
        assert panel.figures["prefill"] == ("prompt cached" if prompt_cached else f"{(50 - cached) / 0.5:.1f} tok/s")


@pytest.mark.anyio
async def test_save_and_load_a_conversation(tiny, tmp_path):
    """/save writes JSON (atomically, nothing left behind); /load brings back the turns, the system
    prompt and the sampling settings."""
    import json

    saved = tmp_path / "chat.json"
    app = ChatApp(tiny, peak_bandwidth=100, system="Be brief.", max_tokens=6)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "Hello")
        await wait_for(pilot, lambda: app.chat.request_id is None, what="the reply")
        turns = [dict(t) for t in app.session.turns]
        await send(pilot, f"/save {saved}")
        assert notices(app)[-1].startswith(f"saved 2 turns to {saved}")
        assert not list(tmp_path.glob(".*tmp"))
        data = json.loads(saved.read_text())
        assert data == {"format": "macinfer-chat/1", "model": tiny,
                        "sampling": {"temperature": 0.0, "max_tokens": 6, "seed": None},
                        "messages": [{"role": "system", "content": "Be brief."}, *turns]}

        await send(pilot, "/clear")
        await send(pilot, "/system -")
        await send(pilot, "/load /no/such/chat.json")
        assert "/load: cannot read /no/such/chat.json" in notices(app)[-1] and app.session.turns == []
        await send(pilot, f"/load {saved}")
        assert app.session.turns == turns and app.session.system == "Be brief." and app.session.max_tokens == 6
        assert [r.text for r in app.chat.query(Reply)] == [turns[1]["content"]]
        assert "loaded 2 turns" in notices(app)[-1] and app.chat.loading_what is None  # same model: no reload


@pytest.mark.anyio
async def test_chat_resume_restores_a_saved_conversation(tiny, tmp_path, monkeypatch):
    """`macinfer chat --resume`, through the command itself: the turns are shown and sent with the
    next prompt, the file's settings apply, and an option given on the line wins.
    """
    from macinfer.cli.chat import chat_cmd
    from macinfer.tui.session import ChatSession

    turns = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! **How** can I help?"}]
    saved = ChatSession(system="Be brief.", max_tokens=6, turns=turns).save(tmp_path / "chat.json", model=tiny)
    apps = []
    monkeypatch.setattr(ChatApp, "run", lambda self: apps.append(self))
    r = CliRunner().invoke(chat_cmd, ["--resume", str(saved), "--max-tokens", "4", "--peak-bandwidth", "100"])
    assert r.exit_code == 0, r.output
    app = apps[0]
    assert app.model_spec == tiny and app.session.max_tokens == 4 and app.session.system == "Be brief."
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert app.session.turns == turns
        assert [str(w.render()) for w in app.chat.query(".user")] == ["Hello"]
        assert [r.text for r in app.chat.query(Reply)] == [turns[1]["content"]]
        await send(pilot, "And again?")
        await wait_for(pilot, lambda: app.chat.request_id is None, what="the reply after resuming")
        history = app.session.messages()[:-1]
        assert [m["role"] for m in history] == ["system", "user", "assistant", "user"]
        want = await on_engine(app, template_length, history)
        assert app.chat.query_one(MetricsPanel).figures["tokens"] == f"{want} in, 4 out"


@pytest.mark.parametrize("content, message", [
    ("{not json", "not JSON (line 1)"),
    ('{"format": "macinfer-chat/1", "model": null, "sampling": {"temperature": -1, "max_tokens": 5}, '
     '"messages": []}', "sampling.temperature must be a number >= 0, got -1"),
    ('{"format": "macinfer-chat/1", "model": null, "sampling": {"temperature": 0, "max_tokens": 5}, '
     '"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]}', "messages[1]"),
    ('[1, 2]', "not a macinfer chat file"),
])
def test_resume_from_a_bad_file_is_one_line_and_starts_nothing(tmp_path, monkeypatch, content, message):
    from macinfer.cli.chat import chat_cmd

    bad = tmp_path / "bad.json"
    bad.write_text(content)
    monkeypatch.setattr(ChatApp, "run", lambda self: pytest.fail("the app must not start"))
    r = CliRunner().invoke(chat_cmd, ["--resume", str(bad)])
    assert r.exit_code == 1 and r.output.count("\n") == 1 and message in r.output, r.output
    missing = CliRunner().invoke(chat_cmd, ["--resume", str(tmp_path / "nope.json")])
    assert missing.exit_code == 1 and "cannot read" in missing.output and missing.output.count("\n") == 1


@pytest.mark.anyio
async def test_load_switches_to_the_saved_model(tmp_path):
    """A file saved with another model brings that model back (the stub engine: no weights)."""
    from macinfer.tui.session import ChatSession

    saved = ChatSession(system="Be brief.", turns=[{"role": "user", "content": "Hi"},
                                                   {"role": "assistant", "content": "Hello."}])
    path = saved.save(tmp_path / "chat.json", model="other-model")
    app = stub_app(rate=1000)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert app.chat.card.spec is None and await on_engine(app, attrgetter("spec")) is None
        await send(pilot, f"/load {path}")
        await wait_for(pilot, lambda: app.chat.card is not None and app.chat.card.spec == "other-model",
                       what="the saved model")
        assert await on_engine(app, attrgetter("spec")) == "other-model" and app.session == saved
