"""The texts macinfer calibrates and evaluates on: reading them and tokenising them whole."""

from __future__ import annotations

from pathlib import Path

from macinfer.errors import MacinferError
from macinfer.paths import models_dir

EVAL_TEXT = models_dir() / "eval.txt"
CALIBRATION_TEXT = models_dir() / "calibration.txt"


def read_text(path: str | Path | None) -> str:
    """The text at path (default: the shipped eval text); one-line errors for unreadable or empty files."""
    path = Path(path) if path else EVAL_TEXT
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MacinferError(f"cannot read the text {path}: {type(e).__name__}") from None
    if not text.strip():
        raise MacinferError(f"{path} is empty: give a text of a few hundred words or more")
    return text


def encode_text(tokenizer, text: str) -> list[int]:
    """tokenizer.encode without transformers' warning that a long text exceeds model_max_length.

    We score a long text in windows, so the warning is noise here.
    """
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        return tokenizer.encode(text)
    finally:
        logging.set_verbosity(level)
