"""``python -m trainguard.daemon.cli``: the ``trainguard`` command."""

from trainguard.daemon.cli import main

main()
