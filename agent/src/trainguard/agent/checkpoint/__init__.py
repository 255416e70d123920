"""A rank's checkpoint shards and the committed snapshots' manifests.

:mod:`._shards` writes and verifies one rank's shard (``torch.save``, SHA-256 of the bytes,
verified before loading), :mod:`._checksum` digests parameters for the cross-rank checksum
detector, :mod:`._step_file` records a worker's last finished step for its supervisor, and
:mod:`._manifests` reads the signed manifests of committed snapshots from the ``manifests``
topic, :mod:`._layout` lists and removes the shards' step folders (retention), and :mod:`._dcp`
writes, verifies and loads DCP (``torch.distributed.checkpoint``) snapshots;
:func:`write_durably` and :func:`sync_folder` (:mod:`._durable`) write local files whole and
durably, for these and for the daemon's key files.
"""

from __future__ import annotations

from trainguard.agent.checkpoint._dcp import dcp_problems
from trainguard.agent.checkpoint._durable import sync_folder, write_durably
from trainguard.agent.checkpoint._layout import (
    StepFolder,
    files_present,
    job_folder,
    remove_step_folder,
    snapshot_folder,
    step_folders,
)
from trainguard.agent.checkpoint._manifests import (
    ManifestLog,
    fetch_manifest,
    read_manifests,
)
from trainguard.agent.checkpoint._shards import (
    uri_to_path,
)
from trainguard.agent.checkpoint._snapshot import Snapshot, store_manifest

__all__ = [
    "ManifestLog",
    "Snapshot",
    "StepFolder",
    "dcp_problems",
    "fetch_manifest",
    "files_present",
    "job_folder",
    "read_manifests",
    "remove_step_folder",
    "snapshot_folder",
    "step_folders",
    "store_manifest",
    "sync_folder",
    "uri_to_path",
    "write_durably",
]
