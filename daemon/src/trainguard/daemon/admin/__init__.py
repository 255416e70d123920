"""Key administration: create, rotate, list and retire the daemon's and agents' keys
(``trainguard keys``, ``docs/security.md``).
"""

from __future__ import annotations

from trainguard.daemon.admin._keys import (
    KeyAdmin,
    KeyInfo,
)

__all__ = [
    "KeyAdmin",
    "KeyInfo",
]
