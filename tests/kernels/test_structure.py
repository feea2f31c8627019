"""The kernels package's shape: its modules import one another without a cycle, every fast path implements the one
backend protocol, and no module outgrows a file."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from quantwatch.kernels import api, backends, compiled, native, triton_path

PACKAGE = Path(api.__file__).resolve().parent
MAX_MODULE_LINES = 600


def kernel_imports() -> dict[str, set[str]]:
    """Each module of the package (by name) and the package's modules it imports anywhere in it (lazy imports too)."""
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name in modules:
        tree = ast.parse((PACKAGE / f"{name}.py").read_text(encoding="utf-8"))
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level == 1 or base.startswith("quantwatch.kernels"):
                    head = base.removeprefix("quantwatch.kernels").lstrip(".").split(".")[0]
                    if head:  # `from .a import b`: module a
                        targets.add(head)
                    else:  # `from . import a, b`: modules a and b
                        targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("quantwatch.kernels."):
                        targets.add(alias.name.split(".")[2])
        graph[name] = (targets & modules) - {name, "__init__"}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as the list of modules along it (first == last), or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        state[node] = "done"
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_the_kernel_modules_import_each_other_without_a_cycle() -> None:
    graph = kernel_imports()
    assert {"api", "stats", "native", "compiled"} <= set(graph)
    assert "partial_sums" in graph["native"]  # the parser sees relative imports
    assert find_cycle(graph) is None, find_cycle(graph)


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_outgrows_a_file() -> None:
    lengths = {path.name: len(path.read_text(encoding="utf-8").splitlines()) for path in PACKAGE.glob("*.py")}
    assert max(lengths.values()) <= MAX_MODULE_LINES, lengths


@pytest.mark.parametrize("path", [native, compiled, triton_path], ids=lambda module: module.__name__.split(".")[-1])
def test_each_fast_path_implements_the_backend_protocol(path: backends.FastPath) -> None:
    assert isinstance(path, backends.FastPath)
    assert path in [row.path for row in api.AUTO_PREFERENCE]
    for member in ("unsupported_reason", "available", "prepare", "quantize"):
        expected = inspect.signature(getattr(backends.FastPath, member))
        parameters = list(expected.parameters.values())[1:]  # without self
        got = inspect.signature(getattr(path, member))
        # Names in order (mypy checks the types: api's table holds the modules as `FastPath`s).
        assert list(got.parameters) == [p.name for p in parameters], member


def test_every_backend_but_the_reference_has_one_row_in_the_table() -> None:
    names = [row.path.NAME for row in api.AUTO_PREFERENCE]
    assert sorted(name.value for name in names) == ["compiled", "native", "triton"]
