"""The distribution's promises about its layout."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path


def test_service_imports_without_torch() -> None:
    # The collector is installed without the `agent` extra: importing it must never pull torch in.
    code = textwrap.dedent(
        """
        import sys
        class _NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked in this test")
                return None
        sys.meta_path.insert(0, _NoTorch())
        import quantwatch.service, quantwatch.cli
        import pkgutil, importlib
        for mod in pkgutil.walk_packages(quantwatch.service.__path__, "quantwatch.service."):
            importlib.import_module(mod.name)
        print("torch" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


_BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError("No module named 'torch'", name="torch")
        return None
sys.meta_path.insert(0, _NoTorch())
"""


def test_without_torch_the_agent_and_the_demo_say_what_to_install() -> None:
    agent = subprocess.run(
        [sys.executable, "-c", _BLOCK_TORCH + "import quantwatch.agent"], capture_output=True, text=True, check=False
    )
    assert agent.returncode == 1
    assert agent.stderr.strip().splitlines()[-1] == (
        "ImportError: quantwatch.agent needs PyTorch: pip install 'quantwatch[agent]'"
    )
    demo = subprocess.run(
        [
            sys.executable,
            "-c",
            _BLOCK_TORCH + "import sys; from quantwatch.cli import main; sys.argv = ['q', 'demo']; main()",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert demo.returncode == 2
    assert demo.stderr.strip() == "error: the demo trains a model, which needs PyTorch: pip install 'quantwatch[agent]'"


def test_cli_reports_version() -> None:
    from quantwatch import __version__

    out = subprocess.run(
        [sys.executable, "-m", "quantwatch.cli", "version"], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == __version__


# --------------------------------------------------------------------------------------- the import graph itself
ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "quantwatch.protocol": ROOT / "quantwatch" / "protocol",
    "quantwatch.kernels": ROOT / "kernels",
    "quantwatch.agent": ROOT / "agent",
    "quantwatch.service": ROOT / "service",
    "quantwatch.integrations": ROOT / "quantwatch" / "integrations",
    "quantwatch.demo": ROOT / "quantwatch" / "demo",
}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    for path in (ROOT / "quantwatch").glob("*.py"):
        found["quantwatch" if path.stem == "__init__" else f"quantwatch.{path.stem}"] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> tuple[set[str], set[str]]:
    """(the project's modules ``name`` imports at run time, the top-level names of everything else it imports).

    Imports under ``if TYPE_CHECKING:`` do not run and are left out; ``from package import name`` counts as an import
    of the submodule ``package.name`` where there is one, else of the package."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.dump(block.test)
        for statement in block.body
        for node in ast.walk(statement)
    }
    ours: set[str] = set()
    others: set[str] = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            if target in known:
                ours.add(target)
            elif not target.startswith("quantwatch"):
                others.add(target.split(".")[0])
    ours.discard(name)
    return ours, others


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name], external[name] = _imports(name, path, known)
    return graph, external


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_protocol_imports_only_the_standard_library_numpy_and_msgpack() -> None:
    graph, external = _graph()
    for name in (m for m in graph if m.startswith("quantwatch.protocol")):
        reached = _reachable(graph, name)
        assert all(m.startswith("quantwatch.protocol") for m in reached), (name, reached)
        outside = set().union(*(external[m] for m in reached)) - set(sys.stdlib_module_names)
        assert outside <= {"numpy", "msgpack"}, (name, outside)


def test_the_collector_imports_neither_the_agent_nor_the_kernels_nor_torch() -> None:
    graph, external = _graph()
    for name in (m for m in graph if m.startswith("quantwatch.service")):
        reached = _reachable(graph, name)
        assert not any(m.startswith(("quantwatch.agent", "quantwatch.kernels")) for m in reached), name
        assert not {"torch", "triton"} & set().union(*(external[m] for m in reached)), name


def test_no_module_is_part_of_an_import_cycle() -> None:
    graph, _ = _graph()
    cycles = [sorted(c) for c in _cycles(graph)]
    assert cycles == []


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_python_module_is_over_600_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in _modules().values()
        if (n := len(path.read_text().splitlines())) > 600
    }
    assert long == {}
