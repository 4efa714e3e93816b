"""`python -m macinfer ...`: the `macinfer` command, for a checkout or an environment without its script."""

from macinfer.cli.main import main

main()
