"""Importing ``trainguard.agent`` leaves torch unloaded, as the package docstring promises (its
exports are checked with every other façade in tests/meta)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_agent_does_not_import_torch():
    probe = "import sys, trainguard.agent; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "False"
