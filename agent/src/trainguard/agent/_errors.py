"""Errors of the agent: one base, subclasses named for the condition."""

from __future__ import annotations

__all__ = [
    "AgentError",
    "ConfigError",
    "JobAborted",
    "RestoreTimeout",
    "ShardCorrupt",
    "ShardError",
    "ShardMissing",
    "StaleGeneration",
]


class AgentError(Exception):
    """Base of the agent's errors."""


class ConfigError(AgentError, ValueError):
    """A setting is missing or invalid; the message names the setting or environment variable."""


class ShardError(AgentError):
    """A checkpoint shard cannot be used (the agent reported its snapshot to the daemon)."""


class ShardMissing(ShardError, FileNotFoundError):
    """The shard file named in a manifest does not exist, or the manifest has no shard for
    this rank."""


class ShardCorrupt(ShardError):
    """The shard's bytes do not match the digest in its manifest; it was not deserialized."""


class RestoreTimeout(AgentError, TimeoutError):
    """The daemon's ``restore`` or ``resume`` command for this generation did not arrive in
    time."""


class JobAborted(AgentError):
    """The daemon aborted the job; the message says why."""


class StaleGeneration(AgentError):
    """The daemon moved on to a newer generation while this process waited for its own: this
    process is fenced off and its supervisor will replace it."""
