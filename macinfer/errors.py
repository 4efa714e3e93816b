"""User-facing errors and warnings: one line that says what is wrong and what to do.

Warnings are Python warnings (filterable, testable with pytest.warns) of a MacinferWarning
category, printed as one `warning: ...` line: not Python's default of the source file, its line
number and the code line, which mean nothing to a user.
"""

import warnings


class MacinferError(Exception):
    """An error caused by the user's input or environment.

    The CLI prints `error: <message>` and exits non-zero without a traceback;
    the server maps it to a 4xx. Messages are one line.
    """


class InvalidGrammar(MacinferError):
    """A request's structured output (schema, regex, grammar) cannot constrain this model's sampling:
    invalid, or admitting no reply at all. The server names the request's field that carried it."""


class MacinferWarning(RuntimeWarning):
    """Something a user should know that does not stop the work (a cache file ignored, a fallback)."""


def _format_warning(message, category, filename, lineno, line=None, _python=warnings.formatwarning):
    if issubclass(category, MacinferWarning):
        return f"warning: {message}\n"
    return _python(message, category, filename, lineno, line)


warnings.formatwarning = _format_warning
