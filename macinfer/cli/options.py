"""Options several commands share (run, chat, serve, bench)."""

from __future__ import annotations

import click

engine_option = click.option(
    "--engine", type=click.Choice(["auto", "paged", "mlx-lm"]), default="auto", show_default=True,
    help="paged: macinfer's paged engine; mlx-lm: mlx-lm's BatchGenerator (dense KV: no paging, prefix cache, "
         "speculation or quantised KV); auto: paged, else mlx-lm for a model the paged engine cannot run.")
