"""The package's layout (docs/architecture.md): arrows only downward, so no module of
``python/dpzero`` imports one that imports it back, directly or through others, counting imports
inside functions and under ``TYPE_CHECKING`` (both are still a dependency). The reference: the
detector finds the cycle in a small package written for it."""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Set

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _modules(top: str, package: str) -> Dict[str, str]:
    """Dotted module name -> path, for every .py under ``top`` (the folder of ``package``)."""
    out = {}
    for folder, _, files in os.walk(top):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = ".".join([package] + os.path.relpath(path, top)[:-3].split(os.sep))
                out[dotted[:-len(".__init__")] if dotted.endswith(".__init__") else dotted] = path
    return out


def _imports(modules: Dict[str, str], extensions: Set[str]) -> Dict[str, Set[str]]:
    """Module -> the package's modules it imports. ``from . import x`` imports the module x when
    there is one, else the package (x is a name in its __init__); ``extensions``, the package's
    compiled modules, import nothing of it."""
    edges: Dict[str, Set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        here = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]
                                if node.level else [node.module or ""]).strip(".")
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    if target in modules:
                        edges[name].add(target)
                    elif target in extensions:
                        continue
                    elif base in modules:
                        edges[name].add(base)
            elif isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names if a.name in modules)
        edges[name].discard(name)
    return edges


def _cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_detector_finds_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import low\n")
    (pkg / "low.py").write_text("def f():\n    from .sub.high import g\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "high.py").write_text("from ..low import f\nfrom .. import _C\n")
    edges = _imports(_modules(str(pkg), "pkg"), {"pkg._C"})
    assert edges["pkg.low"] == {"pkg.sub.high"} and edges["pkg.sub.high"] == {"pkg.low"}
    assert _cycles(edges) == [["pkg.low", "pkg.sub.high"]]


def test_the_package_has_no_import_cycle():
    edges = _imports(_modules(os.path.join(ROOT, "python", "dpzero"), "dpzero"), {"dpzero._C"})
    assert len(edges) > 50  # the whole package was read
    assert _cycles(edges) == []
