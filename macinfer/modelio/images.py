"""Reading an image a user gave (a file or its bytes) into RGB pixels, within limits, and its hash.

An image is refused in one line when it cannot be decoded, when its file is larger than
MAX_IMAGE_BYTES, or when it holds more than MAX_IMAGE_PIXELS pixels (checked from its header,
before decoding: a small PNG can decode to gigabytes). Resizing is the model's processor's job
(macinfer.modelio.vision): these limits only keep a request from exhausting memory.

The hash names the decoded pixels (mode, size, RGB bytes), so the same picture sent as a path or
as a data URL is the same image to the prefix cache (macinfer.modelio.multimodal).
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

from macinfer.errors import MacinferError

MAX_IMAGE_BYTES = 20 << 20  # 20 MiB of file
MAX_IMAGE_PIXELS = 50_000_000  # 50 megapixels: e.g. 8660 x 5773


def read_image(source: bytes | str | Path, what: str = "the image"):
    """Decode an image file (its path or its bytes) into an RGB PIL image.

    Args:
        source: a path or the file's bytes.
        what: how to name the image in errors (e.g. "messages[0].content[1]").

    Raises:
        MacinferError: unreadable, too large, or not an image.
    """
    from PIL import Image, ImageOps

    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        try:
            size = path.stat().st_size
        except OSError as e:
            raise MacinferError(f"{what}: cannot read {path} ({e.strerror or type(e).__name__})") from None
        if not path.is_file():
            raise MacinferError(f"{what}: {path} is not a file")
        if size > MAX_IMAGE_BYTES:
            raise MacinferError(f"{what}: {path} is {size >> 20} MiB; images up to {MAX_IMAGE_BYTES >> 20} MiB are taken")
        data = path.read_bytes()
    else:
        data = source
    if len(data) > MAX_IMAGE_BYTES:
        raise MacinferError(f"{what} is {len(data) >> 20} MiB; images up to {MAX_IMAGE_BYTES >> 20} MiB are taken")
    try:
        image = Image.open(io.BytesIO(data))
        w, h = image.size
        if w * h > MAX_IMAGE_PIXELS:
            raise MacinferError(f"{what} is {w}x{h} pixels; images up to {MAX_IMAGE_PIXELS // 1_000_000} "
                                "megapixels are taken: scale it down")
        image = ImageOps.exif_transpose(image)
        return image.convert("RGB")
    except MacinferError:
        raise
    except Exception as e:  # PIL raises UnidentifiedImageError, OSError, ValueError, DecompressionBombError ...
        raise MacinferError(f"{what} is not an image PIL can read ({type(e).__name__})") from None


def image_hash(image, salt: bytes = b"") -> bytes:
    """The content hash of a decoded image (32 bytes): its mode, size and pixels, and a salt (the
    processor's settings, which change what the same pixels become)."""
    h = hashlib.sha256(salt)
    h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return h.digest()
