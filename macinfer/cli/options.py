"""What several commands share: one-line errors, comma-separated option values, engine options.

Not a command module: macinfer.cli.main registers none from here.
"""

from __future__ import annotations

import functools

import click

from macinfer.errors import MacinferError


def one_line(e: BaseException) -> click.ClickException:
    """The error a user sees: the first line of the message (or the exception's type), no traceback.

    Args:
        e: a MacinferError or ValueError raised by a command.

    Returns:
        A ClickException click prints as `Error: ...` with exit status 1.
    """
    return click.ClickException(str(e).splitlines()[0] if str(e) else type(e).__name__)


def one_line_errors(f):
    """Decorate a command so that MacinferError / ValueError end it with one line.

    The group (macinfer.cli.main.Group) does the same for commands run through it; this
    covers a command invoked on its own (as the tests do).

    Args:
        f: the command function.

    Returns:
        The wrapped function.
    """

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except (MacinferError, ValueError) as e:
            raise one_line(e) from None

    return wrapper


def csv_list(text: str, parse) -> list:
    """Parse a comma-separated option value ("1,4,16"), ignoring empty items.

    Args:
        text: the option's value.
        parse: turns one item into a value (int, parse_tokens ...).

    Returns:
        The parsed items, in order.

    Raises:
        MacinferError: an item does not parse.
    """
    try:
        return [parse(x) for x in text.split(",") if x.strip()]
    except (ValueError, MacinferError) as e:
        raise MacinferError(f"cannot read '{text}': {e}") from None


def engine_options(kv_memory, max_num_seqs) -> dict:
    """LLM keyword arguments for the options a user set (unset ones keep the engine's defaults).

    Args:
        kv_memory: --kv-memory, e.g. "2GB", or None.
        max_num_seqs: --max-num-seqs, or None.

    Returns:
        A dict to pass on as LLM(..., **options).
    """
    opts = {}
    if kv_memory:
        opts["kv_memory"] = kv_memory
    if max_num_seqs:
        opts["max_num_seqs"] = max_num_seqs
    return opts


engine_option = click.option(
    "--engine", type=click.Choice(["auto", "paged", "mlx-lm"]), default="auto", show_default=True,
    help="paged: macinfer's paged engine; mlx-lm: mlx-lm's BatchGenerator (dense KV: no paging, prefix cache, "
         "speculation or quantised KV); auto: paged, else mlx-lm for a model the paged engine cannot run.")


_parallel = click.option(
    "--parallel", type=click.Choice(["auto", "tensor", "pipeline"]), default="auto", show_default=True,
    help="Started by mlx.launch on several ranks: split the model by tensor parallelism (its heads over the ranks) "
         "or pipeline parallelism (its layers); auto: tensor where mlx-lm can, else pipeline. Ignored in one process.")
_micro_batches = click.option(
    "--micro-batches", type=click.IntRange(1), metavar="N",
    help="With --parallel pipeline: split each forward's rows into N micro-batches so the ranks' stages overlap "
         "(default: one per rank when each gets 32 tokens or more, as in a batched prefill; 1: none).")


def parallel_option(f):
    """--parallel and --micro-batches (a command gets `parallel` and `micro_batches`)."""
    return _parallel(_micro_batches(f))
