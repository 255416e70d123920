"""The unit tests: pure, fast and process-free (no subprocess, no bus, no network, no torch
training; files in ``tmp_path`` only where a pure function's file format is the subject).

Every test collected under this folder is marked ``unit``, so ``pytest tests/unit`` and
``pytest -m unit`` select the same tests."""

from __future__ import annotations

from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``unit`` the items under this folder (the hook sees every item of the session)."""
    for item in items:
        if item.path.is_relative_to(UNIT):
            item.add_marker(pytest.mark.unit)
