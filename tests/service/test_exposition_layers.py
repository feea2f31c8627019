"""The exposition package's modules import only downward, and only its data-access module speaks SQL."""

from __future__ import annotations

import ast
from pathlib import Path

import quantwatch.service.exposition as package

# Bottom to top: a module may import only the modules before it (as prometheus_client: metric → registry → exposition).
LAYERS = (
    "naming",
    "cache",
    "renderer",
    "writer",
    "alert_states",
    "ingest_metrics",
    "collector",
    "queries",
    "restore",
    "observer",
    "middleware",
    "route",
)
PREFIX = "quantwatch.service.exposition."


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports by absolute name."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_every_module_of_the_package_has_a_layer() -> None:
    modules = {path.stem for path in Path(package.__file__).parent.glob("*.py")} - {"__init__"}
    assert modules == set(LAYERS)


def test_modules_import_only_the_layers_below_them() -> None:
    root = Path(package.__file__).parent
    for depth, name in enumerate(LAYERS):
        inside = {module.removeprefix(PREFIX) for module in imports(root / f"{name}.py") if module.startswith(PREFIX)}
        above = inside - set(LAYERS[:depth])
        assert not above, f"{name} imports {sorted(above)}, which are not below it"


def test_only_the_queries_module_builds_sql() -> None:
    root = Path(package.__file__).parent
    for name in LAYERS:
        sql = {module for module in imports(root / f"{name}.py") if module == "sqlalchemy"}
        assert not sql or name == "queries", f"{name} imports sqlalchemy"
