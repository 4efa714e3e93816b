"""The chat screen's widgets: prompt input, transcript, metrics panel, loading bar."""

from tui.widgets.loading import LoadingBar
from tui.widgets.metrics import MetricsPanel
from tui.widgets.prompt import PromptInput
from tui.widgets.transcript import Transcript

__all__ = ["LoadingBar", "MetricsPanel", "PromptInput", "Transcript"]
