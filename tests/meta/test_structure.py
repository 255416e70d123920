"""Structure the design relies on: the pure core does no I/O, each package's façade exports
exactly what it documents, and ``trainguard`` stays a namespace over three source roots."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PURE_MODULES = [
    "daemon/src/trainguard/daemon/_machine.py",
    "daemon/src/trainguard/daemon/_state.py",
    "daemon/src/trainguard/daemon/_decisions.py",
    "daemon/src/trainguard/daemon/_inputs.py",
    "daemon/src/trainguard/daemon/_config.py",
    "daemon/src/trainguard/daemon/_commit.py",
    "daemon/src/trainguard/daemon/_evidence.py",
    "daemon/src/trainguard/daemon/_recovery.py",
    "daemon/src/trainguard/daemon/_outage.py",
    "daemon/src/trainguard/daemon/_stop.py",
    "daemon/src/trainguard/daemon/_stall.py",
    "daemon/src/trainguard/daemon/_divergence.py",
    "daemon/src/trainguard/daemon/_trend.py",
    "daemon/src/trainguard/daemon/_window.py",
    "daemon/src/trainguard/daemon/_audit.py",
    "daemon/src/trainguard/daemon/_intake.py",
    "daemon/src/trainguard/daemon/_replay.py",
    "daemon/src/trainguard/daemon/_state_codec.py",
    "daemon/src/trainguard/daemon/_catalog.py",
    "daemon/src/trainguard/daemon/_report_record.py",
    "agent/src/trainguard/agent/_cursor.py",
    "agent/src/trainguard/agent/_errors.py",
]
"""The state machine, its detectors and the cursor arithmetic (ARCHITECTURE.md section 4),
the replay that folds a recorded log through them (with its intake and audit format), and the
catalog and report digests built from the same records."""

IO_MODULES = {
    "asyncio", "anyio", "socket", "sqlite3", "aiokafka", "os", "io", "time", "random",
    "logging", "structlog", "subprocess", "threading", "multiprocessing", "pathlib", "shutil",
    "tempfile", "urllib", "http", "signal", "select", "selectors", "datetime", "uuid",
    "torch", "numpy", "trainguard.agent.bus",
}  # fmt: skip


PURE_PACKAGES = ("trainguard.schemas",)
"""Pure dependencies the core may import (the wire contract: typed messages and the codec)."""


def _module_name(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[parts.index("trainguard") :])


def _imports(module: str) -> set[str]:
    """Absolute names of the modules ``module`` imports (relative imports resolved)."""
    path = REPO / next(p for p in PURE_MODULES if _module_name(p) == module)
    package = module.rsplit(".", 1)[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level == 1:
            names.add(f"{package}.{node.module}" if node.module else package)
    return names


@pytest.mark.parametrize("path", PURE_MODULES)
def test_pure_core_imports_no_io(path: str) -> None:
    """Neither the module nor any trainguard module it imports touches I/O modules: every
    trainguard import of a pure module is another pure module or the wire contract."""
    pure = {_module_name(p) for p in PURE_MODULES}
    imported = _imports(_module_name(path))
    io = {n for n in imported if any(n == m or n.startswith(m + ".") for m in IO_MODULES)}
    assert not io, f"{path} imports I/O modules {sorted(io)}"
    impure = {
        n
        for n in imported
        if n.startswith("trainguard.")
        and n not in pure
        and not any(n == p or n.startswith(p + ".") for p in PURE_PACKAGES)
    }
    assert not impure, f"{path} imports trainguard modules outside the pure core: {sorted(impure)}"


@pytest.mark.parametrize(
    "package",
    ["trainguard.schemas", "trainguard.agent", "trainguard.agent.bus", "trainguard.daemon"],
)
def test_facade_exports_exactly_its_public_names(package: str) -> None:
    module = importlib.import_module(package)
    exported = set(module.__all__)
    assert len(exported) == len(module.__all__), "duplicates in __all__"
    missing = {name for name in exported if not hasattr(module, name)}
    assert not missing, f"{package}.__all__ names missing attributes: {sorted(missing)}"
    public = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, type(sys))  # submodules
        and name not in {"annotations", "TYPE_CHECKING", "Any"}
    }
    assert public <= exported, f"{package} has public names outside __all__: {public - exported}"


def test_trainguard_is_a_namespace_over_the_three_roots() -> None:
    for root in ("schemas", "agent", "daemon"):
        assert not (REPO / root / "src" / "trainguard" / "__init__.py").exists()
    import trainguard

    assert getattr(trainguard, "__file__", None) is None
