"""Reading trainguard's keys: the daemon's key directory, and what agents and supervisors are
given (``docs/security.md``).

**The key directory** (``trainguard keys --keys DIR``, ``TRAINGUARD_KEYS``, default
``~/.config/trainguard/keys``; written by ``trainguard keys``, see
:mod:`trainguard.daemon.admin._keys`)::

    signing/<kid>.pem        Ed25519 private key (PKCS#8 PEM, unencrypted)   secret
    signing/<kid>.pub.pem    its public key (SubjectPublicKeyInfo PEM)
    signing/current          the kid signing now (text)
    data/<kid>.key           32 random bytes: an AES-256-GCM key               secret
    data/current
    events/<job_id>/<kid>.key  32 random bytes: the job's HMAC-SHA256 key     secret
    events/<job_id>/current
    retired/...              the same layout for retired keys
    <kid>.json next to each key: {"kid", "kind", "job_id", "created_at", "retired_at"}

Directories are created 0700 and files 0600. Loading refuses a secret file that its group
or other users can read (:class:`InsecureKeyFile`), and a key whose file name is not its kid.

**Key ids** (``kid``): the first 8 bytes of the SHA-256 of the key, as 16 lowercase hex
digits: of the raw 32-byte public key for Ed25519 (:func:`public_key_id`), of the key bytes
for data and event keys (:func:`key_id`). Anyone holding a key can recompute its id; the id
reveals nothing usable about a secret key (SHA-256 is preimage resistant).

**Agents and supervisors** get no directory, only (:func:`load_public_keys`,
:func:`load_event_key`):

* ``TRAINGUARD_DAEMON_PUBLIC_KEYS``: PEM text of one or more daemon public keys, or the path
  of a file holding them (give old and new keys during a rotation);
* ``TRAINGUARD_EVENT_KEY``: ``<kid>:<base64 key>``, or the path of a file holding that or the
  32 raw key bytes (a Kubernetes secret mount; mode 0400 or 0600).

Nothing here logs or formats key material: reprs hide secrets, errors name paths and kids.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal, TypeAlias

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from trainguard.agent._errors import ConfigError
from trainguard.schemas.settings import expand_user

__all__ = [
    "DEFAULT_KEYS_DIR",
    "KEY_BYTES",
    "AgentKeys",
    "DaemonKeys",
    "EventKey",
    "InsecureKeyFile",
    "KeyKind",
    "KeyStore",
    "KeyStoreError",
    "agent_keys_from_env",
    "check_job_id",
    "check_secret_file",
    "key_id",
    "keys_dir",
    "load_event_key",
    "load_public_keys",
    "public_key_id",
    "public_pem",
]

DEFAULT_KEYS_DIR: Final = Path("~/.config/trainguard/keys")
"""The key directory when neither ``--keys`` nor ``TRAINGUARD_KEYS`` names one."""

KEY_BYTES: Final = 32
"""Length of a data key (AES-256) and of an event key (HMAC-SHA256), bytes."""

KeyKind: TypeAlias = Literal["signing", "data", "event"]

_KID = re.compile(r"[0-9a-f]{16}")
_JOB_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z ]+)-----.+?-----END \1-----", re.DOTALL)
_CACHE_LIMIT = 10_000
"""Most jobs whose event keys one :class:`DaemonKeys` caches (negative answers included)."""


class KeyStoreError(ConfigError):
    """Keys are missing, malformed or inconsistent; the message names the file, never a key."""


class InsecureKeyFile(KeyStoreError):
    """A secret key file can be read by its group or by other users."""


def key_id(material: bytes) -> str:
    """The kid of a data or event key: SHA-256 of ``material``, first 8 bytes, hex."""
    return hashlib.sha256(material).digest()[:8].hex()


def public_key_id(key: Ed25519PublicKey) -> str:
    """The kid of an Ed25519 key pair: SHA-256 of the raw 32-byte public key, first 8 bytes."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return key_id(raw)


def public_pem(key: Ed25519PublicKey) -> str:
    """``key`` as SubjectPublicKeyInfo PEM text."""
    return key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


def check_job_id(job_id: str) -> str:
    """``job_id`` if it is a valid job id that is safe as a directory name (the wire pattern
    ``[A-Za-z0-9._-]{1,128}``, and not ``.`` or ``..``).

    Raises:
        KeyStoreError: it is not.
    """
    if not _JOB_ID.fullmatch(job_id) or job_id in (".", ".."):
        raise KeyStoreError(f"{job_id[:140]!r} is not a job id")
    return job_id


def check_secret_file(path: Path) -> os.stat_result:
    """Stat ``path`` (following symlinks, as a Kubernetes secret mount has them) and refuse it
    when its group or other users may read it.

    Raises:
        InsecureKeyFile: mode has a group or other read bit (the message says how to fix it).
        KeyStoreError: ``path`` is not a regular file or cannot be read.
    """
    try:
        st = path.stat()
    except OSError as exc:
        raise KeyStoreError(f"cannot read key file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyStoreError(f"key file {path} is not a regular file")
    if st.st_mode & 0o044:
        raise InsecureKeyFile(
            f"key file {path} is readable by its group or other users (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): chmod 600 {path} (a Kubernetes secret mount: "
            "defaultMode 0400)"
        )
    return st


def _read_secret(path: Path) -> bytes:
    check_secret_file(path)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise KeyStoreError(f"cannot read key file {path}: {exc.strerror}") from None


@dataclass(frozen=True, slots=True)
class EventKey:
    """A job's event key, as an agent or supervisor holds it.

    Attributes:
        kid: its key id.
        secret: the 32 key bytes (hidden from ``repr``).
    """

    kid: str
    secret: bytes = field(repr=False)


def keys_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The key directory: ``explicit`` (``--keys``), else ``TRAINGUARD_KEYS``, else
    :data:`DEFAULT_KEYS_DIR`; ``~`` expanded.

    Raises:
        KeyStoreError: a ``~user`` that names no user.
    """
    chosen = explicit or os.environ.get("TRAINGUARD_KEYS") or DEFAULT_KEYS_DIR
    try:
        return expand_user(chosen)
    except ValueError as exc:  # a directory's path is no secret: quoted
        raise KeyStoreError(f"the key directory (--keys, TRAINGUARD_KEYS): {exc}") from None


def _expanded(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` with ``~`` expanded (:func:`trainguard.schemas.settings.expand_user`).

    Raises:
        KeyStoreError: ``~user`` names no user; the message names ``what`` but not the path,
            which may come from a variable that could hold a key.
    """
    try:
        return expand_user(path)
    except ValueError:
        raise KeyStoreError(
            f"{what}: the path starts with a ~ or ~user whose home directory is unknown"
        ) from None


class KeyStore:
    """Read access to a key directory (module docstring for the layout).

    Args:
        path: the key directory.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def kind_dir(self, kind: KeyKind, job_id: str | None = None, *, retired: bool = False) -> Path:
        """The directory of ``kind`` keys (of ``job_id`` for events), live or retired.

        Raises:
            KeyStoreError: an event directory without a valid ``job_id``.
        """
        base = self.path / "retired" if retired else self.path
        if kind == "event":
            if job_id is None:
                raise KeyStoreError("event keys belong to a job")
            return base / "events" / check_job_id(job_id)
        return base / kind

    def current(self, kind: KeyKind, job_id: str | None = None) -> str | None:
        """The current kid of ``kind`` (``None`` when there is none yet).

        Raises:
            KeyStoreError: the ``current`` file is unreadable or holds no kid.
        """
        path = self.kind_dir(kind, job_id) / "current"
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise KeyStoreError(f"cannot read {path}: {reason}") from None
        if not _KID.fullmatch(text):
            raise KeyStoreError(f"{path} does not hold a key id")
        return text

    def kids(self, kind: KeyKind, job_id: str | None = None, *, retired: bool = False) -> list[str]:
        """The kids of ``kind`` present, sorted (empty when the directory is missing)."""
        folder = self.kind_dir(kind, job_id, retired=retired)
        suffix = ".pem" if kind == "signing" else ".key"
        try:
            names = [p.name for p in folder.iterdir()]
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise KeyStoreError(f"cannot list {folder}: {exc.strerror}") from None
        kids = (n[: -len(suffix)] for n in names if n.endswith(suffix))
        return sorted(k for k in kids if _KID.fullmatch(k))

    def signing_key(self, kid: str, *, retired: bool = False) -> Ed25519PrivateKey:
        """The private signing key ``kid``.

        Raises:
            InsecureKeyFile: its file is readable by group or others.
            KeyStoreError: missing, not an Ed25519 PKCS#8 PEM, or not key ``kid``.
        """
        path = self.kind_dir("signing", retired=retired) / f"{kid}.pem"
        pem = _read_secret(path)
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except ValueError:
            raise KeyStoreError(f"{path} is not an unencrypted PKCS#8 PEM private key") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyStoreError(f"{path} is not an Ed25519 key")
        if public_key_id(key.public_key()) != kid:
            raise KeyStoreError(f"{path} holds another key than its name says")
        return key

    def public_keys(self, *, retired: bool = False) -> dict[str, Ed25519PublicKey]:
        """The signing keys' public halves by kid (live ones, or with ``retired`` the retired
        ones), read from the ``.pub.pem`` files.

        Raises:
            KeyStoreError: a public key file is malformed or not the key its name says.
        """
        folder = self.kind_dir("signing", retired=retired)
        out: dict[str, Ed25519PublicKey] = {}
        for kid in self.kids("signing", retired=retired):
            path = folder / f"{kid}.pub.pem"
            try:
                (key,) = load_public_keys(str(path)).values()
            except (ConfigError, ValueError) as exc:
                raise KeyStoreError(f"{path}: {exc}") from None
            if public_key_id(key) != kid:
                raise KeyStoreError(f"{path} holds another key than its name says")
            out[kid] = key
        return out

    def secret_key(
        self,
        kind: Literal["data", "event"],
        kid: str,
        job_id: str | None = None,
        *,
        retired: bool = False,
    ) -> bytes:
        """The 32 bytes of data or event key ``kid``.

        Raises:
            InsecureKeyFile: its file is readable by group or others.
            KeyStoreError: missing, not 32 bytes, or not key ``kid``.
        """
        path = self.kind_dir(kind, job_id, retired=retired) / f"{kid}.key"
        key = _read_secret(path)
        if len(key) != KEY_BYTES or key_id(key) != kid:
            raise KeyStoreError(f"{path} is not the {KEY_BYTES}-byte key {kid}")
        return key

    def secret_keys(
        self, kind: Literal["data", "event"], job_id: str | None = None, *, retired: bool = False
    ) -> dict[str, bytes]:
        """Every data or event key (of ``job_id``) by kid, live or retired."""
        return {
            kid: self.secret_key(kind, kid, job_id, retired=retired)
            for kid in self.kids(kind, job_id, retired=retired)
        }

    def load_daemon_keys(self) -> DaemonKeys:
        """Everything the daemon holds: current signing key, live public keys, data keys;
        event keys are read per job on first use (:meth:`DaemonKeys.event_keys`).

        Raises:
            InsecureKeyFile: a secret file is readable by group or others.
            KeyStoreError: the directory has no current signing or data key (``trainguard keys
                init`` creates them), or a key file is malformed.
        """
        signing_kid, data_kid = self.current("signing"), self.current("data")
        if signing_kid is None or data_kid is None:
            raise KeyStoreError(
                f"{self.path} holds no current signing and data key: run trainguard keys init "
                f"--keys {self.path}"
            )
        data = self.secret_keys("data")
        if data_kid not in data:
            raise KeyStoreError(f"current data key {data_kid} is missing from {self.path}")
        return DaemonKeys(
            signing_kid=signing_kid,
            signing=self.signing_key(signing_kid),
            verify=self.public_keys(),
            data_kid=data_kid,
            data=data,
            store=self,
        )


@dataclass(frozen=True, slots=True)
class _JobKeys:
    live: Mapping[str, bytes]
    retired: Mapping[str, bytes]
    current: str | None


@dataclass(frozen=True)
class DaemonKeys:
    """The keys the daemon holds, as loaded at one moment (the service reloads them).

    Attributes:
        signing_kid: kid of the current signing key.
        signing: the current Ed25519 signing key.
        verify: public keys of every non-retired signing key by kid, current included.
        data_kid: kid of the current data key.
        data: every non-retired 32-byte AES-256-GCM data key by kid, current included.
        store: where event keys are read from (``None``: no job has event keys).
    """

    signing_kid: str
    signing: Ed25519PrivateKey = field(repr=False)
    verify: Mapping[str, Ed25519PublicKey] = field(repr=False)
    data_kid: str
    data: Mapping[str, bytes] = field(repr=False)
    store: KeyStore | None = field(default=None, repr=False, compare=False)
    _jobs: dict[str, _JobKeys | None] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def event_keys(self, job_id: str) -> Mapping[str, bytes] | None:
        """The non-retired event keys of ``job_id`` by kid, or ``None`` for a job without
        event keys (an unknown job). Read on first use and cached in this object.

        Raises:
            InsecureKeyFile, KeyStoreError: as :meth:`KeyStore.secret_key`.
        """
        keys = self._job(job_id)
        return keys.live if keys is not None and keys.live else None

    def retired_event_keys(self, job_id: str) -> Mapping[str, bytes]:
        """The retired event keys of ``job_id`` by kid (empty for an unknown job)."""
        keys = self._job(job_id)
        return {} if keys is None else keys.retired

    def current_event_key(self, job_id: str) -> tuple[str, bytes] | None:
        """``(kid, key)`` of the event key ``job_id`` MACs with now, or ``None``."""
        keys = self._job(job_id)
        if keys is None or keys.current is None:
            return None
        return keys.current, keys.live[keys.current]

    def refresh(self, job_id: str) -> None:
        """Forget what was read of ``job_id``'s event keys: the next lookup reads them again
        (a key created or rotated since)."""
        self._jobs.pop(job_id, None)

    def _job(self, job_id: str) -> _JobKeys | None:
        if job_id in self._jobs:
            return self._jobs[job_id]
        keys: _JobKeys | None = None
        if self.store is not None and _JOB_ID.fullmatch(job_id) and job_id not in (".", ".."):
            live = self.store.secret_keys("event", job_id)
            retired = self.store.secret_keys("event", job_id, retired=True)
            current = self.store.current("event", job_id)
            if current is not None and current not in live:
                raise KeyStoreError(f"current event key {current} of job {job_id} is missing")
            if live or retired:
                keys = _JobKeys(live, retired, current)
        if len(self._jobs) >= _CACHE_LIMIT:
            self._jobs.clear()  # a flood of unknown job ids must not grow memory
        self._jobs[job_id] = keys
        return keys


# -- what agents and supervisors are given ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AgentKeys:
    """What an agent or a supervisor holds (both ``None``: unauthenticated, as before keys).

    Attributes:
        verify: the daemon's public keys by kid; with them, every command (and ``init_from``
            manifest) must carry a valid signature of one of them.
        event: the job's event key; with it, every event sent carries its MAC.
    """

    verify: Mapping[str, Ed25519PublicKey] | None = field(default=None, repr=False)
    event: EventKey | None = None


def agent_keys_from_env(env: Mapping[str, str]) -> AgentKeys:
    """:class:`AgentKeys` from ``TRAINGUARD_DAEMON_PUBLIC_KEYS`` and ``TRAINGUARD_EVENT_KEY``
    (empty or unset: none).

    Raises:
        ConfigError: as :func:`load_public_keys` and :func:`load_event_key`; the message never
            quotes the variable's value.
    """
    public = env.get("TRAINGUARD_DAEMON_PUBLIC_KEYS")
    event = env.get("TRAINGUARD_EVENT_KEY")
    return AgentKeys(
        verify=load_public_keys(public) if public else None,
        event=load_event_key(event) if event else None,
    )


def load_public_keys(spec: str) -> dict[str, Ed25519PublicKey]:
    """Daemon public keys from ``TRAINGUARD_DAEMON_PUBLIC_KEYS``: PEM text, or the path of a
    file holding one or more PEM public keys.

    Returns:
        The keys by kid (:func:`public_key_id`).

    Raises:
        ConfigError: the file cannot be read, holds no public key, holds a private key (agents
            get only public keys), or holds a key that is not Ed25519.
    """
    if "-----BEGIN" in spec:
        text, where = spec.encode(), "TRAINGUARD_DAEMON_PUBLIC_KEYS"
    else:
        path = _expanded(spec, "TRAINGUARD_DAEMON_PUBLIC_KEYS")
        try:
            text, where = path.read_bytes(), str(path)
        except OSError as exc:
            raise ConfigError(f"cannot read daemon public keys {path}: {exc.strerror}") from None
    keys: dict[str, Ed25519PublicKey] = {}
    for block in _PEM_BLOCK.finditer(text):
        if b"PRIVATE" in block[1]:
            raise ConfigError(f"{where} holds a private key: give agents only public keys")
        try:
            key = serialization.load_pem_public_key(block[0])
        except ValueError:
            raise ConfigError(f"{where} holds a malformed PEM public key") from None
        if not isinstance(key, Ed25519PublicKey):
            raise ConfigError(f"{where} holds a public key that is not Ed25519")
        keys[public_key_id(key)] = key
    if not keys:
        raise ConfigError(f"{where} holds no PEM public key")
    return keys


def load_event_key(spec: str) -> EventKey:
    """A job's event key from ``TRAINGUARD_EVENT_KEY``: ``<kid>:<base64>``, or the path of a
    file holding that text or the 32 raw key bytes (checked like every secret file).

    Raises:
        InsecureKeyFile: the file is readable by group or others.
        ConfigError: the file cannot be read, the key is not 32 bytes, or the kid given is not
            the key's.
    """
    if _inline_event_key(spec):
        return _parse_event_key(spec.encode(), "TRAINGUARD_EVENT_KEY")
    path = _expanded(spec, "TRAINGUARD_EVENT_KEY")
    return _parse_event_key(_read_secret(path), str(path))


def _inline_event_key(spec: str) -> bool:
    kid, sep, _ = spec.partition(":")
    return bool(sep) and _KID.fullmatch(kid) is not None


def _parse_event_key(raw: bytes, where: str) -> EventKey:
    if len(raw) == KEY_BYTES:
        return EventKey(key_id(raw), raw)
    kid, sep, encoded = raw.strip().partition(b":")
    try:
        key = base64.b64decode(encoded, validate=True) if sep else b""
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise ConfigError(
            f"{where} is not an event key: '<kid>:<base64 of {KEY_BYTES} bytes>' or "
            f"{KEY_BYTES} raw bytes"
        )
    if kid.decode(errors="replace") != key_id(key):
        raise ConfigError(f"{where}: the kid given is not the key's id")
    return EventKey(key_id(key), key)
