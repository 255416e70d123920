"""The daemon's side of authentication (``docs/security.md``): which keys it holds, and how
it judges the events it folds.

**Keys** (:func:`load_keys`): from ``[security] keys_dir`` (``--keys``, ``TRAINGUARD_KEYS``),
else from ``~/.config/trainguard/keys`` when that holds a current signing and data key, else
none. With keys the daemon signs every command and committed manifest (Ed25519), MACs the
ticks it writes into a job's events with the job's event key, and verifies events; without,
it runs as before authentication existed (insecure). ``require_auth`` refuses to start
without keys.

**Events** (:class:`EventAuth`, the intake's :class:`~trainguard.daemon.core._intake.Authenticator`):

==========================================  ============================================
the record                                   verdict
==========================================  ============================================
no keys at all                               authentic (unauthenticated mode)
job without an event key, no MAC             authentic, unless ``require_auth``
                                             (``unknown_job``)
job without an event key, with a MAC         ``unknown_job`` (a MAC nobody here can check:
                                             a misconfiguration, made loud)
job with event keys, no MAC                  ``missing_mac``
MAC under a kid the job does not have        ``unknown_kid``
MAC that does not verify                     ``bad_mac``
MAC under a live key of the job              authentic
the job's key files unusable                 ``key_error`` (readable by group or others,
                                             wrong size, malformed: the operator's to fix;
                                             the daemon goes on with the other jobs)
==========================================  ============================================

Intake asks :meth:`EventAuth.mac_keys` first for a record laid out as ``encode`` writes a MACed
event, and takes it without decoding the ``auth`` member when the MAC verifies on the raw bytes
under one of them (:mod:`trainguard.daemon.core._intake`): the last row of the table, reached
without decoding the record whole first. Any other record, and any that does not verify there,
comes to :meth:`EventAuth.refuse`, which applies the whole table (and the refresh below).

A daemon rebuilding state (folding records it has acted on before) accepts the job's retired
keys too: those records were judged when they arrived, and a key retired since must not drop
them (a committed step would be lost). Key lookups are cached per job; a job's keys are read
again when a record names a kid the cache lacks or the job had none, at most once per
:data:`REFRESH_S`, and the whole directory every ``key_reload_s`` (the service reloads).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Final

from trainguard.agent.keys import DEFAULT_KEYS_DIR, DaemonKeys, KeyStore, KeyStoreError
from trainguard.daemon.core import AuthRefusal, RawRecord
from trainguard.daemon.service._settings import SecurityConfig
from trainguard.schemas import (
    ClockTick,
    Event,
    HeartbeatBatch,
    JobRequest,
    Unauthenticated,
    verify_mac,
)

__all__ = ["REFRESH_S", "EventAuth", "load_keys"]

REFRESH_S: Final = 1.0
"""Least time between two reads of one job's event keys on a cache miss, seconds."""

_REFRESH_LIMIT: Final = 10_000
"""Most jobs whose last refresh time is remembered (a flood of job ids must not grow memory)."""

_REFUSALS: Final[Mapping[str, AuthRefusal]] = {
    "missing": "missing_mac",
    "unknown_kid": "unknown_kid",
    "bad_mac": "bad_mac",
    "bad_signature": "bad_mac",
}


def load_keys(config: SecurityConfig) -> DaemonKeys | None:
    """The daemon's keys as ``config`` says (module docstring), or ``None`` for none.

    Raises:
        KeyStoreError: ``keys_dir`` is set but holds no current signing and data key, a key
            file is malformed, or ``require_auth`` is set and there are no keys.
        InsecureKeyFile: a secret key file is readable by its group or other users.
    """
    store = KeyStore(config.keys_dir or DEFAULT_KEYS_DIR.expanduser())
    if config.keys_dir is not None or store.current("signing") is not None:
        return store.load_daemon_keys()
    if config.require_auth:
        raise KeyStoreError(
            f"[security] require_auth = true, but there are no keys: run trainguard keys "
            f"init, or set [security] keys_dir / --keys / TRAINGUARD_KEYS (looked in "
            f"{store.path})"
        )
    return None


class EventAuth:
    """Judges records of ``events`` by their MAC (module docstring's table).

    Args:
        keys: the daemon's keys, or ``None`` (every record is authentic: the service refuses
            ``require`` without keys).
        require: ``[security] require_auth``.
        rebuilding: accept the jobs' retired event keys too (records acted on before).
        clock: monotonic clock in seconds, for the refresh rate limit.
    """

    def __init__(
        self,
        keys: DaemonKeys | None,
        *,
        require: bool,
        rebuilding: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._keys = keys
        self._require = require
        self._rebuilding = rebuilding
        self._clock = clock
        self._refreshed: dict[str, float] = {}

    def refuse(
        self, record: RawRecord, message: Event | JobRequest | HeartbeatBatch | ClockTick
    ) -> tuple[AuthRefusal, str] | None:
        """``None`` when ``record`` is authentic, else ``(code, reason)``; ``key_error`` when
        the job's key files cannot be used (the reason names the file, never a key)."""
        keys = self._keys
        if keys is None:
            return None
        try:
            return self._judge(keys, record, message)
        except KeyStoreError as exc:
            return "key_error", f"event keys of job {message.job_id!r} cannot be used: {exc}"

    def _judge(
        self,
        keys: DaemonKeys,
        record: RawRecord,
        message: Event | JobRequest | HeartbeatBatch | ClockTick,
    ) -> tuple[AuthRefusal, str] | None:
        job = message.job_id
        accepted = self._accepted(keys, job)
        if not accepted and self._refresh(keys, job):
            accepted = self._accepted(keys, job)
        if not accepted:
            if self._require:
                return "unknown_job", f"job {job!r} has no event key (authentication required)"
            if message.auth is not None:
                return (
                    "unknown_job",
                    f"MAC under event key {message.auth.kid[:32]}, but job {job!r} has no "
                    "event key here",
                )
            return None
        value = record.value or b""
        try:
            verify_mac(value, accepted)
        except Unauthenticated as exc:
            if exc.code != "unknown_kid" or not self._refresh(keys, job):
                return _REFUSALS[exc.code], exc.reason
            try:
                verify_mac(value, self._accepted(keys, job))
            except Unauthenticated as again:
                return _REFUSALS[again.code], again.reason
        return None

    def mac_keys(self, record: RawRecord) -> Mapping[str, bytes] | None:
        """The event keys a MAC on ``record``'s raw bytes may verify under (the ones
        :meth:`refuse` verifies with: live keys, retired ones too when rebuilding), looked up
        by the record key (the job id: intake takes the record only if its ``job_id`` is the
        same); ``None`` without keys or record key, empty for a job without event keys, and
        ``None`` when its key files cannot be used (:meth:`refuse` says so). Never refreshes: a
        miss goes to :meth:`refuse`, which does.
        """
        keys = self._keys
        if keys is None or record.key is None:
            return None
        try:
            return self._accepted(keys, record.key)
        except KeyStoreError:
            return None

    def _accepted(self, keys: DaemonKeys, job: str) -> Mapping[str, bytes]:
        live = keys.event_keys(job) or {}
        if not self._rebuilding:
            return live
        return {**keys.retired_event_keys(job), **live}

    def _refresh(self, keys: DaemonKeys, job: str) -> bool:
        """Read ``job``'s keys again unless that was done less than :data:`REFRESH_S` ago;
        return whether it was done."""
        now = self._clock()
        if now - self._refreshed.get(job, -REFRESH_S) < REFRESH_S:
            return False
        if len(self._refreshed) >= _REFRESH_LIMIT:
            self._refreshed.clear()
        self._refreshed[job] = now
        keys.refresh(job)
        return True
