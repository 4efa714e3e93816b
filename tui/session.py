"""The conversation: system prompt, turns, sampling settings; saved as JSON, exported as Markdown."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from macinfer.core.sampling_params import SamplingParams

FORMAT = "macinfer-chat/1"  # the "format" of a /save file


@dataclass
class ChatSession:
    """History kept for the session; `messages()` is what the chat template receives.

    Example:
        >>> s = ChatSession(system="Be brief.")
        >>> s.add("user", "Hi")
        >>> s.messages()
        [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'}]
    """

    system: str = ""
    temperature: float = 0.0
    max_tokens: int = 512
    seed: int | None = None
    think: bool | None = None  # /think on|off: enable_thinking for the template (None: its default)
    turns: list[dict] = field(default_factory=list)

    def add(self, role: str, content: str, reasoning: str | None = None, images: list[str] | None = None) -> None:
        """A turn; an assistant's thought (reasoning) is kept beside it, for the template and /save; `images`:
        paths of the images a user turn shows the model (before its text)."""
        self.turns.append({"role": role, "content": content} | ({"reasoning": reasoning} if reasoning else {})
                          | ({"images": list(images)} if images else {}))

    def clear(self) -> None:
        self.turns.clear()

    def messages(self) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [dict(t) for t in self.turns]

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens, seed=self.seed)

    def to_markdown(self, model: str | None = None) -> str:
        lines = ["# macinfer chat", ""]
        if model:
            lines += [f"Model: `{model}`, temperature {self.temperature:g}, max tokens {self.max_tokens}", ""]
        if self.system:
            lines += ["## System", "", self.system, ""]
        for t in self.turns:
            lines += [f"## {t['role'].capitalize()}", ""] + [f"![image]({p})" for p in t.get("images", ())]
            if t.get("reasoning"):
                lines += ["<details><summary>Thought</summary>", "", t["reasoning"].rstrip(), "", "</details>", ""]
            lines += [t["content"].rstrip(), ""]
        return "\n".join(lines)

    def to_json(self, model: str | None = None) -> dict:
        """What /save writes: the model spec (None: the embedded default), sampling, messages."""
        return {"format": FORMAT, "model": model,
                "sampling": {"temperature": self.temperature, "max_tokens": self.max_tokens, "seed": self.seed}
                | ({"think": self.think} if self.think is not None else {}),
                "messages": self.messages()}

    @classmethod
    def from_json(cls, data) -> tuple[ChatSession, str | None]:
        """The session and model spec of a /save file's contents; ValueError names what is wrong."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a macinfer chat file (no \"format\": \"{FORMAT}\")")
        sampling, messages, model = data.get("sampling"), data.get("messages"), data.get("model")
        if not isinstance(sampling, dict) or not isinstance(messages, list) or not isinstance(model, (str, type(None))):
            raise ValueError("a macinfer chat file needs \"model\", \"sampling\" and \"messages\"")
        t, n, seed = sampling.get("temperature"), sampling.get("max_tokens"), sampling.get("seed")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0:
            raise ValueError(f"sampling.temperature must be a number >= 0, got {t!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"sampling.max_tokens must be a whole number >= 1, got {n!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"sampling.seed must be a whole number >= 0 or null, got {seed!r}")
        think = sampling.get("think")
        if think is not None and not isinstance(think, bool):
            raise ValueError(f"sampling.think must be true, false or null, got {think!r}")
        for i, m in enumerate(messages):
            role = m.get("role") if isinstance(m, dict) else None
            if role not in ("system", "user", "assistant") or not isinstance(m.get("content"), str) \
                    or (role == "system" and i > 0) or not isinstance(m.get("reasoning", ""), str):
                raise ValueError(f"messages[{i}] is not a user or assistant turn (or a leading system prompt)")
            images = m.get("images", [])
            if not isinstance(images, list) or not all(isinstance(p, str) for p in images) or (images and role != "user"):
                raise ValueError(f"messages[{i}].images must be a list of image paths, on a user turn")
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
        turns = [{k: m[k] for k in ("role", "content", "reasoning", "images") if m.get(k) or k in ("role", "content")}
                 for m in messages if m["role"] != "system"]
        return cls(system=system, temperature=float(t), max_tokens=n, seed=seed, think=think, turns=turns), model

    def save(self, path: str | os.PathLike, model: str | None = None) -> Path:
        """Write the session as JSON (see `to_json`), atomically and read back; returns the path."""
        data = self.to_json(model)
        return _write_atomic(path, json.dumps(data, indent=1, ensure_ascii=False) + "\n",
                             check=lambda text: json.loads(text) == data)

    def export(self, path: str | os.PathLike, model: str | None = None) -> Path:
        """Write the transcript as Markdown, atomically; returns the path."""
        text = self.to_markdown(model)
        return _write_atomic(path, text, check=lambda written: written == text)

    @classmethod
    def load(cls, path: str | os.PathLike) -> tuple[ChatSession, str | None]:
        """Read a /save file: (session, model spec). ValueError (one line) for a missing or bad file."""
        path = Path(path).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
        try:
            return cls.from_json(json.loads(text))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not a macinfer chat file: not JSON (line {e.lineno}): "
                             "/save writes one") from None
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def _write_atomic(path: str | os.PathLike, text: str, check) -> Path:
    """Write text to a temp file beside path, read it back through `check`, then rename it over path.

    NOTE: a crash at any point leaves either the old file or the new one, never a torn one.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{path} is a directory: give a file name")
    if not path.parent.exists():
        raise ValueError(f"no such directory: {path.parent}")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if not check(Path(tmp).read_text(encoding="utf-8")):
            raise OSError(f"{path} read back differently from what was written")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
