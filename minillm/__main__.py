"""``python -m minillm COMMAND ...``: the ``minillm`` command (minillm/cli.py) where it is not installed."""

from .cli import main

main()
