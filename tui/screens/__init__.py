"""Screens: the chat (default) and the help modal."""

from macinfer.tui.screens.chat import ChatScreen
from macinfer.tui.screens.help import HelpScreen

__all__ = ["ChatScreen", "HelpScreen"]
