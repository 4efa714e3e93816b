"""AsyncEngine: how a step's deltas reach the asyncio side."""

import asyncio
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from macinfer.core.outputs import StreamDelta
from macinfer.core.sampling import SamplingParams
from macinfer.serve.async_engine import AsyncEngine


class Ticker:
    """An engine stand-in: every request gets one token per step, `n` steps, then finishes; nothing
    steps before `wait_for` requests are in (so that each step has all of them)."""

    def __init__(self, n: int, wait_for: int):
        self.n, self.left, self.wait_for = n, {}, wait_for

    def add_request(self, ids, params, request_id=None):
        self.left[request_id] = self.n

    def abort_request(self, request_id):
        self.left.pop(request_id, None)

    def has_unfinished(self):
        if len(self.left) >= self.wait_for:
            self.wait_for = 0
        return bool(self.left) and not self.wait_for

    def step(self):
        out = []
        for rid in list(self.left):
            self.left[rid] -= 1
            done = self.left[rid] == 0
            out.append(StreamDelta(rid, "x", [7], "length" if done else None))
            if done:
                del self.left[rid]
        return out

    def release_thread(self):
        """Nothing kept per thread (Engine protocol)."""


def test_a_steps_deltas_reach_each_event_loop_in_one_wake_up():
    aengine = AsyncEngine(Ticker(5, wait_for=8)).start()
    wakeups = []

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakeups.append(1), real(*a))[1]

        async def client():
            return [d.text async for d in aengine.generate([1, 2], SamplingParams(max_tokens=5))]

        return await asyncio.gather(*(client() for _ in range(8)))

    try:
        texts = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert texts == [["x"] * 5] * 8  # every delta, in order, to its own client
    assert len(wakeups) == 5  # one per step, not one per delta (40)


def test_a_caller_that_stops_at_the_last_delta_is_done_not_aborted():
    """A non-streaming route takes deltas up to the finished one and never asks for more. The
    request must leave num_active then (it counts toward the queue's 429 and keeps a model in use),
    and closing the iterator later must not send the engine an abort for a request it finished."""
    aengine = AsyncEngine(Ticker(3, wait_for=1)).start()
    aborts = []
    real_abort = aengine.abort
    aengine.abort = lambda rid: (aborts.append(rid), real_abort(rid))[1]

    async def main():
        stream = aengine.generate([1, 2], SamplingParams(max_tokens=3))
        d = await stream.__anext__()
        while d.finish_reason is None:
            d = await stream.__anext__()
        active = aengine.num_active
        await stream.aclose()
        return active

    try:
        active = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert (active, aborts) == (0, [])


def test_one_engine_is_stepped_by_one_async_engine_at_a_time():
    engine = Ticker(1, wait_for=1)
    first = AsyncEngine(engine).start()
    try:
        with pytest.raises(RuntimeError, match="already served"):
            AsyncEngine(engine).start()
    finally:
        first.shutdown()
    AsyncEngine(engine).start().shutdown()  # once the first is down, another may take over


def test_a_burst_of_requests_to_an_idle_engine_is_stepped_together():
    """Requests sent a few ms apart to an idle engine all make its first step (AsyncEngine._settle);
    without the wait, the engine thread steps as soon as the first one is in."""
    engine = Ticker(1, wait_for=1)
    firsts = []
    real_step = engine.step
    engine.step = lambda: (firsts.append(len(engine.left)) if not firsts else None, real_step())[1]
    aengine = AsyncEngine(engine)
    aengine.BURST_GAP_S, aengine.BURST_MAX_S = 0.2, 2.0  # wide: a loaded machine's sleeps stay inside
    aengine.start()

    loop = asyncio.new_event_loop()  # never run: the deltas only need somewhere to go

    def sender():
        for i in range(6):
            aengine._streams[f"r{i}"] = (loop, asyncio.Queue())  # as generate() registers its stream
            aengine._send(("add", f"r{i}", [1], SamplingParams(max_tokens=1), None, None))
            time.sleep(0.01)

    t = threading.Thread(target=sender)
    t.start()
    t.join()
    deadline = time.monotonic() + 10
    while not firsts and time.monotonic() < deadline:
        time.sleep(0.01)
    aengine._streams.clear()
    aengine.shutdown()
    loop.close()
    assert firsts == [6]


def test_a_process_that_served_a_model_exits_cleanly(tiny_models):
    """The engine thread's MLX thread state (compiled traces, random key) is freed before the thread ends:
    left to the thread's C++ exit, it raced the interpreter's exit and aborted the process (exit 134,
    "terminate called without an active exception") about every other run."""
    script = textwrap.dedent(f"""
        import asyncio
        from macinfer.llm import LLM
        from macinfer.core.sampling import SamplingParams
        from macinfer.serve.async_engine import AsyncEngine

        llm = LLM({str(tiny_models("llama"))!r})
        aengine = AsyncEngine(llm.engine).start()

        async def one(i):
            async for _ in aengine.generate([5 + i, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True)):
                pass

        async def main():
            await asyncio.gather(*(one(i) for i in range(3)))

        asyncio.run(main())
        aengine.shutdown()
        assert llm.engine.runner.decode_graph.num_traces > 0  # a compiled graph was traced on the engine thread
    """)
    _exits_zero(script, runs=4)


def test_a_process_that_exits_mid_generation_exits_cleanly(tiny_models):
    """Nobody calls shutdown and requests are still running as the interpreter exits: the engine is
    stopped at exit (an atexit hook), its launched step drained, its MLX state freed. Left alone, the
    daemon threads were cut off inside MLX and the process aborted (exit 134) about every third run."""
    script = textwrap.dedent(f"""
        import asyncio
        from macinfer.llm import LLM
        from macinfer.core.sampling import SamplingParams
        from macinfer.serve.async_engine import AsyncEngine

        llm = LLM({str(tiny_models("llama"))!r})
        aengine = AsyncEngine(llm.engine).start()

        async def one(n):
            async for _ in aengine.generate([5, 6, 7, 8] * 8, SamplingParams(max_tokens=n, ignore_eos=True)):
                pass

        async def main():
            running = [asyncio.get_running_loop().create_task(one(400)) for _ in range(4)]
            await one(12)  # returns while the four others still generate

        asyncio.run(main())
    """)
    _exits_zero(script, runs=4)


def _exits_zero(script: str, runs: int) -> None:
    """The script, in fresh interpreters `runs` times: each must exit 0 (an exit-time abort is 134)."""
    for _ in range(runs):
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-800:]
