"""Keys and command authentication, shared by agents, supervisors, the daemon and its CLI.

:class:`KeyStore` (:mod:`._keystore`) is the key directory (``docs/security.md``): the
daemon's Ed25519 signing key and AES-256 data key, per-job event keys, their ids and rotation;
:class:`AgentKeys` and :class:`DaemonKeys` are what each side loads from it.
:class:`CommandGate` (:mod:`._command_gate`) is the agent's check of a signed command
(signature, job, fencing generation) before it is obeyed.
"""

from __future__ import annotations

from trainguard.agent.keys._command_gate import (
    CommandGate,
)
from trainguard.agent.keys._keystore import (
    DEFAULT_KEYS_DIR,
    KEY_BYTES,
    AgentKeys,
    DaemonKeys,
    KeyKind,
    KeyStore,
    KeyStoreError,
    agent_keys_from_env,
    check_job_id,
    key_id,
    keys_dir,
    load_public_keys,
    public_key_id,
    public_pem,
)

__all__ = [
    "DEFAULT_KEYS_DIR",
    "KEY_BYTES",
    "AgentKeys",
    "CommandGate",
    "DaemonKeys",
    "KeyKind",
    "KeyStore",
    "KeyStoreError",
    "agent_keys_from_env",
    "check_job_id",
    "key_id",
    "keys_dir",
    "load_public_keys",
    "public_key_id",
    "public_pem",
]
