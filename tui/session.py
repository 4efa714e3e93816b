"""The conversation: system prompt, turns, sampling settings, and its Markdown transcript."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from macinfer.core.sampling_params import SamplingParams


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
    turns: list[dict] = field(default_factory=list)

    def add(self, role: str, content: str) -> None:
        self.turns.append({"role": role, "content": content})

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
            lines += [f"## {t['role'].capitalize()}", "", t["content"].rstrip(), ""]
        return "\n".join(lines)

    def save(self, path: str | os.PathLike, model: str | None = None) -> Path:
        """Write the transcript as Markdown atomically (temp file + rename); returns the path."""
        path = Path(path).expanduser()
        if path.is_dir():
            raise ValueError(f"{path} is a directory: give a file name, e.g. /save chat.md")
        if not path.parent.exists():
            raise ValueError(f"no such directory: {path.parent}")
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self.to_markdown(model))
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        return path
