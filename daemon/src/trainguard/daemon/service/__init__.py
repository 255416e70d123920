"""The daemon process: the shell that runs the pure core against a bus.

:class:`DaemonService` (:mod:`._daemon`) consumes ``events`` as a consumer group, folds each
job's records through :func:`trainguard.daemon.core.decide`, and writes what the decisions say
(commands, manifests, audit entries, ticks) in one transaction per owned partition
(:mod:`._partitions`). Around it: the settings file (:mod:`._settings`, checked by
:mod:`trainguard.schemas.settings`), keys and authentication (:mod:`._security`), state snapshots (the
compressed, signed and encrypted envelope :mod:`._snapshot_envelope`, the chunks of one larger
than a record :mod:`._snapshot_chunks`, the topic's reader and writer :mod:`._snapshot_store`),
pulse ticks (:mod:`._pulse`), the bus probe (:mod:`._bus_watch`),
the daemon's own pruning of checkpoints (:mod:`._pruning`), metrics and HTTP endpoints
(:mod:`._metrics`, :mod:`._http`) and log set-up (:mod:`._logging`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lazy_loader

if TYPE_CHECKING:
    from trainguard.daemon.service._daemon import DaemonService as DaemonService
    from trainguard.daemon.service._http import HealthServer as HealthServer
    from trainguard.daemon.service._logging import configure_logging as configure_logging
    from trainguard.daemon.service._security import load_keys as load_keys
    from trainguard.daemon.service._settings import DaemonConfig as DaemonConfig
    from trainguard.daemon.service._settings import RetentionConfig as RetentionConfig
    from trainguard.daemon.service._settings import load_daemon_config as load_daemon_config
    from trainguard.daemon.service._snapshot_chunks import chunk_job as chunk_job
    from trainguard.daemon.service._snapshot_chunks import open_record as open_record
    from trainguard.daemon.service._snapshot_chunks import (
        read_record_header as read_record_header,
    )
    from trainguard.daemon.service._snapshot_envelope import SnapshotRefused as SnapshotRefused
    from trainguard.daemon.service._snapshot_envelope import fold_config_id as fold_config_id
    from trainguard.daemon.service._snapshot_envelope import open_snapshot as open_snapshot
    from trainguard.daemon.service._snapshot_envelope import read_header as read_header
    from trainguard.daemon.service._snapshot_store import Fallback as Fallback
    from trainguard.daemon.service._snapshot_store import plan_partition as plan_partition

# Each name is imported on first use (PEP 562): the service brings the bus adapters and the
# HTTP server along, which the CLI's read-only commands do not need.
__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "_daemon": ["DaemonService"],
        "_http": ["HealthServer"],
        "_logging": ["configure_logging"],
        "_security": ["load_keys"],
        "_settings": ["DaemonConfig", "RetentionConfig", "load_daemon_config"],
        "_snapshot_chunks": ["chunk_job", "open_record", "read_record_header"],
        "_snapshot_envelope": ["SnapshotRefused", "fold_config_id", "open_snapshot", "read_header"],
        "_snapshot_store": ["Fallback", "plan_partition"],
    },
)
