"""How a training script tells its supervisor that restarting it cannot help: exit status
:data:`~trainguard.schemas.EXIT_CONFIG` on a :class:`~trainguard.agent.ConfigError`."""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager

from trainguard.agent._errors import ConfigError
from trainguard.schemas import EXIT_CONFIG

__all__ = ["exit_on_config_error"]


@contextmanager
def exit_on_config_error() -> Iterator[None]:
    """Turn a :class:`~trainguard.agent.ConfigError` raised in the block into exit status
    :data:`~trainguard.schemas.EXIT_CONFIG` (78, ``EX_CONFIG``), after printing its traceback
    to stderr as Python would.

    The script owns its exit, so trainguard cannot choose its status; wrap the script's entry
    point (a context manager, or a decorator)::

        if __name__ == "__main__":
            with exit_on_config_error():
                main()

    Under ``trainguard run`` the worker's exit report then carries status 78 and the error's
    line, and the daemon fails the job at once with it instead of restarting the worker
    (``docs/recovery.md``, "A configuration error is not restarted"): a setting that is
    missing or invalid (``AgentConfig``, ``TRAINGUARD_*`` variables), checkpoint storage that
    refuses the agent at start, an ``init_from`` snapshot the bus does not have. Any other
    exception passes through unchanged (status 1: a crash, restored as ever).

    Raises:
        SystemExit: with status 78, for a ``ConfigError``.
    """
    try:
        yield
    except ConfigError:
        traceback.print_exc()
        raise SystemExit(EXIT_CONFIG) from None
