"""Checkpoint storage checked at start, not at the first checkpoint an hour later.

:func:`probe_storage` writes an empty object under the job's folder of a checkpoint URI and
deletes it again. A refusal (no such bucket, access denied, bad credentials, a bad bucket name)
is a :class:`~trainguard.agent.ConfigError` naming the URI and the storage's reason; storage
that does not answer (connection refused, timeouts, busy or failing servers) is tried again, a
few times with pauses, and then is :class:`~trainguard.agent.StorageUnavailable`, which a
restart may cure. Each attempt is bounded: the s3 client gets short timeouts and no retries of
its own, and for any storage the attempt is given up (its thread left to end on its own) after
:data:`ATTEMPT_TIMEOUT_S`. ``docs/checkpoints.md`` ("Object storage") states the rule.
"""

from __future__ import annotations

import errno
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from trainguard.agent._errors import ConfigError, StorageUnavailable

__all__ = ["ATTEMPT_TIMEOUT_S", "PAUSES_S", "is_transient", "probe_storage"]

ATTEMPT_TIMEOUT_S = 15.0
"""Seconds one attempt (a write and a delete) may take before it counts as unanswered."""

PAUSES_S: tuple[float, ...] = (1.0, 3.0)
"""Seconds between attempts; one more attempt than pauses (three, at most ~50 s in all)."""

_S3_OPTIONS: dict[str, Any] = {
    # A client of its own (not the cached one DCP uses later), with short timeouts and one
    # attempt per request: the attempts are counted and paced here.
    "skip_instance_cache": True,
    "config_kwargs": {
        "connect_timeout": 5,
        "read_timeout": 10,
        "retries": {"total_max_attempts": 1},
    },
}

_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EAGAIN,
        errno.EBUSY,  # s3fs: SlowDown, ServiceUnavailable, 503
        errno.EIO,  # s3fs: an error code it does not know
        getattr(errno, "EREMOTEIO", errno.EIO),  # s3fs: InternalError, 500
        errno.ETIMEDOUT,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
    }
)

_TRANSIENT_NAMES = frozenset({"ConnectionError", "HTTPClientError", "ClientConnectionError"})
"""Classes (by name, anywhere in an error's MRO) of botocore's and aiohttp's connection and
timeout errors, which do not derive from the builtin ``ConnectionError``; named, not imported:
the storage library is optional."""


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` says the storage did not answer (worth another attempt) rather than
    that it refused (connection and timeout errors, busy or failing servers)."""
    if isinstance(exc, TimeoutError | ConnectionError):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    return any(c.__name__ in _TRANSIENT_NAMES for c in type(exc).__mro__)


def probe_storage(
    uri: str,
    job_id: str,
    rank: int,
    *,
    timeout_s: float = ATTEMPT_TIMEOUT_S,
    pauses_s: Sequence[float] = PAUSES_S,
    sleep: Callable[[float], None] = time.sleep,
) -> str | None:
    """Write an empty object ``<uri>/<job_id>/.trainguard-probe-r<rank:05>-<random>`` and
    delete it.

    Args:
        uri: the checkpoint URI (``s3://bucket/prefix``, any fsspec URL).
        job_id: the job, whose folder the object goes into.
        rank: the caller's rank, in the object's name (every rank may probe at once).
        timeout_s: seconds an attempt may take.
        pauses_s: seconds to wait before each further attempt.
        sleep: waits that many seconds (tests pass their own).

    Returns:
        ``None``; or, when the write worked but the delete did not, the delete's error as
        text (the object stays: the caller logs it, checkpoints can be written).

    Raises:
        ConfigError: the storage refused the write (its reason and the URI in the message).
        StorageUnavailable: no attempt was answered (the last error in the message).
    """
    where = f"{uri.rstrip('/')}/{job_id}/.trainguard-probe-r{rank:05d}-{uuid.uuid4().hex[:12]}"
    began = time.monotonic()
    last: BaseException | None = None
    for attempt in range(len(pauses_s) + 1):
        if attempt:
            sleep(pauses_s[attempt - 1])
        try:
            return _bounded(lambda: _write_and_delete(where), timeout_s)
        except Exception as exc:
            if not is_transient(exc):
                raise ConfigError(
                    f"checkpoint_uri {uri!r}: the storage refused a test write of {where}: "
                    f"{_text(exc)}"
                ) from exc
            last = exc
    raise StorageUnavailable(
        f"checkpoint_uri {uri!r}: the storage did not answer a test write in "
        f"{len(pauses_s) + 1} attempts over {time.monotonic() - began:.0f} s: "
        f"{_text(last)} (an outage, or a wrong endpoint such as AWS_ENDPOINT_URL)"
    ) from last


def _write_and_delete(where: str) -> str | None:
    """Write the empty object ``where``, delete it; the delete's error as text, or ``None``."""
    import fsspec

    s3 = urlsplit(where).scheme in ("s3", "s3a")
    fs, path = fsspec.core.url_to_fs(where, **(_S3_OPTIONS if s3 else {}))
    fs.pipe_file(path, b"")
    try:
        fs.rm_file(path)
    except Exception as exc:
        return _text(exc)
    return None


def _bounded(call: Callable[[], str | None], timeout_s: float) -> str | None:
    """``call()`` on a thread of its own, waited for at most ``timeout_s`` seconds (then left
    to end by itself: a daemon thread, which never holds up the interpreter's exit).

    Raises:
        TimeoutError: ``call`` had not returned within ``timeout_s``.
        Exception: what ``call`` raised.
    """
    returned: list[str | None] = []
    raised: list[Exception] = []

    def run() -> None:
        try:
            returned.append(call())
        except Exception as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, name="trainguard-storage-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if raised:
        raise raised[0]
    if not returned:
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    return returned[0]


def _text(exc: BaseException | None) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
