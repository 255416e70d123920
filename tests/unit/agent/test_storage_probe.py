"""The check of checkpoint storage at start (``trainguard.agent.checkpoint._probe``): a refusal
is a ConfigError naming the URI and the storage's reason at once; storage that does not answer
is tried again with pauses, then is StorageUnavailable; the test object is deleted.

The storage here is a scripted fsspec filesystem (no network); the real S3 server's answers are
tested in ``tests/service/agent/test_dcp_checkpoints.py``."""

from __future__ import annotations

import errno
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import fsspec
import pytest
from fsspec.spec import AbstractFileSystem

from trainguard.agent import ConfigError, StorageUnavailable
from trainguard.agent.checkpoint._probe import is_transient, probe_storage


class Scripted(AbstractFileSystem):  # type: ignore[misc]  # fsspec is untyped
    """Storage whose writes fail as scripted (``failures``, in order), then work."""

    protocol = "scripted"
    failures: ClassVar[list[BaseException]] = []
    stored: ClassVar[dict[str, bytes]] = {}
    hang = threading.Event()  # set: a write hangs until `released`
    released = threading.Event()
    refuse_delete: ClassVar[bool] = False

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> None:
        if self.hang.is_set():
            self.released.wait(10)  # until the test is over: the write never happens
            return
        if self.failures:
            raise self.failures.pop(0)
        self.stored[path] = value

    def rm_file(self, path: str) -> None:
        if self.refuse_delete:
            raise PermissionError("Access Denied")
        del self.stored[path]


@pytest.fixture(autouse=True)
def scripted() -> Iterator[type[Scripted]]:
    fsspec.register_implementation("scripted", Scripted, clobber=True)
    Scripted.failures.clear()
    Scripted.stored.clear()
    Scripted.refuse_delete = False
    Scripted.hang.clear()
    Scripted.released.clear()
    yield Scripted
    Scripted.released.set()


class Botocore:
    """Errors shaped like botocore's: a ``ConnectionError`` that is not the builtin one."""

    class ConnectionError(Exception):
        pass

    class EndpointConnectionError(ConnectionError):
        pass


EndpointConnectionError = Botocore.EndpointConnectionError


def test_a_refusal_is_a_config_error_naming_the_uri_and_the_reason_at_once() -> None:
    Scripted.failures.append(FileNotFoundError("The specified bucket does not exist"))
    pauses: list[float] = []
    with pytest.raises(ConfigError) as raised:
        probe_storage("scripted://no-such-bucket/ckpt", "job", 3, sleep=pauses.append)
    message = str(raised.value)
    assert message.startswith(
        "checkpoint_uri 'scripted://no-such-bucket/ckpt': the storage refused a test write of "
        "scripted://no-such-bucket/ckpt/job/.trainguard-probe-r00003-"
    )
    assert message.endswith(": FileNotFoundError: The specified bucket does not exist")
    assert pauses == []  # a refusal is not tried again


def test_storage_that_does_not_answer_is_tried_again_then_works() -> None:
    Scripted.failures += [ConnectionRefusedError("refused"), OSError(errno.EBUSY, "SlowDown")]
    pauses: list[float] = []
    assert probe_storage("scripted://bucket/ckpt/", "job", 0, sleep=pauses.append) is None
    assert pauses == [1.0, 3.0]
    assert Scripted.stored == {}  # the test object was deleted


def test_storage_that_never_answers_is_unavailable_not_a_config_error() -> None:
    Scripted.failures += [EndpointConnectionError("Could not connect to the endpoint URL")] * 3
    with pytest.raises(StorageUnavailable) as raised:
        probe_storage("scripted://bucket/ckpt", "job", 0, sleep=lambda _: None)
    assert not isinstance(raised.value, ConfigError)
    message = str(raised.value)
    assert message.startswith(
        "checkpoint_uri 'scripted://bucket/ckpt': the storage did not answer a test write in "
        "3 attempts over "
    )
    assert "EndpointConnectionError: Could not connect to the endpoint URL" in message


def test_an_attempt_is_bounded_in_time() -> None:
    Scripted.hang.set()
    with pytest.raises(StorageUnavailable, match=r"TimeoutError: no answer within 0\.05 s"):
        probe_storage("scripted://bucket/ckpt", "job", 0, timeout_s=0.05, pauses_s=())


def test_a_refused_delete_is_returned_not_raised() -> None:
    Scripted.refuse_delete = True
    assert probe_storage("scripted://bucket/ckpt", "job", 0) == "PermissionError: Access Denied"
    [left] = Scripted.stored
    assert left.startswith("bucket/ckpt/job/.trainguard-probe-r00000-")


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (PermissionError("Access Denied"), False),
        (FileNotFoundError("The specified bucket does not exist"), False),
        (OSError(errno.EINVAL, "InvalidBucketName"), False),
        (ValueError("bad URL"), False),
        (OSError(errno.EBUSY, "SlowDown"), True),
        (OSError(errno.EIO, "an unknown error code"), True),
        (ConnectionRefusedError("refused"), True),
        (TimeoutError("no answer"), True),
        (EndpointConnectionError("no route"), True),
    ],
)
def test_what_counts_as_no_answer(error: BaseException, transient: bool) -> None:
    assert is_transient(error) is transient
