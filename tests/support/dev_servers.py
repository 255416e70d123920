"""What a test does when a development server it needs (Kafka broker, S3 server) cannot be had."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def unavailable(what: str, reason: str) -> NoReturn:
    """Skip the requesting test, or fail it under ``CI=true``; ``what`` names the server."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} unavailable (CI=true, so not skipping): {reason}", pytrace=False)
    pytest.skip(f"{what} unavailable: {reason}")
