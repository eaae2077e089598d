"""The packages form layers: no import cycle among the modules of ``betty/`` and
``workflow/``, counting every import, at module level or inside a function (a lazy import
hides a cycle from Python, not from the reader)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def module_graph(root: Path, packages=("betty", "workflow")) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over the ``.py`` files of ``packages`` under
    ``root`` (a package is its ``__init__``; an import of a name inside a package counts
    as an import of the module that defines it when that is a module, else of the package)."""
    files: dict[str, Path] = {}
    for pkg in packages:
        for path in (root / pkg).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        deps: set[str] = set()
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(filter(None, (known(a.name) for a in node.names)))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    dep = target if target in files else known(base)
                    if dep:
                        deps.add(dep)
        deps.discard(module)
        graph[module] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_betty_and_workflow_have_no_import_cycle():
    assert cycles(module_graph(ROOT)) == []


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize("files,expected", [
    # a lazy import inside a function still closes the cycle
    ({"betty/__init__.py": "", "betty/a.py": "from betty.b import f\n",
      "betty/b.py": "def f():\n    from betty import a\n"}, [["betty.a", "betty.b"]]),
    # a package re-exporting a submodule of a package that imports it back
    ({"betty/__init__.py": "", "betty/low/__init__.py": "from betty.high.x import y\n",
      "betty/high/__init__.py": "", "betty/high/x.py": "from betty.low import z\n"},
     [["betty.high.x", "betty.low"]]),
    # relative imports, and across the two packages
    ({"betty/__init__.py": "", "betty/p/__init__.py": "", "betty/p/m.py": "from . import n\n",
      "betty/p/n.py": "from ..q import r\n", "betty/q.py": "import workflow.w\n",
      "workflow/__init__.py": "", "workflow/w.py": "from betty.p.m import g\n"},
     [["betty.p.m", "betty.p.n", "betty.q", "workflow.w"]]),
    ({"betty/__init__.py": "", "betty/a.py": "import betty.b\n", "betty/b.py": "import os\n"}, []),
])
def test_the_check_finds_a_deliberate_cycle(tmp_path, files, expected):
    assert cycles(module_graph(_package(tmp_path, files))) == expected
