"""Managing the daemon's key directory: what ``trainguard keys init|rotate|job|show|retire``
does (the layout and the reading side: :mod:`trainguard.agent.keys._keystore`).

* **init** creates the directory, a signing key (Ed25519) and a data key (AES-256-GCM), each
  current, and optionally event keys for jobs.
* **rotate** adds a new key of a kind (signing, data, or one job's event key) and makes it
  current; the old keys stay, so what they signed, encrypted or MACed still verifies.
* **retire** moves a key that is not current to ``retired/``: it no longer verifies new input
  (the daemon keeps retired event keys only to rebuild state from events that arrived before).
* **show** lists every key with its kind, job, creation and retirement time; only public data.
* **agent bundle**: what one job's agents and supervisors need (the live public keys and the
  job's current event key), for a secret mount.

Key files are written 0600 in directories 0700, each through a temporary file, ``fsync`` and
an atomic rename, so a crash leaves either no key or a whole one; ``current`` is switched the
same way, after the new key is durable. Keys come from ``secrets.token_bytes`` (data, event)
and ``cryptography``'s Ed25519 key generation (signing).
"""

from __future__ import annotations

import base64
import contextlib
import os
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import orjson
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from trainguard.agent.checkpoint import sync_folder, write_durably
from trainguard.agent.keys import (
    KEY_BYTES,
    KeyKind,
    KeyStore,
    KeyStoreError,
    check_job_id,
    key_id,
    public_key_id,
    public_pem,
)

__all__ = ["AgentBundle", "KeyAdmin", "KeyInfo"]


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """One key as ``trainguard keys show`` lists it (public data only).

    Attributes:
        kind: ``signing``, ``data`` or ``event``.
        kid: its key id.
        job_id: the job of an event key, else ``None``.
        created_at: when it was made, ISO 8601 UTC (the file's modification time when its
            metadata file is missing).
        current: whether it is the current key of its kind (and job).
        retired_at: when it was retired, or ``None`` for a live key.
    """

    kind: KeyKind
    kid: str
    job_id: str | None
    created_at: str
    current: bool
    retired_at: str | None = None

    def to_dict(self) -> dict[str, str | bool | None]:
        """JSON-ready form (``trainguard keys show --format json``)."""
        return {
            "kind": self.kind,
            "kid": self.kid,
            "job_id": self.job_id,
            "created_at": self.created_at,
            "current": self.current,
            "retired_at": self.retired_at,
        }


@dataclass(frozen=True, slots=True)
class AgentBundle:
    """What one job's agents and supervisors are given (``docs/security.md``).

    Attributes:
        job_id: the job.
        public_keys: PEM text of every live signing public key (current first), the value of
            ``TRAINGUARD_DAEMON_PUBLIC_KEYS``.
        event_key: ``<kid>:<base64>`` of the job's current event key, the value of
            ``TRAINGUARD_EVENT_KEY`` (a secret).
    """

    job_id: str
    public_keys: str
    event_key: str

    def secret_manifest(self, name: str | None = None) -> dict[str, object]:
        """A Kubernetes ``Secret`` (JSON, which ``kubectl apply -f`` reads) holding the two
        values as files ``daemon-public-keys.pem`` and ``event-key``."""
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name or f"trainguard-agent-{self.job_id.lower()}"},
            "type": "Opaque",
            "stringData": {
                "daemon-public-keys.pem": self.public_keys,
                "event-key": self.event_key + "\n",
            },
        }

    def write(self, folder: Path) -> tuple[Path, Path]:
        """Write ``daemon-public-keys.pem`` and ``event-key`` (mode 0600) into ``folder``
        (created 0700); return their paths."""
        _make_dir(folder)
        public, event = folder / "daemon-public-keys.pem", folder / "event-key"
        write_durably(public, self.public_keys.encode())
        write_durably(event, (self.event_key + "\n").encode())
        return public, event


class KeyAdmin:
    """Creates, rotates, retires and lists the keys of one key directory.

    Args:
        path: the key directory (created by :meth:`init`).
        clock: wall clock in seconds since the epoch, for the metadata's times.
    """

    def __init__(self, path: Path, clock: Callable[[], float] = time.time) -> None:
        self.store = KeyStore(path)
        self._clock = clock

    @property
    def path(self) -> Path:
        """The key directory."""
        return self.store.path

    def init(self, jobs: Iterable[str] = ()) -> list[KeyInfo]:
        """Create the directory with a current signing key and data key, and an event key for
        each of ``jobs`` that has none; return the keys created.

        Raises:
            KeyStoreError: the directory already holds a signing or data key (``rotate``
                adds keys), or a job id is invalid.
        """
        jobs = [check_job_id(j) for j in jobs]
        if self.store.current("signing") or self.store.current("data"):
            raise KeyStoreError(
                f"{self.path} is initialised already: use trainguard keys rotate to add keys"
            )
        _make_dir(self.path)
        made = [self._new_key("signing"), self._new_key("data")]
        made += [self._new_key("event", job) for job in jobs if self._no_event_key(job)]
        return made

    def add_job(self, job_id: str) -> KeyInfo:
        """Create the first event key of ``job_id`` (current).

        Raises:
            KeyStoreError: the job has an event key already (``rotate`` adds another), the
                directory is not initialised, or ``job_id`` is invalid.
        """
        check_job_id(job_id)
        self._require_init()
        if not self._no_event_key(job_id):
            raise KeyStoreError(
                f"job {job_id} has an event key already: trainguard keys rotate --job {job_id}"
            )
        return self._new_key("event", job_id)

    def rotate(self, kind: KeyKind, job_id: str | None = None) -> KeyInfo:
        """Add a new key of ``kind`` (of ``job_id`` for ``event``) and make it current; the
        previous keys stay live until retired.

        Raises:
            KeyStoreError: the directory is not initialised, or the job has no event key yet
                (``add_job`` creates its first).
        """
        self._require_init()
        if kind == "event" and (job_id is None or self._no_event_key(check_job_id(job_id))):
            raise KeyStoreError(
                f"job {job_id} has no event key to rotate: trainguard keys job {job_id}"
            )
        return self._new_key(kind, job_id)

    def retire(self, kid: str) -> KeyInfo:
        """Move key ``kid`` (any kind) to ``retired/``.

        Raises:
            KeyStoreError: no live key ``kid``, or it is current (rotate first).
        """
        for info in self.all_keys():
            if info.kid != kid or info.retired_at is not None:
                continue
            if info.current:
                what = f"--job {info.job_id}" if info.kind == "event" else f"--{info.kind}"
                raise KeyStoreError(
                    f"{info.kind} key {kid} is current: trainguard keys rotate {what} first"
                )
            source = self.store.kind_dir(info.kind, info.job_id)
            target = self.store.kind_dir(info.kind, info.job_id, retired=True)
            _make_dir(target)
            retired_at = self._now()
            meta = self._meta(source, info) | {"retired_at": retired_at}
            write_durably(target / f"{kid}.json", orjson.dumps(meta))
            for name in _file_names(info.kind, kid):
                os.replace(source / name, target / name)
            (source / f"{kid}.json").unlink(missing_ok=True)
            sync_folder(source)
            sync_folder(target)
            return KeyInfo(info.kind, kid, info.job_id, info.created_at, False, retired_at)
        raise KeyStoreError(f"no live key {kid} in {self.path}")

    def all_keys(self) -> list[KeyInfo]:
        """Every key, live then retired, by kind (signing, data, events by job) and age."""
        out: list[KeyInfo] = []
        for retired in (False, True):
            for kind, job in self._groups(retired=retired):
                current = None if retired else self.store.current(kind, job)
                folder = self.store.kind_dir(kind, job, retired=retired)
                infos = [
                    self._info(folder, kind, kid, job, current == kid)
                    for kid in self.store.kids(kind, job, retired=retired)
                ]
                out += sorted(infos, key=lambda i: (i.created_at, i.kid))
        return out

    def agent_bundle(self, job_id: str) -> AgentBundle:
        """The live public keys and ``job_id``'s current event key (:class:`AgentBundle`).

        Raises:
            KeyStoreError: the job has no event key (``add_job``), or the directory is not
                initialised.
        """
        check_job_id(job_id)
        current = self._require_init()
        event_kid = self.store.current("event", job_id)
        if event_kid is None:
            raise KeyStoreError(f"job {job_id} has no event key: trainguard keys job {job_id}")
        event = self.store.secret_key("event", event_kid, job_id)
        public = self.store.public_keys()
        order = [current, *sorted(public.keys() - {current})]
        return AgentBundle(
            job_id=job_id,
            public_keys="".join(public_pem(public[kid]) for kid in order),
            event_key=f"{event_kid}:{base64.b64encode(event).decode()}",
        )

    # -- helpers -----------------------------------------------------------------------------

    def _require_init(self) -> str:
        current = self.store.current("signing")
        if current is None or self.store.current("data") is None:
            raise KeyStoreError(
                f"{self.path} is not initialised: trainguard keys init --keys {self.path}"
            )
        return current

    def _no_event_key(self, job_id: str) -> bool:
        return self.store.current("event", job_id) is None

    def _groups(self, *, retired: bool) -> list[tuple[KeyKind, str | None]]:
        groups: list[tuple[KeyKind, str | None]] = [("signing", None), ("data", None)]
        events = (self.path / "retired" if retired else self.path) / "events"
        with contextlib.suppress(FileNotFoundError):
            groups += [("event", p.name) for p in sorted(events.iterdir()) if p.is_dir()]
        return groups

    def _new_key(self, kind: KeyKind, job_id: str | None = None) -> KeyInfo:
        folder = self.store.kind_dir(kind, job_id)
        _make_dir(folder)
        if kind == "signing":
            private = Ed25519PrivateKey.generate()
            kid = public_key_id(private.public_key())
            pem = private.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
            write_durably(folder / f"{kid}.pem", pem)
            write_durably(folder / f"{kid}.pub.pem", public_pem(private.public_key()).encode())
        else:
            secret = secrets.token_bytes(KEY_BYTES)
            kid = key_id(secret)
            write_durably(folder / f"{kid}.key", secret)
        info = KeyInfo(kind, kid, job_id, self._now(), True)
        meta = {"kid": kid, "kind": kind, "job_id": job_id, "created_at": info.created_at}
        write_durably(folder / f"{kid}.json", orjson.dumps(meta | {"retired_at": None}))
        write_durably(folder / "current", f"{kid}\n".encode())  # after the key is durable
        return info

    def _info(
        self, folder: Path, kind: KeyKind, kid: str, job: str | None, current: bool
    ) -> KeyInfo:
        fallback = KeyInfo(kind, kid, job, "", current)
        meta = self._meta(folder, fallback)
        created, retired = meta.get("created_at"), meta.get("retired_at")
        return KeyInfo(
            kind,
            kid,
            job,
            created if isinstance(created, str) else "",
            current,
            retired if isinstance(retired, str) else None,
        )

    def _meta(self, folder: Path, info: KeyInfo) -> dict[str, object]:
        """The key's metadata file, or what can be told without it (the key file's mtime)."""
        try:
            meta = orjson.loads((folder / f"{info.kid}.json").read_bytes())
        except (OSError, orjson.JSONDecodeError):
            meta = None
        if isinstance(meta, dict):
            return meta
        key_file = folder / _file_names(info.kind, info.kid)[0]
        created = _iso(key_file.stat().st_mtime) if key_file.exists() else ""
        return {"kid": info.kid, "kind": info.kind, "job_id": info.job_id, "created_at": created}

    def _now(self) -> str:
        return _iso(self._clock())


def _iso(seconds: float) -> str:
    moment = datetime.fromtimestamp(seconds, UTC)
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


def _file_names(kind: KeyKind, kid: str) -> tuple[str, ...]:
    """The files of key ``kid`` besides its metadata: the key first."""
    return (f"{kid}.pem", f"{kid}.pub.pem") if kind == "signing" else (f"{kid}.key",)


def _make_dir(path: Path) -> None:
    """Create ``path`` and its missing parents with mode 0700 (whatever the umask)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    for created in missing:
        created.chmod(0o700)
