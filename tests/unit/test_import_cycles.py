"""No import cycles among the project's modules, function-level and ``TYPE_CHECKING``
imports included.

Every ``.py`` file of ``gateway``, ``routing`` and ``loadtest`` is parsed with :mod:`ast`
(nothing is imported, so the check takes milliseconds) and every ``import x`` /
``from x import y`` anywhere in it, at module level or inside a function, class or
``try``, becomes an edge of the module graph:

* ``import a.b`` is an edge to ``a.b`` (the parent package ``a`` that Python also runs
  first is not added: every submodule would otherwise "import" its own package);
* ``from a import b`` is an edge to the submodule ``a.b`` when that is a module, to ``a``
  otherwise (``from gateway.server.app import STATE`` is an edge to ``gateway.server.app``);
* relative imports are resolved against the importing module's package;
* a package's ``__init__`` importing its own submodules is an edge like any other;
* the body of an ``if TYPE_CHECKING:`` block counts like any other code: those imports
  never run, but a module that needs another's type depends on it as much as one that
  calls it, and two modules that name each other's types are one unit to read and to
  change (:data:`COUNT_TYPE_CHECKING` switches this off);
* imports of modules outside the project, ``from __future__`` and a module importing
  itself are ignored.

The cycles are the strongly connected components of that graph with more than one
module, found with Tarjan's algorithm (R. E. Tarjan, "Depth-first search and linear
graph algorithms", SIAM Journal on Computing 1(2):146-160, 1972). A component is printed
as cycles: for every import edge ``u -> v`` inside it, the shortest way from ``v`` back to
``u`` closes one, so that every edge taking part in a cycle is shown at least once (e.g.
``gateway.server.app -> gateway.ops.admin -> gateway.server.app``).

One case per package (the graph restricted to that package's modules) and one for the
whole project (which also catches a cycle that crosses packages).
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "routing", "loadtest")
# imports in ``if TYPE_CHECKING:`` bodies are edges too (see the module doc)
COUNT_TYPE_CHECKING = True

# --- the detector ---------------------------------------------------------------------------------


def discover(root: Path, tops: tuple[str, ...] | None = None) -> dict[str, tuple[Path, bool]]:
    """``{module name: (file, is_package)}`` for the packages (directories with an
    ``__init__.py``) and plain modules named in ``tops`` under ``root``; all of them when
    ``tops`` is None."""
    root = Path(root)
    if tops is None:
        tops = tuple(sorted({p.stem for p in root.glob("*.py")}
                            | {p.parent.name for p in root.glob("*/__init__.py")}))
    out: dict[str, tuple[Path, bool]] = {}
    for top in tops:
        if (root / top / "__init__.py").is_file():
            for f in sorted((root / top).rglob("*.py")):
                rel = f.relative_to(root).with_suffix("")
                if "__pycache__" in rel.parts or not (f.parent / "__init__.py").is_file():
                    continue
                parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
                out[".".join(parts)] = (f, rel.name == "__init__")
        elif (root / f"{top}.py").is_file():
            out[top] = (root / f"{top}.py", False)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST, type_checking: bool):
    """Every Import / ImportFrom node, at any depth; inside ``if TYPE_CHECKING:`` bodies
    too when ``type_checking``."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, is_package: bool, modules, type_checking: bool = True) -> set[str]:
    """The project modules that module ``name`` (file ``path``) imports anywhere."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _import_nodes(tree, type_checking):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    out.add(alias.name)
            continue
        if node.module == "__future__":
            continue
        if node.level:
            base_parts = package.split(".") if package else []
            if node.level - 1 > len(base_parts):
                continue  # beyond the top: not resolvable here
            base_parts = base_parts[:len(base_parts) - (node.level - 1)]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        for alias in node.names:
            sub = f"{base}.{alias.name}" if base else alias.name
            if sub in modules:
                out.add(sub)
            elif base in modules:
                out.add(base)
    out.discard(name)
    return out


def module_graph(root: Path, tops: tuple[str, ...] | None = None, *,
                 type_checking: bool = True) -> dict[str, set[str]]:
    modules = discover(root, tops)
    return {name: imports_of(name, path, is_pkg, modules, type_checking)
            for name, (path, is_pkg) in modules.items()}


def tarjan_scc(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan 1972), iterative: one DFS keeps each node's
    discovery index and lowlink; a node whose lowlink is its own index roots a component,
    which is popped off the node stack."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comps: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        work = [(start, iter(sorted(graph[start])))]
        while work:
            v, it = work[-1]
            for w in it:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    u = work[-1][0]
                    low[u] = min(low[u], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    comps.append(sorted(comp))
    return comps


def _shortest_path(graph: dict[str, set[str]], src: str, dst: str, within: set[str]) -> list[str]:
    prev: dict[str, str | None] = {src: None}
    q = deque([src])
    while q:
        v = q.popleft()
        if v == dst:
            path = []
            while v is not None:
                path.append(v)
                v = prev[v]
            return path[::-1]
        for w in sorted(graph[v]):
            if w in within and w not in prev:
                prev[w] = v
                q.append(w)
    raise AssertionError(f"{dst} not reachable from {src} inside its component")


def find_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Cycles as ``"a -> b -> a"`` strings: for every edge inside a strongly connected
    component, the edge and the shortest way back; each rotated to start at its smallest
    module and listed once."""
    seen: set[tuple[str, ...]] = set()
    out: list[str] = []
    for comp in tarjan_scc(graph):
        if len(comp) < 2:
            continue
        members = set(comp)
        for u in comp:
            for v in sorted(graph[u] & members):
                cyc = [u] + _shortest_path(graph, v, u, members)[:-1]
                k = cyc.index(min(cyc))
                key = tuple(cyc[k:] + cyc[:k])
                if key not in seen:
                    seen.add(key)
                    out.append(" -> ".join(key + key[:1]))
    return sorted(out)


def restrict(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    keep = {m for m in graph if m == package or m.startswith(package + ".")}
    return {m: graph[m] & keep for m in keep}


# --- the checks -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def project_graph() -> dict[str, set[str]]:
    return module_graph(ROOT, PACKAGES, type_checking=COUNT_TYPE_CHECKING)


@pytest.mark.parametrize("scope", ["gateway", "routing", "loadtest", "project"])
def test_no_import_cycles(project_graph, scope):
    graph = project_graph if scope == "project" else restrict(project_graph, scope)
    assert graph, f"no modules found for {scope}"
    cycles = find_cycles(graph)
    if cycles:
        print(f"{len(cycles)} import cycle(s) in {scope}:")
        for c in cycles:
            print("  " + c)
    assert not cycles, f"{len(cycles)} import cycle(s) in {scope}:\n" + "\n".join(cycles)


def test_detector_finds_a_synthetic_cycle(tmp_path):
    (tmp_path / "cyc_a.py").write_text("import os\nfrom cyc_b import helper\n")
    (tmp_path / "cyc_b.py").write_text("def helper():\n    from cyc_a import thing  # function-level\n")
    assert find_cycles(module_graph(tmp_path)) == ["cyc_a -> cyc_b -> cyc_a"]
    (tmp_path / "cyc_b.py").write_text("def helper():\n    return 1\n")
    assert find_cycles(module_graph(tmp_path)) == []


def test_detector_resolution(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg import a\nfrom pkg.b import NAME\n")
    (pkg / "a.py").write_text("from . import b\nfrom .sub import c\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nNAME = 1\n"
                              "if TYPE_CHECKING:\n    from pkg import a\nelse:\n    import pkg.sub\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from __future__ import annotations\nfrom .. import b\nimport json\n")
    assert module_graph(tmp_path, ("pkg",), type_checking=False) == {
        "pkg": {"pkg.a", "pkg.b"},
        "pkg.a": {"pkg.b", "pkg.sub.c"},
        "pkg.b": {"pkg.sub"},
        "pkg.sub": set(),
        "pkg.sub.c": {"pkg.b"},
    }
    assert find_cycles(module_graph(tmp_path, ("pkg",), type_checking=False)) == []
    # counted, the TYPE_CHECKING import closes a cycle
    assert module_graph(tmp_path, ("pkg",))["pkg.b"] == {"pkg.a", "pkg.sub"}
    assert find_cycles(module_graph(tmp_path, ("pkg",))) == ["pkg.a -> pkg.b -> pkg.a",
                                                            "pkg.a -> pkg.sub.c -> pkg.b -> pkg.a"]


def test_gateway_enters_routing_only_through_the_decision_core(project_graph):
    """``routing.core`` is the one door from the data plane into ``routing/``."""
    doors = {(m, dep) for m, deps in project_graph.items() if m.split(".")[0] == "gateway"
             for dep in deps if dep.split(".")[0] == "routing" and dep != "routing.core"}
    assert not doors, "gateway imports routing/ besides routing.core: " + ", ".join(
        f"{m} -> {d}" for m, d in sorted(doors))
