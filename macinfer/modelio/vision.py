"""A vision-language model's eyes: its processor and its vision tower + projector, from mlx-vlm.

The language model of a vision-language checkpoint is loaded by mlx-lm as for text (its wrapper
classes drop the vision weights) and runs on the paged engine unchanged. This module loads the
rest with mlx-vlm (the optional extra `macinfer[vision]`): `ImageEncoder.load` builds mlx-vlm's
model from the same directory lazily, puts the mlx-lm language model in place of mlx-vlm's own
(one copy of the weights, and mlx-vlm's embedding step then reads the very embedding table the
paged model uses), and evaluates only the vision tower and projector.

    text with placeholders + images ──process──> prompt ids (each placeholder expanded to the
                                                 image's tokens) + MultiModalInputs
    MultiModalInputs + prompt ids ──embed──────> (end, D) input embeddings: mlx-vlm's own
                                                 get_input_embeddings, so every family's way of
                                                 placing (and scaling) its image features is its own

Sizes and resizing are the processor's (mlx-vlm's, or transformers' PIL ones). Families are
listed in FAMILIES with the token that closes each image's tokens; a checkpoint whose family is
not listed runs its text only (`vision_status` says so, for `show` and `ls`).
"""

from __future__ import annotations

import importlib.util
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from macinfer.modelio.multimodal import MultiModalInputs
from macinfer.errors import MacinferError
from macinfer.modelio.images import image_hash

VISION_EXTRA = "pip install 'macinfer[vision]'"


@dataclass(frozen=True)
class Family:
    """What macinfer needs to know of a vision family beyond what mlx-vlm knows.

    placeholder: what the chat template writes where an image goes (the processor expands it).
    end_token: the token that closes each image's tokens (each image's span ends there).
    max_images: images one prompt may hold.
    """

    placeholder: str
    end_token: str
    max_images: int = 8


# NOTE: each family here is checked token for token against mlx-vlm's own generation
# (tests/test_vision.py); docs/vision.md says why each is exact.
FAMILIES = {
    "gemma3": Family(placeholder="<start_of_image>", end_token="<end_of_image>"),
    "mistral3": Family(placeholder="[IMG]", end_token="[IMG_END]"),
    "lfm2-vl": Family(placeholder="<image>", end_token="<|image_end|>"),
}


def sees(config: dict) -> bool:
    """Whether a checkpoint's config describes a vision tower."""
    return bool(config.get("vision_config")) or "vision_tower" in json.dumps(config.get("architectures", ""))


def vision_status(config: dict) -> str:
    """One phrase for `show` and `ls`: "no", "yes", or "yes, text only here (why)"."""
    if not sees(config):
        return "no"
    family = config.get("model_type")
    if family not in FAMILIES:
        return f"yes, text only here ({family} images are not supported)"
    if importlib.util.find_spec("mlx_vlm") is None:  # found, not imported: `ls` stays fast
        return f"yes, text only here (needs {VISION_EXTRA})"
    return "yes"


class ImageEncoder:
    """The processor and vision tower of one loaded vision-language model.

    Args:
        family: its FAMILIES entry.
        model_type: its config's model_type.
        vlm: mlx-vlm's model, whose `language_model` is the paged engine's.
        processor: mlx-vlm's processor for it (tokenizer + image processor).
        salt: what besides the pixels makes an image's tokens (the processor's settings).
        cache_bytes: memory for images' embeddings kept across requests (`embed`).
    """

    def __init__(self, family: Family, model_type: str, vlm, processor, salt: bytes, cache_bytes: int = 256 << 20):
        tokenizer = getattr(processor, "tokenizer", processor)
        self.family, self.model_type, self.vlm, self.processor, self.salt = family, model_type, vlm, processor, salt
        config = vlm.config
        self.image_token_id = _first_attr(config, "image_token_index", "image_token_id")
        self.end_token_id = tokenizer.convert_tokens_to_ids(family.end_token)
        if self.image_token_id is None or self.end_token_id is None or self.end_token_id == tokenizer.unk_token_id:
            raise MacinferError(f"{model_type}: the tokenizer lacks the image tokens ({family.end_token})")
        self.placeholder = family.placeholder
        self.max_images = family.max_images
        # image hash -> its rows of the input embeddings (embed), least recently used first
        self.cache: OrderedDict = OrderedDict()
        self.cache_used, self.cache_bytes = 0, cache_bytes
        self.tower_runs = 0  # how often the vision tower ran (a prompt with an image not kept)

    @classmethod
    def load(cls, path: Path, model, config: dict, cast_float32: bool = False) -> "ImageEncoder":
        """Load the eyes of the checkpoint at `path`, whose language model mlx-lm loaded as `model`.

        Raises:
            MacinferError: mlx-vlm is not installed, or the family is not supported.
        """
        family = FAMILIES.get(config.get("model_type"))
        if family is None:
            raise MacinferError(f"{config.get('model_type')}: images are not supported for this family")
        try:
            import mlx.core as mx
            from mlx_vlm.utils import load_image_processor, load_model, load_processor
        except ImportError:
            raise MacinferError(f"images need mlx-vlm: {VISION_EXTRA}") from None
        vlm = load_model(Path(path), lazy=True)  # nothing read yet: only the tower's weights are
        vlm.language_model = model.language_model  # mlx-lm's (paged) language model, shared
        parts = [getattr(vlm, name) for name in ("vision_tower", "multi_modal_projector") if hasattr(vlm, name)]
        if cast_float32:  # no Metal: float32 is the fast CPU configuration (docs/platform.md)
            from mlx.utils import tree_flatten, tree_unflatten

            for part in parts:
                half = [(k, v.astype(mx.float32)) for k, v in tree_flatten(part.parameters())
                        if v.dtype in (mx.float16, mx.bfloat16)]
                if half:
                    part.update(tree_unflatten(half))
        mx.eval([p.parameters() for p in parts])
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # mlx-vlm's processor loading warns of transformers' deprecations
        try:
            processor = load_processor(Path(path), add_detokenizer=False)
            image_processor = load_image_processor(Path(path))
        finally:
            hf_logging.set_verbosity(verbosity)
        if image_processor is not None:
            processor.image_processor = image_processor
        salt = b"".join((Path(path) / f).read_bytes() for f in ("preprocessor_config.json", "processor_config.json")
                        if (Path(path) / f).is_file())
        return cls(family, config.get("model_type"), vlm, processor, salt)

    # -- prompts -------------------------------------------------------------------------
    def process(self, text: str, images: list) -> tuple[list[int], MultiModalInputs]:
        """The prompt ids and MultiModalInputs of `text`, which holds one placeholder per image.

        Args:
            text: the prompt (a chat template's output), with `self.placeholder` where each image goes.
            images: RGB PIL images (macinfer.modelio.images.read_image), in order.

        Raises:
            MacinferError: too many images, or placeholders and images that do not pair up.
        """
        import mlx.core as mx
        from mlx_vlm.utils import prepare_inputs

        if len(images) > self.max_images:
            raise MacinferError(f"{len(images)} images in one prompt; {self.model_type} takes at most {self.max_images}")
        found = text.count(self.placeholder)
        if found != len(images):
            raise MacinferError(f"the prompt has {found} image placeholders ({self.placeholder}) for {len(images)} images")
        try:
            inputs = prepare_inputs(self.processor, images=images, prompts=text, image_token_index=self.image_token_id)
        except Exception as e:  # the processor's own checks (an image it cannot resize ...)
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise MacinferError(f"{self.model_type}'s processor refused the images ({why})") from None
        ids = inputs.pop("input_ids")
        ids = (ids[0] if isinstance(ids, mx.array) and ids.ndim == 2 else ids).tolist()
        pixel_values = inputs.pop("pixel_values")
        inputs.pop("attention_mask", None)
        spans = self.spans(ids)
        if len(spans) != len(images):
            raise MacinferError(f"{self.model_type}: the processor laid out {len(spans)} images for {len(images)}")
        mm = MultiModalInputs(pixel_values, {k: v for k, v in inputs.items() if v is not None}, spans,
                              [image_hash(im, self.salt) for im in images])
        return ids, mm

    def spans(self, ids: list[int]) -> list[tuple[int, int]]:
        """Each image's token positions [start, end): from its first image token to its end token."""
        spans, start = [], None
        for i, t in enumerate(ids):
            if t == self.image_token_id and start is None:
                start = i
            elif t == self.end_token_id and start is not None:
                spans.append((start, i + 1))
                start = None
        return spans

    # -- embeddings ----------------------------------------------------------------------
    def embed(self, mm: MultiModalInputs, prompt_ids: list[int]):
        """The language model's input embeddings for prompt positions [0, mm.end): (end, D), evaluated.

        mlx-vlm's own get_input_embeddings over the prompt up to its last image token: the vision
        tower and projector run on every image of the prompt, and each family places its features
        its own way. Each image's rows are kept by its hash (least recently used first out, within
        `cache_bytes`): a prompt whose images are all kept is assembled from them and the plain token
        embeddings, and the tower does not run (a second question about the same image, a prefix hit
        that ends inside an image's tokens).
        """
        import mlx.core as mx

        ids = mx.array([prompt_ids[: mm.end]], dtype=mx.int32)
        kept = [self.cache.get(h) for h in mm.hashes]
        if all(k is not None and k.shape[0] == b - a for k, (a, b) in zip(kept, mm.spans)):
            for h in mm.hashes:
                self.cache.move_to_end(h)
            plain, parts, at = self.embed_tokens(ids)[0], [], 0
            for rows, (a, b) in zip(kept, mm.spans):
                parts += [plain[at:a], rows.astype(plain.dtype)]
                at = b
            embeds = mx.concatenate(parts)
        else:
            self.tower_runs += 1
            out = self.vlm.get_input_embeddings(ids, mm.pixel_values, mask=mx.ones(ids.shape, dtype=mx.int32),
                                                **mm.tower_kwargs)
            embeds = out.inputs_embeds[0]
            self._keep(mm, embeds)
        mx.eval(embeds)
        return embeds

    def _keep(self, mm: MultiModalInputs, embeds) -> None:
        """Keep each image's rows of `embeds` (copies: a slice would hold the whole prompt's buffer)."""
        import mlx.core as mx

        for h, (a, b) in zip(mm.hashes, mm.spans):
            if h not in self.cache:
                self.cache[h] = embeds[a:b] * 1
                self.cache_used += self.cache[h].nbytes
        mx.eval(list(self.cache.values()))
        while self.cache_used > self.cache_bytes and len(self.cache) > 1:
            self.cache_used -= self.cache.popitem(last=False)[1].nbytes

    def embed_tokens(self, ids):
        """Plain token embeddings (B, L) -> (B, L, D), as the language model takes them."""
        return self.vlm.language_model.model.embed_tokens(ids)


def _first_attr(obj, *names):
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return None
