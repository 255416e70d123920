"""TODO"""

from trainguard.daemon.cli._app import app, main

__all__ = ["app", "main"]
