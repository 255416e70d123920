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
]


class AgentError(Exception):
    """Base of the agent's errors."""


class ConfigError(AgentError, ValueError):
    """A required setting is missing or invalid (names the argument and environment variable)."""


class ShardError(AgentError):
    """A checkpoint shard cannot be used."""


class ShardMissing(ShardError, FileNotFoundError):
    """The shard file named in a manifest does not exist."""


class ShardCorrupt(ShardError):
    """The shard's bytes do not match the digest in its manifest; it was not deserialized."""


class RestoreTimeout(AgentError, TimeoutError):
    """The daemon did not confirm a restore (``resume``) in time."""


class JobAborted(AgentError):
    """The daemon aborted the job; the message says why."""
