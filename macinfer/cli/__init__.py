"""The `macinfer` command line: one module per command."""
