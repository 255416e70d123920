"""The daemon process: the shell that runs the pure core against a bus.

:class:`DaemonService` (:mod:`._daemon`) consumes ``events`` as a consumer group, folds each
job's records through :func:`trainguard.daemon.core.decide`, and writes what the decisions say
(commands, manifests, audit entries, ticks) in one transaction per owned partition
(:mod:`._partitions`). Around it: the settings file (:mod:`._settings`, checked by
:mod:`trainguard.schemas.settings`), keys and authentication (:mod:`._security`), state snapshots (the
signed and encrypted envelope :mod:`._snapshot_envelope`, the topic's reader and writer
:mod:`._snapshot_store`), pulse ticks (:mod:`._pulse`), the bus probe (:mod:`._bus_watch`),
metrics and HTTP endpoints (:mod:`._metrics`, :mod:`._http`) and log set-up (:mod:`._logging`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainguard.daemon.service._daemon import (
        DaemonService,
    )
    from trainguard.daemon.service._http import (
        HealthServer,
    )
    from trainguard.daemon.service._logging import (
        configure_logging,
    )
    from trainguard.daemon.service._security import (
        load_keys,
    )
    from trainguard.daemon.service._settings import (
        DaemonConfig,
        load_daemon_config,
    )
    from trainguard.daemon.service._snapshot_envelope import (
        SnapshotRefused,
        fold_config_id,
        open_snapshot,
        read_header,
    )
    from trainguard.daemon.service._snapshot_store import (
        Fallback,
        plan_partition,
    )

_LAZY: dict[str, str] = {
    "DaemonService": "trainguard.daemon.service._daemon",
    "HealthServer": "trainguard.daemon.service._http",
    "configure_logging": "trainguard.daemon.service._logging",
    "load_keys": "trainguard.daemon.service._security",
    "DaemonConfig": "trainguard.daemon.service._settings",
    "load_daemon_config": "trainguard.daemon.service._settings",
    "SnapshotRefused": "trainguard.daemon.service._snapshot_envelope",
    "fold_config_id": "trainguard.daemon.service._snapshot_envelope",
    "open_snapshot": "trainguard.daemon.service._snapshot_envelope",
    "read_header": "trainguard.daemon.service._snapshot_envelope",
    "Fallback": "trainguard.daemon.service._snapshot_store",
    "plan_partition": "trainguard.daemon.service._snapshot_store",
}
"""Each public name -> the module that defines it; imported on first use: the service brings the bus adapters and the HTTP server along,
which the CLI's read-only commands do not need."""


def __getattr__(name: str) -> Any:
    """The names of :data:`_LAZY`, imported when first asked for (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "DaemonConfig",
    "DaemonService",
    "Fallback",
    "HealthServer",
    "SnapshotRefused",
    "configure_logging",
    "fold_config_id",
    "load_daemon_config",
    "load_keys",
    "open_snapshot",
    "plan_partition",
    "read_header",
]
