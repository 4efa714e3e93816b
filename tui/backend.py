"""The adapter between the chat UI and macinfer's engine: the only module that calls it.

Everything here runs in the engine process (macinfer.tui.runner), never in the UI's.
It speaks the engine's vocabulary (`add_request`, `step`, `abort_request`,
`has_unfinished`, `kv_stats`) over `LLM(...).engine`, macinfer's paged,
continuously-batched LLMEngine, so the runner reads like an engine loop.
Features the engine does not have yet (prefix cache, speculation) report None,
which the UI shows as "n/a".
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from macinfer.errors import MacinferError
from macinfer.tui.messages import KVStats, ModelCard

if TYPE_CHECKING:  # importing these loads MLX and mlx-lm: seconds, done in load()
    from macinfer.core.metrics import RequestMetrics
    from macinfer.core.outputs import StreamDelta
    from macinfer.core.sampling_params import SamplingParams
    from macinfer.engine.protocol import Engine

Progress = Callable[[str, int, "int | None"], None]  # (what, done, total or None)


@dataclass
class ImagePrompt:
    """A prompt with images: its token ids and its images (macinfer.modelio.multimodal)."""

    ids: list[int]
    mm: object

    def __len__(self) -> int:
        return len(self.ids)


def find_peak(override: float | None):
    """The named peak bandwidth (macinfer.perf.bandwidth); None if it cannot be found."""
    from macinfer.perf import bandwidth

    try:
        return bandwidth.peak_bandwidth(override)
    except ImportError:  # its probe cache lives in macinfer.modelio.embedded; probe uncached
        return bandwidth.PeakBandwidth(bandwidth.probe_gbps(), "CPU probe")
    except Exception:
        return None


class ChatBackend:
    """One loaded model and the requests running on it.

    Args:
        spec: MODEL as `macinfer run` takes it (None: the embedded default).
        dequantize: load quantised weights as float32 (fast on CPU hosts).
        peak_bandwidth: GB/s override for the utilisation figure.
        engine_options: passed to the engine (e.g. kv_memory).
    """

    def __init__(self, spec: str | None = None, *, dequantize: bool | None = None,
                 peak_bandwidth: float | None = None, **engine_options):
        self.spec = spec
        self.dequantize = dequantize
        self.peak_override = peak_bandwidth
        self.engine_options = engine_options
        self.draft_when_on = engine_options.get("draft") or "auto"  # what /spec on drafts with
        self.llm = None
        self.engine: Engine | None = None  # the paged LLMEngine or the mlx-lm DenseEngine
        self.info = None
        self.peak = None

    # -- loading ----------------------------------------------------------------------
    def load(self, progress: Progress) -> ModelCard:
        """Load the model (converting a GGUF first, with progress) and find the peak bandwidth."""
        progress("importing MLX", 0, None)
        from macinfer.llm import LLM
        from macinfer.modelio.loader import resolve

        # Resolve first with our own progress callback, so a first-time GGUF
        # conversion reports to the UI (the loader's default bar would draw on stderr).
        progress("resolving model", 0, None)
        try:
            resolve(self.spec, progress=lambda done, total, what="": progress(
                f"converting {what}".strip() if what else "converting model", done, total))
        except ImportError as e:
            raise MacinferError(f"the embedded model is not available in this install ({e.name}): "
                                "pass a model directory or .gguf file") from None
        progress("loading weights", 0, None)
        self.llm = LLM(self.spec, dequantize=self.dequantize, **self.engine_options)
        self.engine = self.llm.engine
        self.info = self.llm.info
        progress("finding peak memory bandwidth", 0, None)
        self.peak = find_peak(self.peak_override)
        return self.card()

    def card(self) -> ModelCard:
        i = self.info
        return ModelCard(
            name=i.name, weight_bytes=i.weight_bytes, num_params=i.num_params,
            quantization=i.quantization, context_length=i.context_length,
            bytes_per_decode_step=i.bytes_per_decode_step, kv_bytes_per_token=i.kv_bytes_per_token,
            peak_gbps=self.peak.gbps if self.peak else None,
            peak_source=self.peak.source if self.peak else None,
            prefix_cache=self.prefix_cache, speculation=self.speculation,
            attention=self.engine.attention_backend, spec=self.spec,
            drafter=self.engine.features.drafter if self.engine is not None else None,
        )

    def close(self) -> None:
        if self.engine is not None:
            for rid in self.engine.request_ids():
                self.engine.abort_request(rid)
        self.llm = self.engine = None
        gc.collect()
        import mlx.core as mx

        mx.clear_cache()

    # -- prompts ----------------------------------------------------------------------
    def encode(self, messages: list[dict]) -> list[int]:
        """Token ids of the conversation with the model's chat template applied.

        A model without a template gets the turns as plain text, one per paragraph.
        """
        if getattr(self.llm.tokenizer, "chat_template", None):
            return self.llm.apply_chat_template(messages)
        return self.llm.encode("\n\n".join(m["content"] for m in messages) + "\n\n")

    def prepare(self, messages: list[dict], params: SamplingParams, think: bool | None = None):
        """(prompt ids, sampling, the reply's OutputParser or None) for the conversation.

        Through macinfer.chat when the model has a chat template (its thought split from its
        answer; `think` is enable_thinking, None: the template's default); plain text otherwise.
        """
        if any(m.get("images") for m in messages):
            return self._image_prepare(messages, params, think)
        if not getattr(self.llm.tokenizer, "chat_template", None):
            return self.encode(messages), params, None
        from macinfer.chat.request import ChatRequest, prepare

        prepared = prepare(self.llm.tokenizer, ChatRequest(messages, enable_thinking=think), params)
        return prepared.prompt_ids, prepared.params, prepared.new_parser()

    def _image_prepare(self, messages: list[dict], params: SamplingParams, think: bool | None):
        """`prepare` for a conversation whose turns attach images (paths, macinfer.tui.session): they are
        read here, in the engine process, each placed before its turn's text; an ImagePrompt comes back."""
        from macinfer.chat.request import ChatRequest, prepare
        from macinfer.modelio.images import read_image

        if self.llm.images is None:
            raise MacinferError(f"{self.info.name} does not take images: /image - drops the attachment")
        pics = [read_image(p, f"image {p}") for m in messages for p in m.get("images", ())]
        if not getattr(self.llm.tokenizer, "chat_template", None):
            text = "\n\n".join(m["content"] for m in messages) + "\n\n"
            return ImagePrompt(*self.llm.image_prompt(text, pics)), params, None
        turns = [{k: v for k, v in m.items() if k != "images"} | (
            {"content": [{"type": "image"} for _ in m["images"]] + [{"type": "text", "text": m["content"]}]}
            if m.get("images") else {}) for m in messages]
        prepared = prepare(self.llm.tokenizer, ChatRequest(turns, enable_thinking=think), params, images=pics,
                           vision=self.llm.images)
        return ImagePrompt(prepared.prompt_ids, prepared.mm), prepared.params, prepared.new_parser()

    # -- requests ---------------------------------------------------------------------
    def add_request(self, prompt: list[int] | ImagePrompt, params: SamplingParams, request_id: str) -> str:
        """Queue a request; raises MacinferError if it cannot fit the context or the KV pool."""
        if isinstance(prompt, ImagePrompt):
            return self.engine.add_request(prompt.ids, params, request_id=request_id, mm=prompt.mm)
        return self.engine.add_request(prompt, params, request_id=request_id)

    def step(self) -> list[StreamDelta]:
        """One engine step: a delta for every request that moved (the last one has .output)."""
        return self.engine.step()

    def abort_request(self, request_id: str) -> None:
        """Stop the request and free its KV blocks now."""
        self.engine.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.engine is not None and self.engine.has_unfinished()

    def request_metrics(self, request_id: str) -> RequestMetrics | None:
        """The engine's live metrics of a running request (its prefix hit is known once scheduled)."""
        return self.engine.request_metrics(request_id) if self.engine is not None else None

    # -- what the engine can tell ------------------------------------------------------
    def peak_memory(self) -> int:
        """MLX's peak memory (weights, KV pool, activations) in bytes."""
        import mlx.core as mx

        return mx.get_peak_memory()

    def kv_stats(self) -> KVStats | None:
        """Blocks used / free and tokens held in the KV pool right now."""
        if self.engine is None:
            return None
        s = self.engine.kv_stats()
        return KVStats(s["used_blocks"], s["free_blocks"], s["live_tokens"], s["block_size"])

    @property
    def prefix_cache(self) -> bool | None:
        """Prefix cache on/off; None if this engine has none."""
        return self.engine.features.prefix_cache if self.engine is not None else None

    @property
    def speculation(self) -> bool | None:
        """Speculative decoding on/off; None if this engine cannot speculate."""
        return self.engine.features.speculation if self.engine is not None else None

    def set_option(self, name: str, on: bool) -> str:
        """Toggle "prefix_cache" or "speculation" by rebuilding the engine on the loaded model.

        Returns:
            What happened, one line.
        """
        what = {"prefix_cache": "prefix cache", "speculation": "speculative decoding"}[name]
        if getattr(self, name) is None:
            raise MacinferError(f"{what} is not available in this engine")
        if self.engine.has_unfinished():
            raise MacinferError(f"a reply is running: toggle {what} after it")
        before = dict(self.engine_options)
        if name == "prefix_cache":
            self.engine_options["enable_prefix_cache"] = on
        else:
            self.engine_options["draft"] = self.draft_when_on if on else None
        options = self.engine_options
        try:
            self._rebuild_engine(options)
        except Exception as e:
            self.engine_options = before
            self._rebuild_engine(before)
            raise MacinferError(f"could not switch {what}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        drafter = self.engine.features.drafter if self.engine is not None else None
        detail = f" ({drafter or options['draft']} drafter)" if name == "speculation" and on else ""
        return f"{what} {'on' if on else 'off'}{detail}"

    def _rebuild_engine(self, options: dict) -> None:
        from macinfer.llm import make_engine

        self.llm.engine = self.engine = None
        gc.collect()  # drop the old KV pool before allocating the new one
        self.llm.engine_kind, self.engine = make_engine(self.llm.model, self.llm.tokenizer, self.info,
                                                        images=self.llm.images, **options)
        self.llm.engine = self.engine
