"""`macinfer chat`: a Textual terminal UI that shows why generation is fast or slow.

Layout: app.py (ChatApp, the engine worker), screens/ (chat, help), widgets/
(prompt, transcript, metrics panel, loading bar), messages.py (engine -> UI
Message dataclasses), runner.py (the engine thread's loop), backend.py (the one
adapter to macinfer's engine), session.py (history and transcript), commands.py
(slash commands), app.tcss (all styles), overhead.py (the TUI's cost vs the
bare engine: `python -m tui.overhead`).
"""
