"""Per-request sampling parameters: what a request asks of the sampler (macinfer.core.sampling).

It imports no MLX, so a process that only builds requests (the chat UI, whose engine
runs in another process) validates them without loading MLX.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # grammar imports MLX: checked lazily, only for a request that has a grammar
    from macinfer.core.grammar import StructuredOutput

# Every stop string is searched in the text after each token: a bound keeps that cheap.
# (OpenAI takes 4; vLLM does not bound them.)
MAX_STOP_STRINGS = 16

MAX_STOP_CHARS = 1000  # characters of one stop string at most (the search after each token reads it)

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs (macinfer.core.logprobs reports them)

MAX_TEMPERATURE = 2.0  # OpenAI's range; beyond it the distribution is flat noise


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    Args:
        temperature: 0 means greedy (argmax); at most 2 (OpenAI's range).
        top_p: nucleus sampling, in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        min_p: drop tokens below min_p * p(top token); 0 disables it.
        seed: makes sampling reproducible; None draws a fresh seed.
        max_tokens: generated tokens at most.
        stop: strings that end generation (not included in the text): at most 16, each at most
            1,000 characters.
        stop_token_ids: extra token ids that end generation (besides EOS).
        ignore_eos: keep generating past EOS (benchmarks).
        logprobs: None, or report each token's logprob and the `logprobs` most likely
            alternatives (0 to 20; macinfer.core.logprobs).
        presence_penalty: subtracted from the logit of each token present in the context
            window (OpenAI's range, -2 to 2).
        frequency_penalty: subtracted once per occurrence in the context window (-2 to 2).
        repetition_penalty: a multiplicative penalty (> 0; 1 disables it), as in mlx-lm.
        repetition_context_size: the last tokens the three penalties look at (mlx-lm's 20).
        logit_bias: token id -> a bias (-100 to 100) added to its logit.
        structured: the shape the output must have (a JSON schema, a regex, ...), enforced
            while sampling (macinfer.core.grammar); None: free text.

    Example:
        >>> SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64, seed=1)
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured: StructuredOutput | None = None

    def __post_init__(self):
        # NOTE: the one check the CLI, the server and the Python API share; every message starts
        # with the field's name (the server reports it as the error's `param`).
        self.stop = _stop_strings(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(_is_int(t) and t >= 0
                                                                         for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), got {_show(self.stop_token_ids)}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        _check_real("temperature", self.temperature, lambda x: 0 <= x <= MAX_TEMPERATURE,
                    f"must be a number from 0 to {MAX_TEMPERATURE:g}")
        _check_real("top_p", self.top_p, lambda x: 0 < x <= 1, "must be in (0, 1]")
        _check_real("min_p", self.min_p, lambda x: 0 <= x <= 1, "must be in [0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {_show(self.top_k)}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {_show(self.max_tokens)}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer from 0 to 2**64 - 1, got {_show(self.seed)}")
        self._check_logits_options()

    def _check_logits_options(self) -> None:
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS} (top alternatives), "
                             f"got {_show(self.logprobs)}")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_real(name, getattr(self, name), lambda x: -2 <= x <= 2, "must be a number from -2 to 2")
        _check_real("repetition_penalty", self.repetition_penalty, lambda x: x > 0, "must be a number > 0 (1 disables it)")
        if not _is_int(self.repetition_context_size) or self.repetition_context_size < 1:
            raise ValueError(f"repetition_context_size must be an integer >= 1, got {_show(self.repetition_context_size)}")
        for tok, bias in dict(self.logit_bias).items():
            if not _is_int(tok) or tok < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}")
            _check_real("logit_bias", bias, lambda x: -100 <= x <= 100, f"values must be numbers from -100 to 100 (token {tok})")
        if self.structured is not None and not isinstance(self.structured, _structured_output_type()):
            raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x) -> bool:
    # numpy integers count; True is an int to Python but not a count or a seed.
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _show(x) -> str:
    r = repr(x)
    return r if len(r) <= 60 else r[:57] + "..."


def _check_real(name: str, x, in_range: Callable[[float], bool], rule: str) -> None:
    """Raise "NAME RULE, got X" unless x is a finite real number (not a bool) and in_range(x)."""
    if not (isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and in_range(x)):
        raise ValueError(f"{name} {rule}, got {_show(x)}")


def _stop_strings(stop) -> list[str]:
    """The stop strings as a list: a string is one stop string; None is none; empty strings are dropped.

    An empty stop string would match before every character: it stops nothing.
    """
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop):
        raise ValueError(f"stop must be a string or a list of strings, got {_show(stop)}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    longest = max((len(x) for x in stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"stop holds a string of {longest:,} characters; at most {MAX_STOP_CHARS:,} are allowed")
    return [x for x in stop if x]


def _structured_output_type() -> type:
    from macinfer.core.grammar import StructuredOutput
    return StructuredOutput
