"""trainguard inside the training frameworks people already use.

Each framework has its own sub-package, importable only when its optional extra is installed
(``pip install 'trainguard[hf]'``, ``'trainguard[lightning]'``, ``'trainguard[accelerate]'``);
importing this package imports none of them. Every integration drives the same
:class:`trainguard.agent.Agent` a hand-written loop does, so detection, fencing, verified
restores and the exact data position are the agent's, not re-implemented per framework.
"""

from __future__ import annotations

__all__: list[str] = []
