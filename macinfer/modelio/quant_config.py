"""What `macinfer quantize` is asked for and what it reports: QuantConfig, QuantizeReport.

Kept apart from the job itself (macinfer.modelio.quantize) so that the AWQ transform
(macinfer.modelio.awq), which the job calls, can take a QuantConfig without importing
the job back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from macinfer.errors import MacinferError

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
RECIPES = {
    "uniform": "every linear and embedding layer at --bits",
    "mixed": "embeddings and lm_head at 8 bits; v_proj and down_proj of the first and last "
    "eighth of the layers and every third one between at 6 bits (8 if --bits >= 5); the rest at --bits",
}

Progress = Callable[[str, int, int, str], None]  # (stage, done, total, item)


@dataclass(frozen=True)
class QuantConfig:
    """How to quantise. Validates on construction (one-line MacinferError)."""

    bits: int = 4
    group_size: int = 64
    recipe: str = "uniform"
    awq: bool = False
    calibration: Path | None = None  # AWQ text; None: models/calibration.txt
    calibration_tokens: int = 1024
    seq_len: int = 256
    n_grid: int = 20  # AWQ search resolution (mlx-lm's default)
    dtype: str | None = None  # scales/biases/float layers; None: keep the source's

    def __post_init__(self):
        if self.bits not in BITS:
            raise MacinferError(f"unsupported --bits {self.bits}: choose one of {', '.join(map(str, BITS))}")
        if self.group_size not in GROUP_SIZES:
            raise MacinferError(
                f"unsupported --group-size {self.group_size}: choose one of {', '.join(map(str, GROUP_SIZES))}"
            )
        if self.recipe not in RECIPES:
            raise MacinferError(f"unknown recipe '{self.recipe}': choose one of {', '.join(RECIPES)}")
        if self.dtype not in (None, "float16", "bfloat16", "float32"):
            raise MacinferError(f"unsupported dtype '{self.dtype}': float16, bfloat16 or float32")
        if self.calibration_tokens < self.seq_len or self.seq_len < 16:
            raise MacinferError("calibration needs at least one sequence of 16 tokens or more")


@dataclass
class QuantizeReport:
    """What `quantize` did; the CLI prints it as the summary."""

    source: str
    out: Path
    config: QuantConfig
    num_params: int
    size_before: int  # tensor bytes of the source as loaded (MLX form)
    size_after: int  # tensor bytes written
    bpw_before: float
    bpw_after: float
    layers_by_bits: dict[int, int]  # bits -> number of quantised layers
    requantized_from: str | None  # e.g. "4-bit g32": the source was already quantised
    seconds: float
    awq_loss_ratio: list[float] = field(default_factory=list)  # per block, AWQ / RTN output error
