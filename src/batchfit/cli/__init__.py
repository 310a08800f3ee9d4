"""The ``batchfit`` command line: thin Typer commands over the library."""
