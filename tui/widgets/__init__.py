"""The chat screen's widgets: prompt input, transcript, metrics panel, loading bar."""

from macinfer.tui.widgets.loading import LoadingBar
from macinfer.tui.widgets.metrics import MetricsPanel
from macinfer.tui.widgets.prompt import PromptInput
from macinfer.tui.widgets.transcript import Transcript

__all__ = ["LoadingBar", "MetricsPanel", "PromptInput", "Transcript"]
