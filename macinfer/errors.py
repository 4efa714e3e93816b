"""User-facing errors: one line that says what is wrong and what to do."""


class MacinferError(Exception):
    """An error caused by the user's input or environment.

    The CLI prints `error: <message>` and exits non-zero without a traceback;
    the server maps it to a 4xx. Messages are one line.
    """


class InvalidGrammar(MacinferError):
    """A request's structured output (schema, regex, grammar) cannot constrain this model's sampling:
    invalid, or admitting no reply at all. The server names the request's field that carried it."""
