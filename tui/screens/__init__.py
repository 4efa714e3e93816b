"""Screens: the chat (default) and the help modal."""

from tui.screens.chat import ChatScreen
from tui.screens.help import HelpScreen

__all__ = ["ChatScreen", "HelpScreen"]
