"""The check each integration makes before importing its framework: a missing optional extra
is an ``ImportError`` that says which ``pip install`` adds it, not a bare module name."""

from __future__ import annotations

import importlib.util

__all__ = ["require"]


def require(integration: str, extra: str, *modules: str) -> None:
    """Raise unless every one of ``modules`` can be imported.

    Args:
        integration: the integration's package, for the message.
        extra: the optional extra of ``trainguard`` that installs them.
        modules: top-level module names.

    Raises:
        ImportError: one is missing; the message names the extra to install.
    """
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"{integration} needs {', '.join(missing)}, which is not installed: "
            f"pip install 'trainguard[{extra}]'",
            name=missing[0],
        )
