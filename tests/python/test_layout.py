"""The package's layout (docs/architecture.md): arrows only downward, so no module of
``python/dpzero`` imports one that imports it back, directly or through others, counting imports
inside functions and under ``TYPE_CHECKING`` (both are still a dependency); and no module reads
another's underscore names (what one module needs of another is in that one's public names, or
handed over explicitly). The reference: each detector finds what it looks for in a small package
written for it."""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Set

import torch

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


def _private_reads(modules: Dict[str, str]) -> List[str]:
    """``module:line: what`` for every read of another module's underscore name: an import of
    one, or an attribute ``x._name`` (x not self or cls) where ``_name`` is defined (a def or
    class, an assignment, an attribute stored) in another of the package's modules and not in
    this one. torch's own underscore attributes (of modules and tensors) are torch's."""
    torch_names = set(dir(torch.nn.Module())) | set(dir(torch.Tensor))
    trees = {}
    defined: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        with open(path) as f:
            trees[name] = tree = ast.parse(f.read(), path)
        mine = defined[name] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                mine.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                mine.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                mine.add(node.id)
    elsewhere = {n for names in defined.values() for n in names}
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                found += [f"{name}:{node.lineno}: import {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")
                          and a.name != "_C" and (node.level or (node.module or "")
                                                  .split(".")[0] == name.split(".")[0])]
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                attr = node.attr
                if not attr.startswith("_") or attr.startswith("__") or attr in torch_names:
                    continue
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                if attr in elsewhere and attr not in defined[name]:
                    found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_detector_finds_reads_of_another_modules_private_names(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def _helper():\n    pass\n\n\nclass A:\n"
                              "    def __init__(self):\n        self._hidden = 1\n"
                              "        self._modules = {}\n")
    (pkg / "b.py").write_text("from .a import _helper, A\n\n\ndef f(a: A):\n"
                              "    return a._hidden, a._modules, a._own\n\n\n"
                              "class B:\n    def g(self):\n        self._own = 2\n"
                              "        return self._hidden\n")
    assert _private_reads(_modules(str(pkg), "pkg")) == [
        "pkg.b:1: import _helper", "pkg.b:5: a._hidden"]


def test_no_module_reads_another_modules_private_names():
    found = _private_reads(_modules(os.path.join(ROOT, "python", "dpzero"), "dpzero"))
    assert found == [], "\n".join(found)


def test_make_private_shows_every_setting_with_the_same_defaults():
    """``dpzero.make_private`` names every setting in its signature (help() and editors show
    them), with the defaults ``resolve`` applies to every front door; only the optimizer's and
    the layout's own options go through ``**optimizer_options``."""
    import inspect

    import dpzero
    from dpzero.private.config import resolve

    shown = inspect.signature(dpzero.make_private).parameters
    for name, p in inspect.signature(resolve).parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            continue
        assert name in shown, name
        if p.default is not inspect.Parameter.empty:
            assert shown[name].default == p.default, name
    keywords = [n for n, p in shown.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert len(keywords) == 39 and shown["max_grad_norm"].default is inspect.Parameter.empty
