"""The Python entry point: `LLM(model).generate(prompts, params)`.

A thin synchronous front over `LLMEngine` (paged KV cache, continuous batching):
`generate` queues every prompt and steps the engine until all are done, so the
prompts are served as one continuously-batched workload; `stream` steps it for
one request and yields its text deltas.

Which engine (`engine=`, `--engine` on the CLI): "paged" is LLMEngine; "mlx-lm" is
DenseEngine (macinfer.engine.dense_engine: mlx-lm's own BatchGenerator, dense caches);
"auto" (the default) is paged, falling back to mlx-lm for a model the paged engine
refuses, with one line on stderr naming the features that are off and why.

Across processes (`parallel=`, macinfer.engine.distributed): started by `mlx.launch` with more
than one rank, every rank constructs the same LLM; each loads its part of the model (mlx-lm's
sharding), rank 0 gets the usable LLM and the others serve its forwards inside the constructor,
then exit (SystemExit(0)) when rank 0 calls `close()` or exits.
"""

from __future__ import annotations

import sys
from typing import Iterable, Iterator

from macinfer.engine.llm_engine import LLMEngine
from macinfer.errors import MacinferError
from macinfer.kv.model_probe import UnseenAttention
from macinfer.modelio.multimodal import MultiModalInputs
from macinfer.modelio.vision import ImageEncoder, vision_status
from macinfer.core.outputs import RequestOutput, StreamDelta
from macinfer.core.sampling import SamplingParams


class LLM:
    """Load a model and generate with it.

    Args:
        model: a catalog name, local directory, GGUF file or Hugging Face repo id;
            None for the embedded default (SmolLM2-135M-Instruct).
        engine: "auto" (paged, else mlx-lm's BatchGenerator), "paged" or "mlx-lm"
            (module docstring); `self.engine_kind` says which one runs.
        parallel: under mlx.launch with several ranks, how the model is split: "tensor",
            "pipeline" or "auto" (tensor where mlx-lm can, else pipeline); None, or a single rank,
            runs in this process alone.
        micro_batches: with parallel="pipeline", micro-batches per forward, so that the stages
            overlap (None: one per rank for forwards of 32 tokens a rank or more; 1: none).

    Example:
        >>> llm = LLM()
        >>> llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0].text
    """

    def __init__(self, model: str | None = None, *, dequantize: bool | None = None, engine: str = "auto",
                 parallel: str | None = None, micro_batches: int | None = None, **engine_options):
        from macinfer.engine import distributed
        from macinfer.modelio.loader import load_model

        if engine not in ENGINES:
            raise MacinferError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        self.ranks = distributed.join(parallel, micro_batches=micro_batches) if parallel is not None else None
        if self.ranks is not None and engine == "mlx-lm":
            raise MacinferError("the mlx-lm engine cannot run across ranks: use the paged engine")
        self.model, self.tokenizer, self.info = load_model(
            model, dequantize=dequantize, **({"group": self.ranks.group, "parallel": self.ranks.parallel} if self.ranks else {}))
        # A vision-language model's eyes (macinfer.modelio.vision), where mlx-vlm can give them; None: text only.
        self.images = load_images(self.info, self.model) if self.ranks is None and engine != "mlx-lm" else None
        if self.ranks is not None:
            self.ranks.parallel = self.info.extra["parallel"]
            engine_options = distributed.engine_options(self.ranks, engine_options)
            if not self.ranks.is_leader:  # serve rank 0's forwards until it stops, then leave
                follower = LLMEngine(self.model, self.tokenizer, self.info, ranks=self.ranks, **engine_options)
                distributed.follow(follower.runner, self.ranks)
                raise SystemExit(0)
            self.engine_kind, self.engine = "paged", LLMEngine(self.model, self.tokenizer, self.info,
                                                               ranks=self.ranks, **engine_options)
        else:
            self.engine_kind, self.engine = make_engine(self.model, self.tokenizer, self.info, engine,
                                                        images=self.images, **engine_options)
            if self.engine_kind != "paged":
                self.images = None
        self.engine_options = engine_options

    def close(self) -> None:
        """Across ranks: release the other ranks (they exit); also done at exit. Nothing otherwise."""
        if self.ranks is not None:
            self.ranks.stop()

    # -- prompts ---------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise MacinferError("the prompt is empty: give some text to complete")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise MacinferError("the prompt is empty: give some text to complete")
        return ids

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The prompt's token ids: messages (and tools, OpenAI's function schemas) through the chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise MacinferError("this model has no chat template: send raw text instead")
        try:
            return list(self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True))
        except Exception as e:  # jinja's TemplateError, raise_exception() in the template, a TypeError in it ...
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise MacinferError(f"the model's chat template failed on these messages ({why})") from None

    def image_prompt(self, messages: list[dict] | str, images: list,
                     tools: list[dict] | None = None) -> tuple[list[int], MultiModalInputs]:
        """A prompt with images: its token ids (each image's tokens in place) and its MultiModalInputs.

        Args:
            messages: chat messages whose content lists hold {"type": "image"} parts where the images go
                (in order), rendered by the chat template; or raw text, the images placed before it.
            images: RGB PIL images (macinfer.modelio.images.read_image), one per image part.
            tools: OpenAI's function schemas, for the chat template.

        Raises:
            MacinferError: the model does not see, or the images do not fit the prompt.
        """
        if self.images is None:
            status = vision_status(self.info.config)
            why = "it is a text-only model" if status == "no" else status.replace("yes, ", "it sees but runs ", 1)
            raise MacinferError(f"{self.info.name} does not take images: {why}")
        text = (self.images.placeholder * len(images) + messages if isinstance(messages, str)
                else self._template_text(messages, len(images), tools))
        return self.images.process(text, images)

    def _template_text(self, messages: list[dict], num_images: int, tools: list[dict] | None = None) -> str:
        """The chat template's text for messages with image parts. A template that drops the image parts
        (text only) gets the model's placeholders in front of each message's text instead."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise MacinferError("this model has no chat template: send raw text instead")
        try:
            kw = {"tools": tools} if tools else {}
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
            if text.count(self.images.placeholder) != num_images:
                flat = [{**m, "content": _flatten_parts(m.get("content"), self.images.placeholder)} for m in messages]
                text = self.tokenizer.apply_chat_template(flat, tokenize=False, add_generation_prompt=True, **kw)
        except Exception as e:  # jinja's TemplateError, raise_exception() in the template ...
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise MacinferError(f"the model's chat template failed on these messages ({why})") from None
        return text

    # -- generation ------------------------------------------------------------------
    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               mm: MultiModalInputs | None = None) -> Iterator[StreamDelta]:
        """Yield text deltas as tokens are produced; the last delta carries the output.

        Closing the generator early aborts the request (its blocks are freed). `mm`: the prompt's
        images (`image_prompt` makes both).
        """
        ids = self.encode(prompt)
        self.info.check_context(len(ids))
        rid = self.engine.add_request(ids, params or SamplingParams(), **({"mm": mm} if mm is not None else {}))
        done = False
        try:
            while not done:
                for d in self.engine.step():
                    if d.request_id == rid:
                        done = d.output is not None
                        yield d
        finally:
            if not done:
                self.engine.abort_request(rid)  # frees its blocks now

    def generate(
        self,
        prompts: str | list[int] | Iterable,
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched; outputs in the prompts' order.

        Args:
            prompts: a string, a list of token ids, or a list of either.
            params: one SamplingParams for all, or one per prompt.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise MacinferError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = [self.encode(p) for p in prompts]
        for i in ids:
            self.info.check_context(len(i))
        rids = [self.engine.add_request(i, p) for i, p in zip(ids, params)]
        wanted = set(rids)
        results: dict[str, RequestOutput] = {}
        try:
            while len(results) < len(rids):
                for d in self.engine.step():
                    if d.output is not None and d.request_id in wanted:
                        results[d.request_id] = d.output
        finally:
            for rid in rids:
                if rid not in results:
                    self.engine.abort_request(rid)
        return [results[r] for r in rids]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        return self.generate([self.apply_chat_template(messages)], params)[0]


ENGINES = ("auto", "paged", "mlx-lm")


def load_images(info, model):
    """The image encoder of a vision-language model (macinfer.modelio.vision), or None (one line on stderr
    when the model sees but macinfer runs its text only)."""
    import mlx.core as mx

    status = vision_status(info.config)
    if status == "no":
        return None
    if status != "yes":
        print(f"note: {info.name} sees, but runs text only: {status.split('(', 1)[-1].rstrip(')')}", file=sys.stderr)
        return None
    return ImageEncoder.load(info.path, model, info.config, cast_float32=not mx.metal.is_available())


def _flatten_parts(content, placeholder: str):
    """A message's content as one string, each image part as the model's placeholder."""
    if not isinstance(content, list):
        return content
    return "".join(placeholder if p.get("type") in ("image", "image_url") else p.get("text", "") for p in content)


def make_engine(model, tokenizer, info, engine: str = "auto", images=None, **options):
    """The engine for a loaded model: ("paged", LLMEngine) or ("mlx-lm", DenseEngine).

    "auto" asks the paged engine's own check (inspect_model) and then runs one 2-token
    request through it (some refusals only show in a real forward: a model that wants an
    explicit mask array, or a window its cache does not have); if it refuses the model,
    DenseEngine runs it, `engine.fallback_reason` says why, and one line on stderr says
    what is off. "paged" on a refused model raises the refusal (one line); "mlx-lm" with
    a draft or quantised KV raises too, since it has neither.
    """
    from macinfer.engine.dense_engine import DenseEngine

    model_type = getattr(info, "model_type", None) or getattr(model, "model_type", "?")
    if engine == "mlx-lm":
        asked = [what for k, what in (("draft", "speculation (draft)"), ("kv_bits", "quantised KV (kv_bits)"))
                 if options.get(k)]
        if asked:
            raise MacinferError(f"the mlx-lm engine has no {' or '.join(asked)}: use the paged engine")
        return "mlx-lm", DenseEngine(model, tokenizer, info, **options)
    if engine == "paged":
        return "paged", LLMEngine(model, tokenizer, info, images=images, **options)
    from macinfer.kv.model_probe import inspect_model

    try:
        inspect_model(model, model_type)
    except MacinferError as refusal:
        return "mlx-lm", _fall_back(refusal, model_type, model, tokenizer, info, options)
    paged = LLMEngine(model, tokenizer, info, images=images, **options)  # its own errors (a KV budget too small) are the user's
    try:
        _first_forward(paged)
    except MacinferError as refusal:
        return "mlx-lm", _fall_back(refusal, model_type, model, tokenizer, info, options)
    return "paged", paged


def _first_forward(engine) -> None:
    """One 2-token request through the engine, to its end (no full KV block: nothing is cached)."""
    from macinfer.core.sampling import SamplingParams

    engine.add_request([0, 0], SamplingParams(max_tokens=1, ignore_eos=True), request_id="macinfer-first-forward")
    while engine.has_unfinished():
        engine.step()


def _fall_back(refusal: MacinferError, model_type: str, model, tokenizer, info, options: dict):
    from macinfer.engine.dense_engine import OFF_FEATURES, DenseEngine

    reason = str(refusal).splitlines()[0] if str(refusal) else type(refusal).__name__
    reason = reason if reason.startswith(f"{model_type}: ") else f"{model_type}: {reason}"
    dense = DenseEngine(model, tokenizer, info, serial=isinstance(refusal, UnseenAttention), fallback_reason=reason,
                        **options)
    turns = "; requests take turns (mlx-lm's batch masks do not fit its attention)" if dense.serial else ""
    print(f"note: running on mlx-lm's BatchGenerator, without {', '.join(OFF_FEATURES)}{turns}: "
          f"the paged engine refuses the model ({reason})", file=sys.stderr)
    return dense
