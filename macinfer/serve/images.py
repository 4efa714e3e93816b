"""OpenAI's image content parts in a chat request: where the images are, read, and the prompt they make.

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}   the image itself
    {"type": "image_url", "image_url": {"url": "/Users/me/cat.jpg"}}          a file on the server's host
    {"type": "image_url", "image_url": {"url": "file:///Users/me/cat.jpg"}}   the same
    {"type": "image_url", "image_url": {"url": "https://..."}}                fetched, only with
                                                                              `serve --allow-remote-images`

Each image part becomes {"type": "image"} for the model's chat template, which writes the model's
placeholder there; the model's processor then expands it into the image's tokens
(macinfer.chat.request.prepare, macinfer.modelio.vision.ImageEncoder.process). Every failure is a 400 naming the part: a model that does not see, an
image that cannot be read or is too large (macinfer.modelio.images), a remote URL without the flag,
more images than the model takes.
"""

from __future__ import annotations

import base64
import binascii
import urllib.parse
import urllib.request

from macinfer.errors import MacinferError
from macinfer.modelio.images import MAX_IMAGE_BYTES, read_image
from macinfer.serve.schemas import APIError, ChatCompletionRequest

IMAGE_PARTS = ("image_url", "input_image", "image")
REMOTE_TIMEOUT_S = 10


def has_images(req: ChatCompletionRequest) -> bool:
    """Whether any message holds an image content part."""
    return _first_image(req) is not None


def _first_image(req: ChatCompletionRequest) -> int | None:
    """The index of the first message holding an image part, or None."""
    return next((i for i, m in enumerate(req.messages) if isinstance(m.content, list) and any(
        isinstance(p, dict) and p.get("type") in IMAGE_PARTS for p in m.content)), None)


def image_messages(llm, req: ChatCompletionRequest, allow_remote: bool) -> tuple[list[dict], list]:
    """The messages of a chat request with images, for the chat template, and the images, read and checked.

    Each image part becomes {"type": "image"} (the template writes the model's placeholder there; the
    model's processor expands it: macinfer.chat.request.prepare with `images`).

    Raises:
        APIError: 400, naming the message or part at fault.
    """
    if llm.images is None:
        raise APIError(400, f"{llm.info.name} does not take images: send text only, or use a vision-language model",
                       f"messages[{_first_image(req)}].content", "model_not_vision")
    messages, pics = [], []
    for i, m in enumerate(req.messages):
        role = "system" if m.role == "developer" else m.role
        content = m.content
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in IMAGE_PARTS:
                    pics.append(_read(part, where, allow_remote))
                    parts.append({"type": "image"})
                else:
                    raise APIError(400, f"{where}: a content part is text or an image, got {kind!r}", where)
            content = parts
        messages.append({**(m.model_extra or {}), "role": role, "content": content or ""})
    if len(pics) > llm.images.max_images:
        raise APIError(400, f"{len(pics)} images in one request; {llm.info.name} takes at most {llm.images.max_images}",
                       "messages", "too_many_images")
    return messages, pics


def _url(part: dict) -> str | None:
    """The image's URL in any of the shapes clients send (OpenAI's image_url object or string, Responses'
    input_image.image_url)."""
    value = part.get("image_url", part.get("url"))
    if isinstance(value, dict):
        value = value.get("url")
    return value if isinstance(value, str) and value else None


def _read(part: dict, where: str, allow_remote: bool):
    """An image part's RGB image."""
    url = _url(part)
    if url is None:
        raise APIError(400, f"{where}: an image part needs image_url.url (a data URL, a path or an http URL)", where)
    try:
        if url.startswith("data:"):
            return read_image(_data_url_bytes(url, where), where)
        if url.startswith(("http://", "https://")):
            if not allow_remote:
                raise APIError(400, f"{where}: remote image URLs are off on this server: send the image as a data "
                                    "URL (or start it with --allow-remote-images)", where, "remote_images_off")
            return read_image(_fetch(url, where), where)
        path = urllib.parse.unquote(urllib.parse.urlparse(url).path) if url.startswith("file://") else url
        return read_image(path, where)
    except MacinferError as e:
        raise APIError(400, str(e), where, "invalid_image") from None


def _data_url_bytes(url: str, where: str) -> bytes:
    head, _, data = url.partition(",")
    if not head.startswith("data:image/") or not head.endswith(";base64"):
        raise MacinferError(f"{where}: a data URL must be data:image/<type>;base64,<data>")
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise MacinferError(f"{where}: the image is over {MAX_IMAGE_BYTES >> 20} MiB")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise MacinferError(f"{where}: the data URL's base64 does not decode") from None


def _fetch(url: str, where: str) -> bytes:
    """GET an image (--allow-remote-images), at most MAX_IMAGE_BYTES."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "macinfer"}),
                                    timeout=REMOTE_TIMEOUT_S) as r:
            data = r.read(MAX_IMAGE_BYTES + 1)
    except Exception as e:  # URLError, HTTPError, timeouts ...
        raise MacinferError(f"{where}: could not fetch {url} ({type(e).__name__})") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise MacinferError(f"{where}: {url} is over {MAX_IMAGE_BYTES >> 20} MiB")
    return data
