"""The public façade of ``trainguard.agent``: every exported name resolves, and importing it
leaves torch unloaded, as the package docstring promises."""

from __future__ import annotations

import subprocess
import sys

import trainguard.agent


def test_every_exported_name_resolves():
    missing = [name for name in trainguard.agent.__all__ if not hasattr(trainguard.agent, name)]
    assert missing == []
    assert sorted(trainguard.agent.__all__) == sorted(set(trainguard.agent.__all__))


def test_importing_the_agent_does_not_import_torch():
    probe = "import sys, trainguard.agent; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "False"
