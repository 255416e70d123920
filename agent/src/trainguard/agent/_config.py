"""The agent's configuration, built once from arguments and the environment.

Precedence, highest first: keyword arguments to :meth:`AgentConfig.resolve`, ``TRAINGUARD_*``
environment variables, the launcher's variables (``RANK``, ``WORLD_SIZE`` as set by torchrun
or trainguard's supervisor), defaults.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from trainguard.agent._errors import ConfigError
from trainguard.agent._handoff import SPARE_FD_ENV
from trainguard.agent.bus import (
    DEFAULT_BUS_URL,
    BusURLError,
    KafkaSecurity,
    load_kafka_security,
    parse_bus_url,
)
from trainguard.agent.faults._plan import parse_faults
from trainguard.agent.keys._keystore import AgentKeys, agent_keys_from_env
from trainguard.schemas import (
    Checkpoint,
    CheckpointFormat,
    CheckpointMeta,
    DataCursor,
    SchemaError,
    encode,
)
from trainguard.schemas.settings import build, from_environment

__all__ = ["DEFAULT_BUS_URL", "AgentConfig"]


_TORCHRUN_RESTARTS_ENV = ("TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT")
"""How many times torchrun may restart the rank's worker group, and how many times it did
(torchelastic's ``LocalElasticAgent`` sets both in every worker's environment)."""

_ENVIRONMENT: Mapping[str, tuple[str, ...]] = {
    "job_id": ("TRAINGUARD_JOB",),
    "bus_url": ("TRAINGUARD_BUS",),
    "topic_prefix": ("TRAINGUARD_TOPIC_PREFIX",),
    "rank": ("TRAINGUARD_RANK", "RANK"),
    "world_size": ("TRAINGUARD_WORLD_SIZE", "WORLD_SIZE"),
    "generation": ("TRAINGUARD_GENERATION",),
    "checkpoint_dir": ("TRAINGUARD_CHECKPOINT_DIR",),
    "checkpoint_format": ("TRAINGUARD_CHECKPOINT_FORMAT",),
    "checkpoint_uri": ("TRAINGUARD_CHECKPOINT_URI",),
    "probe_storage": ("TRAINGUARD_PROBE_STORAGE",),
    "heartbeat_interval_s": ("TRAINGUARD_HEARTBEAT_INTERVAL",),
    "restore_timeout_s": ("TRAINGUARD_RESTORE_TIMEOUT",),
    "resume_timeout_s": ("TRAINGUARD_RESUME_TIMEOUT",),
    "faults": ("TRAINGUARD_FAULTS",),
    "checksum_every": ("TRAINGUARD_CHECKSUM_EVERY",),
    "in_process_restore": ("TRAINGUARD_IN_PROCESS_RESTORE",),
    "code_version": ("TRAINGUARD_CODE_VERSION",),
    "init_from": ("TRAINGUARD_INIT_FROM",),
    "step_file": ("TRAINGUARD_STEP_FILE",),
    "outbox_max_events": ("TRAINGUARD_OUTBOX_MAX_EVENTS",),
    "spool_dir": ("TRAINGUARD_SPOOL_DIR",),
    "heartbeat_relay": ("TRAINGUARD_HEARTBEAT_RELAY",),
    "close_timeout_s": ("TRAINGUARD_CLOSE_TIMEOUT",),
}
"""Setting name -> the environment variables that set it, highest precedence first; each
value is parsed by the field's annotation (:func:`trainguard.schemas.settings.parse_text`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentConfig:
    """Settings of one rank's agent; validated on construction.

    Attributes:
        job_id: the job's name, 1-128 characters of ``[A-Za-z0-9._-]`` (``TRAINGUARD_JOB``);
            required.
        bus_url: bus URL (``TRAINGUARD_BUS``), default :data:`DEFAULT_BUS_URL` (the user's
            embedded bus, :func:`~trainguard.agent.bus.default_bus_url`);
            ``sqlite:///abs/path.db``, ``sqlite:rel/path.db`` or ``kafka://host:port,...``.
        topic_prefix: bus topic prefix (``TRAINGUARD_TOPIC_PREFIX``), default ``trainguard.``.
        kafka_security: Kafka TLS/SASL settings from the ``TRAINGUARD_KAFKA_*`` variables
            (:func:`~trainguard.agent.bus.load_kafka_security`; ``trainguard run`` passes its
            own on to the workers), default plaintext.
        rank: this process's rank (``TRAINGUARD_RANK``, else ``RANK``), default 0.
        world_size: number of ranks (``TRAINGUARD_WORLD_SIZE``, else ``WORLD_SIZE``), default 1.
        generation: fencing generation this process runs in (``TRAINGUARD_GENERATION``, set by
            the supervisor on every restart), default 0.
        checkpoint_dir: root folder of checkpoint shards and fault markers
            (``TRAINGUARD_CHECKPOINT_DIR``), default ``./checkpoints``; must be shared by all
            nodes for multi-node restores.
        checkpoint_format: how :meth:`Agent.checkpoint` stores a rank's state
            (``TRAINGUARD_CHECKPOINT_FORMAT``): ``torch`` (default), one ``torch.save`` file per
            rank; ``dcp``, ``torch.distributed.checkpoint`` (sharded FSDP2/DTensor state,
            restorable onto another world size; ``docs/checkpoints.md``).
        checkpoint_uri: where ``dcp`` checkpoints go (``TRAINGUARD_CHECKPOINT_URI``), an
            fsspec URL such as ``s3://bucket/prefix`` (credentials from the storage library's
            usual environment and configuration) or ``file:///shared/ckpt``; default
            ``checkpoint_dir``. Only for ``dcp``.
        probe_storage: check at start that the storage of a ``checkpoint_uri`` other than
            ``file://`` takes a write (``TRAINGUARD_PROBE_STORAGE``: ``1``/``true`` or
            ``0``/``false``), default True: constructing the :class:`Agent` writes and deletes
            an empty object under the job's folder, and raises ``ConfigError`` when the
            storage refuses (no such bucket, access denied) or ``StorageUnavailable`` when it
            does not answer a few attempts (``docs/checkpoints.md``, "Object storage").
        heartbeat_interval_s: seconds between heartbeats (``TRAINGUARD_HEARTBEAT_INTERVAL``),
            default 1.
        restore_timeout_s: seconds :meth:`Agent.restore_target` waits for the daemon's
            ``restore`` command (``TRAINGUARD_RESTORE_TIMEOUT``), default 300.
        resume_timeout_s: seconds :meth:`Agent.ready` waits for the daemon's ``resume`` after a
            restore (``TRAINGUARD_RESUME_TIMEOUT``), default 300.
        faults: fault-injection spec (``TRAINGUARD_FAULTS``), see :mod:`._faults`.
        checksum_every: with a model registered by :meth:`Agent.watch`, send its parameter
            checksum every this many steps (``TRAINGUARD_CHECKSUM_EVERY``), default 50; 0
            never.
        in_process_restore: the training loop catches :class:`RestoreRequested` and reloads
            in process (``TRAINGUARD_IN_PROCESS_RESTORE``: ``1``/``true`` or ``0``/``false``),
            default False: the agent then declines the daemon's in-process restores at once
            (lifecycle ``error`` with ``missed_at_step``), and the daemon restarts the
            processes instead.
        code_version: recorded in checkpoint metadata (``TRAINGUARD_CODE_VERSION``).
        init_from: ``snapshot_id`` of another job's committed snapshot this job starts from
            (``TRAINGUARD_INIT_FROM``; ``trainguard run --init-from``), or ``None`` for a
            start from scratch. :meth:`Agent.restore_target` then returns its manifest (read
            from the bus's ``manifests`` topic) in generation 0, and again whenever a restore
            of the daemon targets the job's initial state; every checkpoint names it as its
            ``parent``, and so does every snapshot the daemon commits for the job.
        hyperparameters: a JSON object recorded in checkpoint metadata (at most 16 levels deep).
        host: this machine's name, default ``socket.gethostname()``.
        keys: the daemon's public keys (``TRAINGUARD_DAEMON_PUBLIC_KEYS``: commands and
            ``init_from`` manifests must carry their signature) and the job's event key
            (``TRAINGUARD_EVENT_KEY``: events are sent with its MAC); default none, which is
            insecure (``docs/security.md``).
        heartbeat_queue: most heartbeats kept while the bus is slow or away (>= 1); older ones
            are dropped and counted.
        outbox_max_events: most checkpoint, data-cursor and lifecycle events kept while the bus
            is slow or away (``TRAINGUARD_OUTBOX_MAX_EVENTS``, >= 1), default 100,000: beyond
            that the oldest data-cursor event is dropped, and without one the new event is
            refused (an error log, counted in :attr:`AgentStats.refused_events`).
        spool_dir: the folder of this worker's spool (``TRAINGUARD_SPOOL_DIR``, set by
            ``trainguard run``), in which events wait until the bus took them, so that the
            supervisor can forward them after the process ended; ``None``: no spool.
        heartbeat_relay: the socket of the supervisor's heartbeat relay
            (``TRAINGUARD_HEARTBEAT_RELAY``, set by ``trainguard run --batch-heartbeats``):
            heartbeats go there, and the supervisor sends its node's heartbeats as one
            ``heartbeat-batch`` record; ``None`` (default): each heartbeat goes to the bus.
        close_timeout_s: seconds leaving the ``with`` block (:meth:`Agent.close`) waits for
            the bus to take the queued events (``TRAINGUARD_CLOSE_TIMEOUT``), default 30; what
            is left stays in the spool.
        step_file: a file in which :meth:`Agent.step` records the last step completed, for the
            supervisor's exit report (``TRAINGUARD_STEP_FILE``, set by ``trainguard run
            --nproc-per-node``; see :mod:`._step_file`), or ``None``.

    Raises:
        ConfigError: a value is out of range or does not fit the wire contract (the message
            names the setting).
    """

    job_id: str
    bus_url: str = DEFAULT_BUS_URL
    topic_prefix: str = "trainguard."
    kafka_security: KafkaSecurity = field(default_factory=KafkaSecurity)
    rank: int = 0
    world_size: int = 1
    generation: int = 0
    checkpoint_dir: Path = Path("checkpoints")
    checkpoint_format: CheckpointFormat = "torch"
    checkpoint_uri: str | None = None
    probe_storage: bool = True
    heartbeat_interval_s: float = 1.0
    restore_timeout_s: float = 300.0
    resume_timeout_s: float = 300.0
    faults: str = ""
    checksum_every: int = 50
    in_process_restore: bool = False
    code_version: str = ""
    init_from: str | None = None
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    host: str = field(default_factory=socket.gethostname)
    heartbeat_queue: int = 16
    outbox_max_events: int = 100_000
    spool_dir: Path | None = None
    heartbeat_relay: Path | None = None
    close_timeout_s: float = 30.0
    keys: AgentKeys = field(default_factory=AgentKeys)
    step_file: Path | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world size {self.world_size}")
        for name in ("heartbeat_interval_s", "restore_timeout_s", "resume_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value}")
        if not (self.close_timeout_s >= 0 and math.isfinite(self.close_timeout_s)):
            raise ConfigError(
                f"close_timeout_s must be a number of seconds >= 0, got {self.close_timeout_s}"
            )
        if self.outbox_max_events < 1:
            raise ConfigError(f"outbox_max_events must be >= 1, got {self.outbox_max_events}")
        if self.checksum_every < 0:
            raise ConfigError(f"checksum_every must be >= 0 steps, got {self.checksum_every}")
        if self.heartbeat_queue < 1:
            raise ConfigError(f"heartbeat_queue must be >= 1, got {self.heartbeat_queue}")
        parse_faults(self.faults)
        if self.checkpoint_uri is not None:
            scheme = urlsplit(self.checkpoint_uri).scheme
            if not scheme:
                raise ConfigError(
                    f"checkpoint_uri {self.checkpoint_uri!r} is no URL: give a scheme, e.g. "
                    "s3://bucket/prefix or file:///shared/checkpoints"
                )
            if scheme != "file":
                _check_storage(self.checkpoint_uri, scheme)
            if self.checkpoint_format != "dcp":
                raise ConfigError(
                    f"checkpoint_uri {self.checkpoint_uri!r}: only the dcp checkpoint format "
                    "writes to a URI (the torch format writes under checkpoint_dir); set "
                    "checkpoint_format='dcp' (TRAINGUARD_CHECKPOINT_FORMAT=dcp)"
                )
        if self.init_from is not None and self.init_from.partition("/")[0] == self.job_id:
            # The daemon restores a job's own snapshots; as a parent it would make a loop.
            raise ConfigError(
                f"init_from {self.init_from!r} is a snapshot of this job ({self.job_id!r}); "
                "start from another job's snapshot"
            )
        try:
            parse_bus_url(self.bus_url)
        except BusURLError as exc:
            raise ConfigError(str(exc)) from exc
        try:
            # What ends up on the wire is checked by the wire contract itself: job id, host,
            # rank, world size, generation, hyperparameters, code version and init_from.
            encode(self.checkpoint_template(step=0, cursor=_PROBE_CURSOR, pid=1))
        except SchemaError as exc:
            raise ConfigError(f"invalid agent setting: {exc}") from exc

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> AgentConfig:
        """Build the configuration from ``overrides``, then ``env`` (default ``os.environ``),
        then defaults; see the module docstring for the precedence.

        ``None`` overrides are ignored, so callers can pass optional arguments straight on;
        empty environment variables count as unset.

        Raises:
            ConfigError: unknown setting, ``job_id`` missing, an environment variable that does
                not parse, or an invalid value (see the class docstring); or ``env`` is a warm
                spare's that was not handed off yet (``TRAINGUARD_SPARE_FD`` set), or a rank
                torchrun may restart (or did restart) of its own under ``trainguard run``
                (``TORCHELASTIC_MAX_RESTARTS`` or ``TORCHELASTIC_RESTART_COUNT`` above 0 with
                ``TRAINGUARD_GENERATION`` set).
        """
        env = os.environ if env is None else env
        if SPARE_FD_ENV in env:
            # A spare's environment lacks its generation: an agent made from it would train
            # with stale state (docs/warm-restarts.md).
            raise ConfigError(
                f"this process is a warm spare of trainguard run --warm ({SPARE_FD_ENV} is "
                "set): call trainguard.agent.await_handoff() before the agent's settings are "
                "read (docs/warm-restarts.md)"
            )
        for name in _TORCHRUN_RESTARTS_ENV if env.get("TRAINGUARD_GENERATION") else ():
            # torchrun may restart this rank of its own (--max-restarts > 0, behind a script
            # or a variable the supervisor could not read): in the same generation, from
            # unknown state. Refused at the first start, before any step is trained.
            if env.get(name, "") not in ("", "0"):
                raise ConfigError(
                    f"torchrun restarts this rank itself ({name}={env[name]}) in a job "
                    "trainguard run supervises: run torchrun with --max-restarts 0; "
                    "trainguard's restores restart it in a new generation (docs/launchers.md)"
                )
        try:
            values = from_environment(cls, env, _ENVIRONMENT)
            kafka_security = load_kafka_security(env=env)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        values.update({k: v for k, v in overrides.items() if v is not None})
        if not values.get("job_id"):
            raise ConfigError("job id missing: pass job_id=... or set TRAINGUARD_JOB")
        # Built from several variables each, not parsed from one: passed through as given.
        built = {
            "kafka_security": values.pop("kafka_security", kafka_security),
            "keys": values.pop("keys", None) or agent_keys_from_env(env),
        }
        try:
            return build("agent setting", cls, values, **built)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    def checkpoint_template(self, *, step: int, cursor: DataCursor, pid: int) -> Checkpoint:
        """A checkpoint event of this rank for ``step`` with placeholder shard fields
        (URI, size, digest, ``seq``, ``ts``), to be replaced once the shard is written."""
        return Checkpoint(
            job_id=self.job_id,
            generation=self.generation,
            ts=0,
            seq=0,
            rank=self.rank,
            host=self.host,
            pid=pid,
            world_size=self.world_size,
            step=step,
            shard_uri="file:///",
            size_bytes=0,
            digest="sha256:" + "0" * 64,
            cursor=cursor,
            metadata=CheckpointMeta(
                hyperparameters=dict(self.hyperparameters),
                topology={"world_size": self.world_size},
                code_version=self.code_version,
            ),
            parent=self.init_from,
        )


def _check_storage(uri: str, scheme: str) -> None:
    """Raise :class:`ConfigError` when fsspec has no installed implementation for ``scheme``
    (``s3://`` needs s3fs: the ``s3`` extra)."""
    import fsspec

    try:
        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as exc:
        hint = " (pip install 'trainguard[s3]')" if scheme in ("s3", "s3a") else ""
        raise ConfigError(
            f"checkpoint_uri {uri!r}: no storage for {scheme}://: {exc}{hint}"
        ) from exc


_PROBE_CURSOR = DataCursor(data_version="probe", seed=0, epoch=0, offset=0, world_size=1)
