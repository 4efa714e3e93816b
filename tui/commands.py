"""Slash commands: the table the prompt, the help screen and the command palette share."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlashCommand:
    name: str  # without the slash
    usage: str  # argument synopsis, "" if none
    help: str
    palette: str  # title in the command palette


COMMANDS: tuple[SlashCommand, ...] = (
    SlashCommand("model", "MODEL", "switch model (catalog name, directory, .gguf, repo id)", "Switch model"),
    SlashCommand("system", "[TEXT | -]", "set the system prompt; no TEXT shows it, - removes it", "Set the system prompt"),
    SlashCommand("clear", "", "clear the conversation (keeps the system prompt)", "Clear the chat"),
    SlashCommand("image", "FILE", "attach an image to your next message (vision-language models)", "Attach an image"),
    SlashCommand("temp", "T", "sampling temperature, 0 is greedy", "Set the temperature"),
    SlashCommand("max-tokens", "N", "longest reply, in tokens", "Set max tokens"),
    SlashCommand("think", "[on|off]", "let a thinking model think before it answers, or not", "Toggle thinking"),
    SlashCommand("spec", "[on|off]", "toggle speculative decoding", "Toggle speculative decoding"),
    SlashCommand("prefix-cache", "[on|off]", "toggle the prompt-prefix cache", "Toggle the prefix cache"),
    SlashCommand("save", "FILE", "save the conversation and settings as JSON (/load, chat --resume)",
                 "Save the conversation"),
    SlashCommand("load", "FILE", "load a conversation saved with /save (and its model)", "Load a conversation"),
    SlashCommand("export", "FILE", "write the transcript as Markdown", "Export as Markdown"),
    SlashCommand("help", "", "keys and commands", "Help"),
)
BY_NAME = {c.name: c for c in COMMANDS}

# (key, what it does) for the help screen; the footer shows the common ones.
KEYS: tuple[tuple[str, str], ...] = (
    ("Enter", "send the prompt"),
    ("Shift+Enter / Ctrl+J", "new line in the prompt"),
    ("Esc", "cancel the reply in progress"),
    ("Ctrl+P", "command palette"),
    ("F1", "this help"),
    ("F2", "show / hide the metrics panel"),
    ("Ctrl+L", "clear the chat"),
    ("PgUp / PgDn", "scroll the transcript"),
    ("Ctrl+Q", "quit"),
)


def parse(text: str) -> tuple[str, str] | None:
    """'/temp 0.7' -> ('temp', '0.7'); None if text is not a slash command.

    A leading '//' escapes the slash: the prompt is sent as '/...'.
    """
    text = text.strip()
    if not text.startswith("/") or text.startswith("//"):
        return None
    name, _, arg = text[1:].partition(" ")
    return name.lower(), arg.strip()


def parse_switch(arg: str, current: bool) -> bool:
    """'on'/'off'/'' (toggle) -> the new state."""
    arg = arg.lower()
    if arg in ("", "toggle"):
        return not current
    if arg in ("on", "1", "yes", "true"):
        return True
    if arg in ("off", "0", "no", "false"):
        return False
    raise ValueError(f"expected on or off, got '{arg}'")
