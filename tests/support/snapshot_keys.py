"""Daemon keys for the snapshot tests: what the key store hands the daemon
(:class:`trainguard.daemon.service._snapshot_store.SnapshotKeys`), made from fixed seeds so that failures
reproduce."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat


@dataclass(frozen=True)
class Keys:
    """A signing key, a data key, and the older keys a rotation kept."""

    signing_kid: str
    signing: Ed25519PrivateKey
    data_kid: str
    data_key: bytes
    verify: Mapping[str, Ed25519PublicKey] = field(default_factory=dict)
    data: Mapping[str, bytes] = field(default_factory=dict)


def _kid(material: bytes) -> str:
    return hashlib.sha256(material).hexdigest()[:16]


def make_keys(seed: int) -> Keys:
    """Keys derived from ``seed`` (a different seed: different keys and key ids)."""
    signing = Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"sign%d" % seed).digest())
    public = signing.public_key()
    data = hashlib.sha256(b"data%d" % seed).digest()
    signing_kid = _kid(public.public_bytes(Encoding.Raw, PublicFormat.Raw))
    data_kid = _kid(data)
    return Keys(signing_kid, signing, data_kid, data, {signing_kid: public}, {data_kid: data})


def rotated(old: Keys, seed: int) -> Keys:
    """``old`` rotated: new current keys from ``seed``, the old ones kept for verifying and
    decrypting."""
    new = make_keys(seed)
    return Keys(
        new.signing_kid,
        new.signing,
        new.data_kid,
        new.data_key,
        {**old.verify, **new.verify},
        {**old.data, **new.data},
    )
