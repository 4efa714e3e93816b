"""A request's images as the engine carries them: the vision tower's inputs, where each image's
tokens sit in the prompt, what each image hashes to, and its embeddings once computed.

    prompt ids   [ t t t <boi> i i i i <eoi> t t <boi> i i i i <eoi> t t ]
    spans              [3 ............ 9)      [11 ........... 17)
    embeds       rows 0 .. 16 (the prompt up to its last image token), computed once

The processor (macinfer.modelio.vision) expands each image's placeholder into its image tokens
and makes `pixel_values` (and whatever else the family's vision tower reads). The runner
(macinfer.core.model_runner) feeds a prefill chunk that covers positions below `end` as input
embeddings instead of ids: `embeds` is computed by the vision tower the first time such a chunk
runs, kept until the chunk that reaches `end`, and computed again after a preemption. The block
pool keys every block that overlaps an image's span with that image's hash (vLLM's "extra
keys"), so the same image later is a prefix hit and a different one never is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class MultiModalInputs:
    """The images of one prompt.

    Args:
        pixel_values: the processor's pixel array(s) for the vision tower.
        tower_kwargs: the processor's other outputs the tower reads (image_sizes, spatial_shapes, ...).
        spans: each image's token positions [start, end) in the prompt, in order.
        hashes: each image's content hash (32 bytes), in the same order.
    """

    pixel_values: Any
    tower_kwargs: dict = field(default_factory=dict)
    spans: list[tuple[int, int]] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    # (end, D): the language model's input embeddings for prompt positions [0, end), once computed.
    embeds: Any = None

    def __post_init__(self):
        if len(self.spans) != len(self.hashes) or not self.spans:
            raise ValueError(f"{len(self.spans)} image spans for {len(self.hashes)} image hashes")
        if any(b <= a for a, b in self.spans) or any(
                b[0] < a[1] for a, b in zip(self.spans, self.spans[1:])):
            raise ValueError(f"image spans must be non-empty, in order and apart: {self.spans}")

    @property
    def num_images(self) -> int:
        return len(self.spans)

    @property
    def end(self) -> int:
        """One past the last image token: positions from here on are plain token embeddings."""
        return self.spans[-1][1]

    def block_extra_keys(self, start: int, end: int) -> bytes:
        """The extra key of the block holding positions [start, end): the hashes of the images
        whose tokens it overlaps, in order (b"" for a block of text only)."""
        return b"".join(h for (a, b), h in zip(self.spans, self.hashes) if a < end and start < b)

    def same_images(self, other: "MultiModalInputs | None") -> bool:
        return other is not None and other.hashes == self.hashes and other.spans == self.spans
