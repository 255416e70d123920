"""The command gate (``trainguard.agent.keys._command_gate``) on its own: it takes commands the
daemon signed, for its job, once, and names every forgery; with both public keys of a
rotation it takes the new key's commands; without keys it takes every command once. Agents
and supervisors behind the gate are tested in ``tests/service/agent/test_auth_commands.py``."""

from __future__ import annotations

import dataclasses

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from tests.support import jobbus as daemon
from tests.support.jobbus import JOB
from trainguard.agent.keys._command_gate import CommandGate, Ignored
from trainguard.agent.keys._keystore import public_key_id
from trainguard.schemas import Command, encode, sign

DAEMON = Ed25519PrivateKey.generate()
DAEMON_KID = public_key_id(DAEMON.public_key())
ROGUE = Ed25519PrivateKey.generate()
PUBLIC: dict[str, Ed25519PublicKey] = {DAEMON_KID: DAEMON.public_key()}


def signed(command: Command, key: Ed25519PrivateKey = DAEMON) -> bytes:
    return encode(sign(command, public_key_id(key.public_key()), key))


def verdict(gate: CommandGate, data: bytes) -> str:
    result = gate.admit(data)
    return result.reason if isinstance(result, Ignored) else "taken"


def test_the_gate_takes_signed_commands_and_names_every_forgery() -> None:
    gate = CommandGate(JOB, 1, PUBLIC)
    restore = daemon.restore(JOB, 2, None)
    as_rogue = dataclasses.replace(restore, seq=restore.seq + 1)
    forged_kid = encode(sign(restore, DAEMON_KID, ROGUE))  # claims the daemon's key id
    assert verdict(gate, encode(restore)) == "unsigned"
    assert verdict(gate, signed(as_rogue, ROGUE)) == "unknown_kid"
    assert verdict(gate, forged_kid) == "bad_signature"
    assert verdict(gate, signed(daemon.restore("other-job", 2, None))) == "wrong_job"
    assert verdict(gate, b"{not json") == "undecodable"
    assert verdict(gate, signed(daemon.restore(JOB, 0, None))) == "stale_generation"
    assert verdict(gate, signed(restore)) == "taken"
    assert verdict(gate, signed(restore)) == "duplicate"  # a re-read, not acted on twice
    other = dataclasses.replace(restore, reason="forged, but signed long ago?")
    assert verdict(gate, signed(other)) == "replayed"  # same (generation, seq), other content
    earlier = dataclasses.replace(restore, seq=restore.seq - 1, incident_id="x")
    assert verdict(gate, signed(earlier)) == "replayed"  # seq not after the last accepted
    resume = daemon.resume(JOB, 2, 10)
    assert verdict(gate, signed(resume)) == "taken"
    assert verdict(gate, signed(daemon.restore(JOB, 1, None))) == "stale_generation"


def test_with_both_public_keys_commands_of_the_rotated_key_are_taken() -> None:
    new = Ed25519PrivateKey.generate()
    both = {**PUBLIC, public_key_id(new.public_key()): new.public_key()}
    gate = CommandGate(JOB, 0, both)
    assert verdict(gate, signed(daemon.restore(JOB, 1, None))) == "taken"
    assert verdict(gate, signed(daemon.resume(JOB, 1, 0), new)) == "taken"
    only_old = CommandGate(JOB, 0, PUBLIC)
    assert verdict(only_old, signed(daemon.resume(JOB, 1, 0), new)) == "unknown_kid"


def test_without_keys_the_gate_takes_every_command_once() -> None:
    gate = CommandGate(JOB, 1, None)
    restore = daemon.restore(JOB, 2, None)
    assert verdict(gate, encode(restore)) == "taken"
    assert verdict(gate, encode(restore)) == "duplicate"  # the same bytes again
    assert verdict(gate, signed(restore, ROGUE)) == "duplicate"  # same content, signed
    other = dataclasses.replace(restore, reason="another meaning")
    assert verdict(gate, encode(other)) == "taken"  # nothing to check it against
    assert verdict(gate, encode(daemon.resume(JOB, 2, 10))) == "taken"
    assert verdict(gate, encode(daemon.restore(JOB, 0, None))) == "stale_generation"
    assert gate.ignored == {"duplicate": 2, "stale_generation": 1}
