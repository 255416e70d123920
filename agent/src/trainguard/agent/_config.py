"""The agent's configuration, built once from arguments and the environment.

Precedence, highest first: keyword arguments to :meth:`AgentConfig.resolve`, ``TRAINGUARD_*``
environment variables, the launcher's variables (``RANK``, ``WORLD_SIZE`` as set by torchrun
or trainguard's supervisor), defaults.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from trainguard.agent._errors import ConfigError

__all__ = ["DEFAULT_BUS_URL", "AgentConfig"]

DEFAULT_BUS_URL = "sqlite:///trainguard-bus.db"

# setting name -> (environment variables in order of precedence, converter)
_ENV: dict[str, tuple[tuple[str, ...], type]] = {
    "job_id": (("TRAINGUARD_JOB",), str),
    "bus_url": (("TRAINGUARD_BUS",), str),
    "topic_prefix": (("TRAINGUARD_TOPIC_PREFIX",), str),
    "rank": (("TRAINGUARD_RANK", "RANK"), int),
    "world_size": (("TRAINGUARD_WORLD_SIZE", "WORLD_SIZE"), int),
    "generation": (("TRAINGUARD_GENERATION",), int),
    "checkpoint_dir": (("TRAINGUARD_CHECKPOINT_DIR",), Path),
    "heartbeat_interval_s": (("TRAINGUARD_HEARTBEAT_INTERVAL",), float),
    "resume_timeout_s": (("TRAINGUARD_RESUME_TIMEOUT",), float),
    "faults": (("TRAINGUARD_FAULTS",), str),
    "code_version": (("TRAINGUARD_CODE_VERSION",), str),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentConfig:
    """Settings of one rank's agent.

    Attributes:
        job_id: the job's name (``TRAINGUARD_JOB``); required.
        bus_url: bus URL (``TRAINGUARD_BUS``), default ``sqlite:///trainguard-bus.db``.
        topic_prefix: bus topic prefix (``TRAINGUARD_TOPIC_PREFIX``), default ``trainguard.``.
        rank: this process's rank (``TRAINGUARD_RANK``, else ``RANK``), default 0.
        world_size: number of ranks (``TRAINGUARD_WORLD_SIZE``, else ``WORLD_SIZE``), default 1.
        generation: fencing generation this process runs in (``TRAINGUARD_GENERATION``, set by
            the supervisor on every restart), default 0.
        checkpoint_dir: root folder of checkpoint shards (``TRAINGUARD_CHECKPOINT_DIR``),
            default ``./checkpoints``; must be shared by all nodes for multi-node restores.
        heartbeat_interval_s: seconds between heartbeats (``TRAINGUARD_HEARTBEAT_INTERVAL``).
        resume_timeout_s: seconds :meth:`Agent.ready` waits for the daemon's ``resume`` after a
            restore (``TRAINGUARD_RESUME_TIMEOUT``).
        faults: fault-injection spec (``TRAINGUARD_FAULTS``), see :mod:`._faults`.
        code_version: recorded in checkpoint metadata (``TRAINGUARD_CODE_VERSION``).
        hyperparameters: recorded in checkpoint metadata.
        host: this machine's name, default ``socket.gethostname()``.
        heartbeat_queue: most heartbeats kept while the bus is slow; older ones are dropped.
    """

    job_id: str
    bus_url: str = DEFAULT_BUS_URL
    topic_prefix: str = "trainguard."
    rank: int = 0
    world_size: int = 1
    generation: int = 0
    checkpoint_dir: Path = Path("checkpoints")
    heartbeat_interval_s: float = 1.0
    resume_timeout_s: float = 300.0
    faults: str = ""
    code_version: str = ""
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    host: str = field(default_factory=socket.gethostname)
    heartbeat_queue: int = 16

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> AgentConfig:
        """Build the configuration from ``overrides``, then ``env`` (default ``os.environ``).

        ``None`` overrides are ignored, so callers can pass optional arguments straight on.
        Raises :class:`ConfigError` when ``job_id`` is missing or a value does not parse.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for name, (variables, convert) in _ENV.items():
            for var in variables:
                raw = env.get(var)
                if raw:
                    try:
                        values[name] = convert(raw)
                    except ValueError as exc:
                        raise ConfigError(f"{var}={raw!r}: not a valid {name}") from exc
                    break
        known = {f.name for f in fields(cls)}
        for name, value in overrides.items():
            if name not in known:
                raise ConfigError(f"unknown agent setting {name!r}")
            if value is not None:
                values[name] = value
        if not values.get("job_id"):
            raise ConfigError("job id missing: pass job_id=... or set TRAINGUARD_JOB")
        config = cls(**values)
        if not 0 <= config.rank < config.world_size:
            raise ConfigError(f"rank {config.rank} outside world size {config.world_size}")
        return config
