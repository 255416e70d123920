"""trainguard's agent: what runs inside every training worker, and the per-node supervisor.

``from trainguard.agent import Agent`` is the entry point for training code; see
:class:`Agent` (and :class:`RestoreRequested`, the one exception a training loop catches).
:func:`await_handoff` marks where a warm spare of ``trainguard run --warm`` waits for its
rank (``docs/warm-restarts.md``), and :func:`wait_for_store`, called just before
``init_process_group``, spares a rank other than 0 torch's rendezvous back-off. :func:`exit_on_config_error` around a script's entry point
makes a :class:`ConfigError` exit with :data:`EXIT_CONFIG`, which ``trainguard run`` and the
daemon do not restart.
The data cursor (:class:`GlobalOrder`, :class:`ResumableDistributedSampler`) makes a restore
resume with no sample skipped or repeated; :class:`LoaderState` checkpoints a torchdata
``StatefulDataLoader`` with workers, and its consumed cursor; :func:`dataset_version` binds a
checkpoint to the data it was trained on; :func:`digest_files` with
:meth:`Agent.checkpoint_files` and :meth:`Agent.load_files` announce and verify a checkpoint
folder a framework wrote (``trainguard.integrations``); :func:`ordered_allreduce` makes DDP's gradient
averaging independent of its bucket layout, so that restores are bitwise exact with 3 or more
ranks (``docs/bitwise.md``).

Importing this package does not import torch; ``ResumableDistributedSampler``,
``LoaderState``, ``LoaderStateNotReshardable``, ``ordered_allreduce`` and
``ordered_allreduce_hook`` load it (and torchdata, for the loader's) on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainguard.agent._agent import RESERVED_KEY, Agent, AgentStats
from trainguard.agent._config import DEFAULT_BUS_URL, AgentConfig
from trainguard.agent._errors import (
    AgentError,
    ConfigError,
    JobAborted,
    RestoreMissed,
    RestoreRequested,
    RestoreTimeout,
    ShardCorrupt,
    ShardError,
    ShardMissing,
    StaleGeneration,
    StorageUnavailable,
)
from trainguard.agent._exit import exit_on_config_error
from trainguard.agent._handoff import await_handoff, wait_for_store
from trainguard.agent.checkpoint._files import digest_files
from trainguard.agent.checkpoint._snapshot import Snapshot
from trainguard.agent.data._cursor import (
    MAX_DATASET_LEN,
    CursorMismatch,
    DataVersionMismatch,
    GlobalOrder,
    KeyedPermutation,
    epoch_permutation,
)
from trainguard.agent.data._dataset_version import ManifestEntry, dataset_manifest, dataset_version
from trainguard.agent.faults._plan import Fault, FaultKind, parse_faults
from trainguard.schemas import EXIT_CONFIG

if TYPE_CHECKING:
    from trainguard.agent._ddp import ordered_allreduce, ordered_allreduce_hook
    from trainguard.agent.data._loader import LoaderState, LoaderStateNotReshardable
    from trainguard.agent.data._sampler import ResumableDistributedSampler

__all__ = [
    "DEFAULT_BUS_URL",
    "EXIT_CONFIG",
    "MAX_DATASET_LEN",
    "RESERVED_KEY",
    "Agent",
    "AgentConfig",
    "AgentError",
    "AgentStats",
    "ConfigError",
    "CursorMismatch",
    "DataVersionMismatch",
    "Fault",
    "FaultKind",
    "GlobalOrder",
    "JobAborted",
    "KeyedPermutation",
    "LoaderState",
    "LoaderStateNotReshardable",
    "ManifestEntry",
    "RestoreMissed",
    "RestoreRequested",
    "RestoreTimeout",
    "ResumableDistributedSampler",
    "ShardCorrupt",
    "ShardError",
    "ShardMissing",
    "Snapshot",
    "StaleGeneration",
    "StorageUnavailable",
    "await_handoff",
    "dataset_manifest",
    "dataset_version",
    "digest_files",
    "epoch_permutation",
    "exit_on_config_error",
    "ordered_allreduce",
    "ordered_allreduce_hook",
    "parse_faults",
    "wait_for_store",
]


def __getattr__(name: str) -> Any:
    # The sampler subclasses torch's Sampler, the DDP hook uses torch.distributed: load torch
    # only when they are asked for; the loader's state needs torchdata too.
    if name in ("LoaderState", "LoaderStateNotReshardable"):
        from trainguard.agent.data import _loader

        return getattr(_loader, name)
    if name == "ResumableDistributedSampler":
        from trainguard.agent.data._sampler import ResumableDistributedSampler

        return ResumableDistributedSampler
    if name in ("ordered_allreduce", "ordered_allreduce_hook"):
        from trainguard.agent import _ddp

        return getattr(_ddp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
