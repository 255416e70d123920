"""Property tests of the pure core: as pure as tests/unit (no subprocess, bus, network or
training), but each one checks a rule over hundreds of generated inputs (jobs folded through
the state machine, states round-tripped through the state codec, the cursor arithmetic over
dataset sizes, seeds and world sizes), so the folder takes a minute or two. Every test here is
marked ``property``, so ``pytest -m property`` selects them too."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``property`` the items under this folder (the hook sees every item of the session)."""
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.property)
