"""Per-request sampling parameters: what a request asks of the sampler (macinfer.core.sampling).

It imports no MLX, so a process that only builds requests (the chat UI, whose engine
runs in another process) validates them without loading MLX.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    Args:
        temperature: 0 means greedy (argmax).
        top_p: nucleus sampling, in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        min_p: drop tokens below min_p * p(top token); 0 disables it.
        seed: makes sampling reproducible; None draws a fresh seed.
        max_tokens: generated tokens at most.
        stop: strings that end generation (not included in the text).
        stop_token_ids: extra token ids that end generation (besides EOS).
        ignore_eos: keep generating past EOS (benchmarks).

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

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # An empty stop string would match before every character: it stops nothing.
        self.stop = [x for x in self.stop if x]
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer from 0 to 2**64 - 1, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
