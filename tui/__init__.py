"""`macinfer chat`: a Textual terminal UI that shows why generation is fast or slow.

Layout: app.py (ChatApp), screens/ (chat, help), widgets/ (prompt, transcript,
metrics panel, loading bar), messages.py (engine -> UI Message dataclasses),
engine_process.py (the engine's child process and the UI's handle on it),
runner.py (the engine's loop, in that process), backend.py (the one adapter to
macinfer's engine), stub.py (a model-free engine at a fixed rate), session.py
(history and transcript), commands.py (slash commands), app.tcss (all styles),
overhead.py (the TUI's cost vs the bare engine: `python scripts/bench/tui_overhead.py`).
"""
