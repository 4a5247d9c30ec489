"""The packages of autoshard/ are layered one way. The source is read with ``ast``, not imported:
importing would miss the imports inside functions and break on the half-moved trees this guards.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import networkx as nx
import pytest

LAYERS: list[set[str]] = [
    # bottom: the IR and plain data every package may use
    {"errors", "ir", "options", "cluster", "mesh", "plans", "plangraph", "loss", "precision",
     "files",       # outputs written atomically, never over an input
     "progress",    # progress: lines on stderr the planner reports, off unless the CLI asks
     "schedules"},  # the pipeline schedules' closed forms (plain arithmetic)
    {"ops"},        # per-op records: family, strategies, saved-for-backward, follows, flops, localize
    {"trace"},
    {"cost"},
    {"solver"},
    {"codegen"},
    {"zoo"},        # model definitions used by the CLI, verify and tests
    # the user's tools on top of everything: the command line, verify, diff, calibrate, explain,
    # report and export (autoshard/tools/), and `python -m autoshard`
    {"tools", "__main__"},
]

ROOT = Path(__file__).resolve().parents[1]
PKG = "autoshard"
FACADE = PKG    # autoshard/__init__.py: its unit name is the bare package name


@dataclass(frozen=True)
class Edge:
    path: str       # importing file, relative to the root: "autoshard/cost/compute.py"
    src: str        # importing module: "autoshard.cost.compute"
    dst: str        # imported module: "autoshard.solver.planner"


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else FACADE


def _is_module(root: Path, module: str) -> bool:
    base = root.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    def __init__(self, root: Path, module: str, is_package: bool) -> None:
        self.root, self.module, self.is_package = root, module, is_package
        self.found: list[str] = []

    def _add(self, module: str) -> None:
        if module == PKG or module.startswith(PKG + "."):
            self.found.append(module)

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        # The body never runs; an `else:` does, so it still counts.
        for stmt in node.orelse:
            self.visit(stmt)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            package = self.module.split(".") if self.is_package else self.module.split(".")[:-1]
            keep = len(package) - (node.level - 1)
            if keep <= 0:
                raise AssertionError(f"{self.module}: relative import climbs above {PKG}")
            base = ".".join(package[:keep] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            # `from a.b import c` imports module a.b.c when it is one, else a name from a.b.
            self._add(sub if alias.name != "*" and _is_module(self.root, sub) else base)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module under root/autoshard, by dotted name (a package by its __init__.py)."""
    out: dict[str, Path] = {}
    for path in sorted((root / PKG).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def collect_imports(root: Path = ROOT) -> list[Edge]:
    edges: list[Edge] = []
    for module, path in modules(root).items():
        walker = _Imports(root, module, path.name == "__init__.py")
        walker.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        rel = path.relative_to(root).as_posix()
        edges += [Edge(rel, module, dst) for dst in dict.fromkeys(walker.found)]
    return edges


def _runtime_edges(edges: list[Edge]) -> list[Edge]:
    # The facade is exempt as an importer; imports *of* it are reported by their own test, so
    # leaving its outgoing edges in would only repeat each of those as a cycle.
    return [e for e in edges if e.src != FACADE and e.dst != FACADE]


def cycles(edges: list[Edge], node: Callable[[str], str]) -> list[str]:
    """Cycles among ``node(module)``: one readable chain per strongly connected component."""
    graph = nx.DiGraph()
    for e in _runtime_edges(edges):
        a, b = node(e.src), node(e.dst)
        # a == b: a package's __init__ naming itself, or imports inside one unit; keeping the
        # first import per pair is enough to tell where to start looking.
        if a != b and not graph.has_edge(a, b):
            graph.add_edge(a, b, why=f"{e.path} imports {e.dst}")
    out = []
    for scc in nx.strongly_connected_components(graph):
        if len(scc) > 1:
            loop = nx.find_cycle(graph.subgraph(scc), source=min(scc))
            chain = " -> ".join([a for a, _ in loop] + [loop[0][0]])
            out.append(f"{chain}  ({'; '.join(graph.edges[e]['why'] for e in loop)})")
    return sorted(out)


def layer_violations(edges: list[Edge], layers: list[set[str]]) -> list[str]:
    rank = {name: i for i, layer in enumerate(layers) for name in layer}
    out = []
    for e in _runtime_edges(edges):
        a, b = unit(e.src), unit(e.dst)
        if a in rank and b in rank and rank[b] > rank[a]:
            out.append(f"{e.path} imports {e.dst} ({a} may not import {b}: {b} is above it)")
    return out


def unlayered_units(root: Path, edges: list[Edge], layers: list[set[str]]) -> list[str]:
    # Files count even when they import nothing, so a new leaf module is caught too.
    where = {unit(m): p.relative_to(root).as_posix() for m, p in reversed(modules(root).items())}
    for e in edges:
        where.setdefault(unit(e.dst), f"{e.path} imports {e.dst}")
    known = set().union(*layers) | {FACADE}
    return [f"unit {name!r} ({where[name]}) is not in LAYERS: add it to LAYERS in "
            f"tests/test_layering.py" for name in sorted(where.keys() - known)]


def facade_imports(edges: list[Edge]) -> list[str]:
    return [f"{e.path} imports the bare {PKG} package (a cycle through the facade "
            f"{PKG}/__init__.py: import the defining module instead)"
            for e in edges if e.dst == FACADE and e.src != FACADE]


def _fail_if(problems: list[str], what: str) -> None:
    assert not problems, f"{len(problems)} {what}:\n  " + "\n  ".join(problems)


def test_layers_are_disjoint() -> None:
    names = [name for layer in LAYERS for name in layer]
    twice = sorted({name for name in names if names.count(name) > 1})
    assert not twice, f"units in two layers of LAYERS: {twice}"


CHECKS: dict[str, Callable[[list[Edge]], list[str]]] = {
    "units missing from LAYERS": lambda edges: unlayered_units(ROOT, edges, LAYERS),
    "imports of the facade": facade_imports,
    "module import cycles": lambda edges: cycles(edges, str),
    "package import cycles": lambda edges: cycles(edges, unit),
    "imports of a higher layer": lambda edges: layer_violations(edges, LAYERS),
}


@pytest.mark.parametrize("what", list(CHECKS))
def test_autoshard_source(what: str) -> None:
    _fail_if(CHECKS[what](collect_imports()), what)


def test_walker_and_checks_on_synthetic_source(tmp_path: Path) -> None:
    # A checker that never fails proves nothing: run it on a tree with known answers.
    files = {
        "__init__.py": "from autoshard.cost.comm import f\n", "plugins.py": "", "ir.py": "",
        "cost/__init__.py": "", "cost/helpers.py": "", "solver/__init__.py": "",
        "solver/planner.py": "import autoshard.cost.comm\n",
        "cost/comm.py": (
            "import typing\nfrom typing import TYPE_CHECKING\n"
            "from . import helpers\nfrom .. import ir\nfrom autoshard.cost import missing\n"
            "if TYPE_CHECKING:\n    from autoshard.codegen import runtime\n"
            "if typing.TYPE_CHECKING:\n    import autoshard.zoo\nelse:\n    import autoshard.mesh\n"
            "def f():\n    from autoshard.solver.planner import plan\n"
            "class C:\n    def m(self):\n        from autoshard import plan\n"),
    }
    for name, text in files.items():
        (tmp_path / PKG / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / PKG / name).write_text(text)
    edges = collect_imports(tmp_path)
    assert {e.dst for e in edges if e.src == "autoshard.cost.comm"} == {
        "autoshard.cost.helpers", "autoshard.ir", "autoshard.cost", "autoshard.mesh",
        "autoshard.solver.planner", "autoshard"}
    assert Edge("autoshard/__init__.py", "autoshard", "autoshard.cost.comm") in edges
    assert facade_imports(edges) == [
        "autoshard/cost/comm.py imports the bare autoshard package (a cycle through the facade "
        "autoshard/__init__.py: import the defining module instead)"]
    assert layer_violations(edges, LAYERS) == [
        "autoshard/cost/comm.py imports autoshard.solver.planner "
        "(cost may not import solver: solver is above it)"]
    assert [c.split("  (")[0] for c in cycles(edges, str)] == [
        "autoshard.cost.comm -> autoshard.solver.planner -> autoshard.cost.comm"]
    assert [c.split("  (")[0] for c in cycles(edges, unit)] == ["cost -> solver -> cost"]
    assert unlayered_units(tmp_path, edges, [{"ir", "cost", "solver"}]) == [
        f"unit {name!r} ({where}) is not in LAYERS: add it to LAYERS in tests/test_layering.py"
        for name, where in [("mesh", "autoshard/cost/comm.py imports autoshard.mesh"),
                            ("plugins", "autoshard/plugins.py")]]
