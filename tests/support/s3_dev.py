"""A development S3 server for tests: S3Proxy started by the project's own ``deploy/s3/s3-dev``
(fetched from Maven Central), waited for until it serves requests, stopped afterwards.

Used by the session server of ``tests/conftest.py`` (fixtures ``s3_endpoint``, ``s3_env``,
``s3_bucket``; :func:`s3_environment` is ``s3_env`` for other scopes). A server that cannot
start skips the test that needs it, except under ``CI=true``, where it fails it: in CI an S3
test never silently skips.

Clients reach the server through the standard AWS variables (:meth:`S3Endpoint.environ`), which
botocore, and so s3fs and ``fsspec.filesystem("s3")``, read. S3Proxy 2.6.0 answers 501 to the
``x-amz-checksum-*`` headers that botocore 1.36+ sends by default ("A header you provided implies
functionality that is not implemented") and verifies no checksum, so the variables set
botocore's checksums to ``when_required``. (DeleteObjects carries one even then; s3-dev starts
S3Proxy with ``s3proxy.ignore-unknown-headers=true`` for it; a ``TRAINGUARD_S3`` server needs that
too.)
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support.dev_servers import unavailable

if TYPE_CHECKING:
    from s3fs import S3FileSystem

S3_DEV = Path(__file__).resolve().parents[2] / "deploy" / "s3" / "s3-dev"
# The fixed dev credentials of deploy/s3/s3-dev (ACCESS_KEY, SECRET_KEY, REGION there).
DEV_ACCESS_KEY = "trainguard-dev"
DEV_SECRET_KEY = "trainguard-dev-secret"
DEV_REGION = "us-east-1"
# Seconds for s3-dev to see S3Proxy serve once its JVM runs (measured: 1.9-2.6 s here).
SERVER_START_TIMEOUT_S = 60.0
# Seconds for the whole `s3-dev start`, a cold Maven fetch included (measured: about 17 s).
S3_DEV_TIMEOUT_S = 600.0
# Seconds for a request to succeed against the started or given server.
SERVER_READY_TIMEOUT_S = 30.0
# Seconds for Jetty to stop on SIGTERM before s3-dev sends SIGKILL (measured: under 1 s).
S3_DEV_STOP_TIMEOUT_S = 30.0

CLEARED_VARIABLES = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL_S3",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
)
"""AWS variables of the caller's environment that would override or break
:meth:`S3Endpoint.environ` (another profile, a session token S3Proxy does not know, an endpoint
for S3 alone); :func:`s3_environment` and :meth:`S3Endpoint.subprocess_env` drop them."""


@dataclass(frozen=True)
class S3Endpoint:
    """Where the test S3 server is and how to sign in.

    Attributes:
        endpoint_url: ``http://host:port``, no trailing slash.
        key: access key id.
        secret: secret access key.
        region: region of the V4 signature's scope (S3Proxy accepts any).
    """

    endpoint_url: str
    key: str = DEV_ACCESS_KEY
    secret: str = DEV_SECRET_KEY
    region: str = DEV_REGION

    def environ(self) -> dict[str, str]:
        """The AWS variables that point botocore (s3fs, ``fsspec.filesystem("s3")``) at this
        server: credentials, endpoint, region, checksums only when an operation requires them,
        and no shared config or credentials file (``os.devnull``), so a developer's
        ``~/.aws`` cannot change what the tests talk to."""
        return {
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
            "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    def subprocess_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: ``os.environ``) without :data:`CLEARED_VARIABLES`, plus
        :meth:`environ`: the ``env=`` of a subprocess that should use this server."""
        source = os.environ if base is None else base
        kept = {k: v for k, v in source.items() if k not in CLEARED_VARIABLES}
        return {**kept, **self.environ()}

    @functools.cached_property
    def filesystem(self) -> S3FileSystem:
        """An s3fs filesystem on this server, configured by arguments, not the environment
        (one attempt per request, 5 s to connect, 30 s to read), made on first use and kept:
        a new one costs about 0.4 s. Outside s3fs's instance cache, so :func:`s3_environment`
        leaves it alone."""
        import s3fs  # here: importing s3fs costs about 0.5 s, and most sessions need no S3

        return s3fs.S3FileSystem(
            key=self.key,
            secret=self.secret,
            endpoint_url=self.endpoint_url,
            client_kwargs={"region_name": self.region},
            config_kwargs={
                "request_checksum_calculation": "when_required",
                "response_checksum_validation": "when_required",
                "connect_timeout": 5,
                "read_timeout": 30,
                "retries": {"max_attempts": 1},
            },
            skip_instance_cache=True,
        )

    def create_bucket(self) -> str:
        """Create a bucket with a fresh name such as ``"t-1a2b3c4d5e6f"`` and return the name.

        It goes through CreateBucket itself: ``S3FileSystem.mkdir`` cannot create a bucket on
        S3Proxy 2.6.0, which answers GetBucketLocation with 200 for a bucket that does not
        exist, so s3fs takes every bucket for existing and raises ``FileExistsError``.

        Raises:
            OSError: the server refused (s3fs's translation of the S3 error).
            botocore.exceptions.BotoCoreError: the server could not be reached.
        """
        name = f"t-{uuid.uuid4().hex[:12]}"
        self.filesystem.call_s3("create_bucket", Bucket=name)
        return name


@contextmanager
def s3_environment(endpoint: S3Endpoint) -> Iterator[None]:
    """For the block, ``os.environ`` holds :meth:`S3Endpoint.environ` and none of
    :data:`CLEARED_VARIABLES` (restored afterwards), so ``fsspec.filesystem("s3")`` and any
    botocore client use ``endpoint``. s3fs's cached instances are dropped on entry and exit: a
    cached one keeps the environment it was made under."""
    import s3fs  # see S3Endpoint.filesystem

    with pytest.MonkeyPatch.context() as patch:
        for name in CLEARED_VARIABLES:
            patch.delenv(name, raising=False)
        for name, value in endpoint.environ().items():
            patch.setenv(name, value)
        s3fs.S3FileSystem.clear_instance_cache()
        try:
            yield
        finally:
            s3fs.S3FileSystem.clear_instance_cache()


def wait_for_server(endpoint: S3Endpoint, timeout: float) -> None:
    """Retry a signed ListBuckets on ``endpoint`` every 0.5 s until it succeeds.

    Args:
        endpoint: the server and its credentials.
        timeout: seconds.

    Raises:
        TimeoutError: no successful answer within ``timeout`` seconds; names the last error
            (``PermissionError: Forbidden`` for wrong credentials).
    """
    from botocore.exceptions import BotoCoreError  # with s3fs (see S3Endpoint.filesystem)

    deadline = time.monotonic() + timeout
    while True:
        try:
            endpoint.filesystem.call_s3("list_buckets")
            return
        except (OSError, BotoCoreError) as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{endpoint.endpoint_url} did not answer in {timeout:g} s: {exc!r}"
                ) from exc
        time.sleep(0.5)


def s3_dev(*args: str | Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``s3-dev ARGS`` with this interpreter (the script needs only the standard library;
    no dependence on a ``python3`` on PATH), at most ``timeout`` seconds.

    Raises:
        subprocess.TimeoutExpired: it ran longer (the script is killed).
    """
    command = [sys.executable, str(S3_DEV), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


@contextmanager
def dev_server(run_dir: Path) -> Iterator[S3Endpoint]:
    """An S3Proxy started by ``s3-dev start --port 0 --dir RUN_DIR``, yielding its
    :class:`S3Endpoint` once a signed ListBuckets succeeds, and stopped on exit (also after a
    failed start, which may leave a JVM behind). Its log is ``RUN_DIR/s3proxy.log``. A start
    that fails or times out: :func:`~tests.support.dev_servers.unavailable`."""
    try:
        try:
            started = s3_dev(
                "start",
                "--port",
                "0",
                "--dir",
                run_dir,
                "--timeout",
                str(SERVER_START_TIMEOUT_S),
                timeout=S3_DEV_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            unavailable("S3 server", f"s3-dev start took more than {S3_DEV_TIMEOUT_S:g} s")
        if started.returncode != 0:
            unavailable(
                "S3 server", started.stderr.strip() or f"s3-dev start exited {started.returncode}"
            )
        endpoint = S3Endpoint(started.stdout.strip())
        try:
            wait_for_server(endpoint, SERVER_READY_TIMEOUT_S)
        except TimeoutError as exc:
            unavailable("S3 server", f"{exc} (log: {run_dir / 's3proxy.log'})")
        yield endpoint
    finally:
        stop_s = str(S3_DEV_STOP_TIMEOUT_S)
        s3_dev("stop", "--dir", run_dir, "--timeout", stop_s, timeout=S3_DEV_STOP_TIMEOUT_S + 30)
