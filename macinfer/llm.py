"""The Python entry point: `LLM(model).generate(prompts, params)`.

INTERIM single-stream implementation on mlx-lm's generate_step; the paged,
continuously-batched engine replaces its internals behind the same interface.
"""

from __future__ import annotations

import time
import uuid
from typing import Iterable, Iterator

import mlx.core as mx

from macinfer.errors import MacinferError
from macinfer.outputs import RequestOutput, StreamDelta
from macinfer.sampling import Sampler, SamplingParams


class LLM:
    """Load a model and generate with it.

    Args:
        model: a catalog name, local directory, GGUF file or Hugging Face repo id;
            None for the embedded default (SmolLM2-135M-Instruct).

    Example:
        >>> llm = LLM()
        >>> llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0].text
    """

    def __init__(self, model: str | None = None, *, dequantize: bool = False, **engine_options):
        from macinfer.loader import load_model

        self.model, self.tokenizer, self.info = load_model(model, dequantize=dequantize)
        self.engine_options = engine_options

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

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise MacinferError("this model has no chat template: send raw text instead")
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    # -- generation ------------------------------------------------------------------
    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield text deltas as tokens are produced; the last delta carries the output."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        self.info.check_context(len(ids))
        from mlx_lm.generate import generate_step

        out = RequestOutput(request_id=uuid.uuid4().hex[:12], prompt_token_ids=ids)
        m = out.metrics
        m.arrival_time = time.perf_counter()
        m.prompt_tokens = len(ids)
        detok = self.tokenizer.detokenizer
        detok.reset()
        eos = set(self.tokenizer.eos_token_ids) | set(params.stop_token_ids)
        sampler = Sampler(params)
        max_tokens = min(params.max_tokens, self.info.context_length - len(ids))
        steps = generate_step(mx.array(ids), self.model, max_tokens=max_tokens, sampler=sampler)
        finish = "length"
        for tok, _ in steps:
            tok = int(tok)
            now = time.perf_counter()
            if m.first_token_time is None:
                m.first_token_time = now
            else:
                m.decode_steps += 1
                m.kv_tokens_sum += len(ids) + len(out.token_ids)
            if tok in eos and not params.ignore_eos:
                finish = "stop"
                break
            out.token_ids.append(tok)
            m.generation_tokens = len(out.token_ids)
            detok.add_token(tok)
            seg = detok.last_segment
            if seg:
                yield StreamDelta(out.request_id, seg, [tok])
        detok.finalize()
        tail = detok.last_segment
        out.text = detok.text
        m.finish_time = time.perf_counter()
        out.finish_reason = finish
        yield StreamDelta(out.request_id, tail, [], finish, out)

    def generate(self, prompts: str | list[int] | Iterable, params: SamplingParams | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        outs = []
        for p in prompts:
            for d in self.stream(p, params):
                if d.output is not None:
                    outs.append(d.output)
        return outs

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        return self.generate([self.apply_chat_template(messages)], params)[0]
