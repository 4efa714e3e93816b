"""What every engine offers its callers: the paged LLMEngine and the mlx-lm fallback DenseEngine alike.

The Python API (macinfer.llm), the server's engine loop (macinfer.serve.async_engine), the chat
app's backend and the benchmarks type against `Engine`; neither engine is probed for what it has.
What differs between them is stated in `EngineFeatures`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from macinfer.core.metrics import RequestMetrics
from macinfer.core.outputs import StreamDelta
from macinfer.core.sampling import SamplingParams


@dataclass(frozen=True)
class EngineFeatures:
    """What an engine can do, as the UI and the server report it.

    Args:
        paged: the paged KV cache (False: mlx-lm's dense per-request caches).
        prefix_cache: the prefix cache is on (True) or off (False); None: this engine has none.
        speculation: speculative decoding is on or off; None: this engine cannot speculate.
        structured_output: requests may carry a grammar (SamplingParams.structured).
        drafter: the drafter's name while speculation is on, else None.
    """

    paged: bool
    prefix_cache: bool | None
    speculation: bool | None
    structured_output: bool
    drafter: str | None = None


class Engine(Protocol):
    """Requests in, streamed deltas out, one step at a time; one thread owns it and calls step()."""

    tokenizer: object  # mlx-lm's TokenizerWrapper
    max_model_len: int
    max_num_seqs: int
    attention_backend: str  # "metal", "reference", "mlx-lm" or "none"
    features: EngineFeatures

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    fork_of: str | None = None, mm=None) -> str:
        """Queue a request (with its images, `mm`: macinfer.modelio.multimodal); returns its id.
        Raises MacinferError (one line) if it cannot run."""

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free what it holds; its final delta comes with the next step()."""

    def step(self) -> list[StreamDelta]:
        """One step: a StreamDelta per request that moved (a finished one's carries `output`)."""

    def has_unfinished(self) -> bool:
        """Whether step() has anything left to do."""

    def request_ids(self) -> list[str]:
        """The requests in flight (queued or running)."""

    def request_metrics(self, request_id: str) -> RequestMetrics | None:
        """A request's live metrics; None once it has finished."""

    def describe(self) -> str:
        """One line: the KV budget and what it buys, the attention backend."""

    def kv_stats(self) -> dict:
        """KV usage now (blocks, tokens, bytes; None where the engine has no blocks)."""

    def prepare(self) -> None:
        """Build now what the first request would otherwise build (a server calls it before serving)."""

    def release_thread(self) -> None:
        """Called by a thread that stepped this engine, just before it ends."""
