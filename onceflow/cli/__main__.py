"""``python -m onceflow.cli``: the ``onceflow`` command."""

from onceflow.cli import main

main()
