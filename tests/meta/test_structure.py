"""The layout the design relies on, checked by folder (``docs/architecture.md``).

* ``trainguard`` is a namespace over four source roots, each holding one part of it.
* A *part* is a package with a façade (``__init__`` with ``__all__``): ``trainguard.schemas``,
  ``trainguard.agent`` (with its folders ``checkpoint``, ``data``, ``faults``, ``keys``,
  ``supervisor``), ``trainguard.agent.bus``, and each sub-package of ``trainguard.daemon``
  (``core``, ``service``, ``forensics``, ``catalog``, ``admin``, ``demo``, ``cli``). A module
  imports another part only through that part's public names, never its ``_private`` modules.
* Parts depend in one direction (:data:`MAY_IMPORT`): the pure core imports only the wire
  contract, the wire contract nothing of the agent or the daemon, the agent nothing of the
  daemon.
* The pure core (everything under ``daemon/core/``, and the agent's cursor arithmetic) imports
  no module that does I/O, reads a clock or draws random numbers (ARCHITECTURE.md section 4).
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = [
    REPO / "schemas" / "src",
    REPO / "agent" / "src",
    REPO / "daemon" / "src",
    REPO / "integrations" / "src",
]

MAY_IMPORT: dict[str, frozenset[str]] = {
    "trainguard.schemas": frozenset(),
    "trainguard.agent.bus": frozenset({"trainguard.schemas"}),
    "trainguard.agent": frozenset({"trainguard.schemas", "trainguard.agent.bus"}),
    "trainguard.daemon": frozenset({"trainguard.daemon.core", "trainguard.daemon.service"}),
    "trainguard.daemon.core": frozenset({"trainguard.schemas"}),
    "trainguard.daemon.service": frozenset(
        {
            "trainguard.schemas",
            "trainguard.agent",
            "trainguard.agent.bus",
            "trainguard.daemon.core",
            # the daemon's own retention prunes as ``trainguard checkpoints prune`` does
            "trainguard.daemon.catalog",
        }
    ),
    "trainguard.daemon.forensics": frozenset(
        {"trainguard.schemas", "trainguard.agent.bus", "trainguard.daemon.core"}
    ),
    "trainguard.daemon.catalog": frozenset(
        {
            "trainguard.schemas",
            "trainguard.daemon.core",
            "trainguard.daemon.forensics",
            # pruning reads the manifests topic and lists and deletes the agent's step folders
            "trainguard.agent",
            "trainguard.agent.bus",
        }
    ),
    "trainguard.daemon.admin": frozenset({"trainguard.agent"}),
    "trainguard.daemon.demo": frozenset(
        {"trainguard.schemas", "trainguard.agent", "trainguard.agent.bus"}
    ),
    "trainguard.daemon.sim": frozenset(
        {
            "trainguard.schemas",
            "trainguard.agent",
            "trainguard.agent.bus",
            "trainguard.daemon.core",
            # it runs the real daemon process and compares with the report's Young-Daly model
            "trainguard.daemon.service",
            "trainguard.daemon.forensics",
            # the run's keys, as trainguard keys init makes them
            "trainguard.daemon.admin",
        }
    ),
    # framework callbacks drive the agent as a hand-written loop does, through its public names
    "trainguard.integrations": frozenset({"trainguard.schemas", "trainguard.agent"}),
    "trainguard.daemon.cli": frozenset(
        {
            "trainguard.schemas",
            "trainguard.agent",
            "trainguard.agent.bus",
            "trainguard.daemon.core",
            "trainguard.daemon.service",
            "trainguard.daemon.forensics",
            "trainguard.daemon.catalog",
            "trainguard.daemon.admin",
            "trainguard.daemon.demo",
            "trainguard.daemon.sim",
        }
    ),
}
"""Each part -> the other parts its modules may import. A new part must be added here: where it
sits in the layering is a decision, not a default."""

PURE = (
    "daemon/src/trainguard/daemon/core/",
    "agent/src/trainguard/agent/data/_cursor.py",
    "daemon/src/trainguard/daemon/sim/_model.py",
)
"""The pure core, by folder: the state machine, its rules and detectors, the cursor
arithmetic an agent resumes its data position with, and the simulator's job model."""

IO_MODULES = {
    "asyncio", "anyio", "socket", "sqlite3", "aiokafka", "os", "io", "time", "random",
    "logging", "structlog", "subprocess", "threading", "multiprocessing", "pathlib", "shutil",
    "tempfile", "urllib", "http", "signal", "select", "selectors", "datetime", "uuid",
    "torch", "numpy", "importlib",
}  # fmt: skip


def _modules() -> list[tuple[str, Path]]:
    """Every source module as (dotted name, path), packages by their ``__init__``."""
    found = []
    for root in ROOTS:
        for path in sorted(root.rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            found.append((name.removesuffix(".__init__"), path))
    return found


MODULES = _modules()


def part_of(module: str) -> str:
    """The part a dotted module name belongs to (its public package prefix, cut as above)."""
    public = []
    for component in module.split("."):
        if component.startswith("_"):
            break
        public.append(component)
    if public[:2] == ["trainguard", "daemon"] and len(public) > 2:
        return ".".join(public[:3])
    if public[:3] == ["trainguard", "agent", "bus"]:
        return "trainguard.agent.bus"
    return ".".join(public[:2])


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """``(absolute imported module, line)`` for every import of ``module``'s source, relative
    imports resolved; ``from package import _module`` counts as an import of that module."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.append((target, node.lineno))
            found += [(f"{target}.{a.name}", node.lineno) for a in node.names if a.name[0] == "_"]
    return found


def _trainguard_imports(module: str, path: Path) -> list[tuple[str, int]]:
    return [(n, line) for n, line in _imports(module, path) if n.startswith("trainguard.")]


@pytest.mark.parametrize(("module", "path"), MODULES, ids=[m for m, _ in MODULES])
def test_parts_meet_only_through_public_names(module: str, path: Path) -> None:
    mine = part_of(module)
    crossing = [
        f"line {line}: {name}"
        for name, line in _trainguard_imports(module, path)
        if part_of(name) != mine and any(c.startswith("_") for c in name.split("."))
    ]
    assert not crossing, f"{module} imports private modules of other parts: {crossing}"


@pytest.mark.parametrize(("module", "path"), MODULES, ids=[m for m, _ in MODULES])
def test_parts_depend_in_one_direction(module: str, path: Path) -> None:
    mine = part_of(module)
    assert mine in MAY_IMPORT, f"{mine} is a new part: say in MAY_IMPORT what it may import"
    against = [
        f"line {line}: {name}"
        for name, line in _trainguard_imports(module, path)
        if part_of(name) not in MAY_IMPORT[mine] | {mine}
    ]
    assert not against, (
        f"{module} ({mine}) imports parts outside {sorted(MAY_IMPORT[mine])}: {against}"
    )


PURE_MODULES = [(m, p) for m, p in MODULES if str(p.relative_to(REPO)).startswith(PURE)]


_PURE_NAMES = {m for m, p in PURE_MODULES}


def test_the_pure_core_is_where_the_layout_says() -> None:
    names = {m for m, _ in PURE_MODULES}
    assert {"trainguard.daemon.core._machine", "trainguard.agent.data._cursor"} <= names
    assert "trainguard.daemon.core.detectors._stall" in names


@pytest.mark.parametrize(("module", "path"), PURE_MODULES, ids=[m for m, _ in PURE_MODULES])
def test_the_pure_core_does_no_io(module: str, path: Path) -> None:
    """No import of a module that does I/O, reads a clock or draws random numbers; trainguard
    imports stay inside the pure core's own part or the wire contract (checked above)."""
    io = [
        f"line {line}: {name}"
        for name, line in _imports(module, path)
        if any(name == m or name.startswith(m + ".") for m in IO_MODULES)
    ]
    assert not io, f"{module} imports I/O modules: {io}"
    outside = [
        name
        for name, _ in _trainguard_imports(module, path)
        if part_of(name) not in {part_of(module), "trainguard.schemas"}
        or (name.startswith("trainguard.daemon.sim.") and name not in _PURE_NAMES)
    ]
    assert not outside, f"{module} imports beyond the pure core: {outside}"


def _distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions)."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        previous, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (ca != cb))
    return row[-1]


def test_no_two_module_names_of_a_folder_differ_by_one_letter() -> None:
    by_folder: dict[Path, list[str]] = {}
    for _, path in MODULES:
        by_folder.setdefault(path.parent, []).append(path.stem)
    close = [
        (str(folder.relative_to(REPO)), a, b)
        for folder, stems in by_folder.items()
        for i, a in enumerate(stems)
        for b in stems[i + 1 :]
        if _distance(a, b) <= 1
    ]
    assert not close, f"module names one letter apart: {close}"


FACADES = sorted({m for m, p in MODULES if p.name == "__init__.py" and m != "trainguard"})


@pytest.mark.parametrize("package", FACADES)
def test_every_package_says_what_it_holds(package: str) -> None:
    module = importlib.import_module(package)
    assert (module.__doc__ or "").strip(), f"{package} has no docstring"


@pytest.mark.parametrize(
    "package", [p for p in FACADES if hasattr(importlib.import_module(p), "__all__")]
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


def test_every_part_has_a_facade() -> None:
    parts = {part_of(m) for m, _ in MODULES} - {"trainguard"}
    without = {p for p in parts if not hasattr(importlib.import_module(p), "__all__")}
    assert not without, f"parts without __all__: {sorted(without)}"


def test_trainguard_is_a_namespace_over_the_four_roots() -> None:
    for root in ("schemas", "agent", "daemon", "integrations"):
        assert not (REPO / root / "src" / "trainguard" / "__init__.py").exists()
    import trainguard

    assert getattr(trainguard, "__file__", None) is None
