"""A stand-in engine that streams fixed Markdown at a fixed rate: the TUI's cost without a model.

    StubBackend(rate=300)  # 300 tok/s, one token per step

It speaks ChatBackend's vocabulary, so EngineRunner drives it in the engine process
and its deltas take the real path (runner -> pipe -> Messages -> chat screen ->
widgets). A step "computes" for 1/rate seconds (`time.sleep`, as a decode step
waits on an MLX eval), then hands out its delta in Python, just as a fast model's
decode step does. `python scripts/bench/tui_overhead.py --stub-rate 300` and the tests use it
(ChatApp(make_backend=functools.partial(StubBackend, rate=300))); it imports no MLX.
"""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

from macinfer.core.metrics import RequestMetrics
from macinfer.core.outputs import RequestOutput, StreamDelta
from macinfer.errors import MacinferError
from macinfer.tui.messages import KVStats, ModelCard

SAMPLE = """\
## Tides

The sea keeps **two clocks**: the moon's pull, which lifts the water twice a day, and the \
wind, which writes on its surface whatever it likes. Sailors learn both, and trust neither.

- Spring tides come with the new and the full moon, when sun and moon pull *together*.
- Neap tides come between, when they pull at right angles.
- A tide table is a forecast, not a promise.

```python
def high_water(hour: float, period: float = 12.42) -> bool:
    return (hour % period) < 0.5
```

> The sea, once it casts its spell, holds one in its net of wonder forever.

1. Watch the water line on the harbour wall.
2. Count the hours between marks.
3. Write down what the wind did, because it `always` matters.

"""


def tokens_of(text: str) -> list[str]:
    """Split `text` into token-sized pieces (up to 5 characters after any whitespace); they join back to it."""
    return re.findall(r"\s*\S{1,5}|\s+", text)


SAMPLE_TOKENS = tokens_of(SAMPLE)


class StubBackend:
    """One "model" that emits SAMPLE (repeated) at `rate` tokens per second.

    Args:
        spec: ignored (the runner passes the MODEL spec).
        rate: tokens per second; a step takes 1/rate seconds plus its own Python.
        length: tokens per reply before it stops ("stop"); None: only max_tokens ends it ("length").
        thought: a thought each reply starts with, in `<think>` tags (a model that thinks first);
            its replies are then split as macinfer.chat splits a `<think>` family's (this imports
            mlx-lm's TextStateMachine).
    """

    block_size = 16

    def __init__(self, spec: str | None = None, *, rate: float = 300.0, length: int | None = None,
                 thought: str | None = None):
        self.spec = spec
        self.rate = rate
        self.length = length
        self.thought = tokens_of(f"<think>\n{thought}\n</think>\n\n") if thought else []
        self.info = SimpleNamespace(name=f"stub-{rate:g}tok/s")
        self.peak = None
        self.requests: dict[str, dict] = {}
        self.emitted: dict[str, list[str]] = {}  # every text delta handed out, by request
        self.first_token_time: float | None = None  # of the latest request

    # -- loading ----------------------------------------------------------------------
    def load(self, progress) -> ModelCard:
        progress("loading the stub", 0, None)
        return self.card()

    def card(self) -> ModelCard:
        return ModelCard(name=self.info.name, weight_bytes=0, num_params=0, quantization="none",
                         context_length=1 << 20, bytes_per_decode_step=0, kv_bytes_per_token=0,
                         peak_gbps=None, peak_source=None, prefix_cache=None, speculation=None, spec=self.spec)

    def close(self) -> None:
        self.requests.clear()

    # -- prompts and requests -----------------------------------------------------------
    def encode(self, messages: list[dict]) -> list[int]:
        return list(range(sum(len(tokens_of(m["content"])) for m in messages) + 4 * len(messages)))

    def prepare(self, messages: list[dict], params, think: bool | None = None):
        """(prompt ids, sampling, the reply's parser): a `<think>` family's when the stub thinks."""
        parser = None
        self._thinks = bool(self.thought) and think is not False  # for the add_request that follows
        if self._thinks:
            from macinfer.chat.output import OutputParser
            from macinfer.chat.reasoning import Thinking

            parser = OutputParser(None, Thinking("think", "<think>", "</think>"), False, None, None)
        return self.encode(messages), params, parser

    def add_request(self, prompt_token_ids: list[int], params, request_id: str) -> str:
        n = params.max_tokens if self.length is None else min(self.length, params.max_tokens)
        self.requests[request_id] = {
            "metrics": RequestMetrics(arrival_time=time.perf_counter(), prompt_tokens=len(prompt_token_ids)),
            "prompt": prompt_token_ids, "n": n, "done": 0, "thinks": getattr(self, "_thinks", bool(self.thought)),
            "reason": "length" if self.length is None or params.max_tokens < self.length else "stop",
        }
        self.emitted[request_id] = []
        return request_id

    def step(self) -> list[StreamDelta]:
        """Sleep one step, then one token for every running request."""
        time.sleep(1 / self.rate)
        now = time.perf_counter()
        deltas = []
        for rid, r in list(self.requests.items()):
            m = r["metrics"]
            lead = self.thought if r["thinks"] else []
            i = r["done"]
            text = lead[i] if i < len(lead) else SAMPLE_TOKENS[(i - len(lead)) % len(SAMPLE_TOKENS)]
            r["done"] += 1
            self.emitted[rid].append(text)
            if m.first_token_time is None:
                m.first_token_time = self.first_token_time = now
            m.generation_tokens = r["done"]
            m.decode_steps = r["done"] - 1
            delta = StreamDelta(rid, text, [r["done"]])
            if r["done"] >= r["n"]:
                del self.requests[rid]
                m.finish_time = now
                delta.finish_reason = r["reason"]
                delta.output = RequestOutput(rid, r["prompt"], list(range(1, r["done"] + 1)),
                                             "".join(self.emitted[rid]), r["reason"], m)
            deltas.append(delta)
        return deltas

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def request_metrics(self, request_id: str) -> None:
        return None  # no engine, no prefix cache

    # -- what the engine can tell ------------------------------------------------------
    def kv_stats(self) -> KVStats:
        held = sum(len(r["prompt"]) + r["done"] for r in self.requests.values())
        used = -(-held // self.block_size)
        return KVStats(used, 4096 - used, held, self.block_size)

    def peak_memory(self) -> int:
        return 0

    @property
    def prefix_cache(self) -> None:
        return None

    @property
    def speculation(self) -> None:
        return None

    def set_option(self, name: str, on: bool) -> str:
        raise MacinferError("the stub engine has no options")
