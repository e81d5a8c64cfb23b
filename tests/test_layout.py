"""The package's layout: no import cycles inside autotp/, at module level or inside functions.

Each module's imports are read with ``ast`` (every ``import`` and ``from ... import`` anywhere in
the file, so function-level and ``TYPE_CHECKING`` imports count) and resolved to autotp's own
modules: ``from .x import name`` is an arrow to ``x`` (its ``__init__`` where ``x`` is a package),
``from . import x`` an arrow to the submodule ``x``. The implicit import of a module's parent
packages is no arrow (every submodule has it). The graph must have no cycle: the stages import
downward (capture -> passes -> plan -> rewrite -> runtime; the entry points in api.py on top).
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

import autotp

ROOT = Path(autotp.__file__).parent


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> nx.DiGraph:
    """Module -> the modules of the same package tree it imports (see the module docs)."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph = nx.DiGraph()
    for name, path in files.items():
        graph.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in files else module for a in node.names]
            else:
                continue
            graph.add_edges_from((name, t) for t in targets if t in files and t != name)
    return graph


def test_autotp_has_no_import_cycle():
    cycles = sorted(nx.simple_cycles(import_graph(ROOT)), key=len)
    assert not cycles, "import cycles in autotp/ (move the shared code below both): " + "; ".join(
        " -> ".join(c + c[:1]) for c in cycles[:10])


def test_the_check_sees_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from .sub import g\n\ndef f():\n    return g()\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def g():\n    from .. import a\n    return a\n")
    (pkg / "sub" / "c.py").write_text("from . import b\n")
    graph = import_graph(pkg)
    assert set(graph.edges) == {("pkg", "pkg.a"), ("pkg.a", "pkg.sub"), ("pkg.sub.b", "pkg.a"),
                                ("pkg.sub.c", "pkg.sub.b")}
    assert list(nx.simple_cycles(graph)) == []    # b imports a, but a imports sub's __init__, not b
    (pkg / "sub" / "__init__.py").write_text("from .b import g\n")
    assert sorted(map(sorted, nx.simple_cycles(import_graph(pkg)))) == [["pkg.a", "pkg.sub", "pkg.sub.b"]]
