"""Sealed layers: the gateway and the decision core import nothing from ``loadtest``.

Every ``import`` statement of ``gateway/`` and ``routing/`` is read with :mod:`ast`, at
any depth (module level, inside a function, under ``TYPE_CHECKING``), so that an import
made only on some path (a validator, a rarely used command) counts as much as one at the
top. The demo fleet is a ``python -m loadtest.sim`` child process that validates its own
``simulate:`` sections (:mod:`gateway.ops.demo_fleet`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file at ``path``; relative imports are
    named by their dots and module (``..x``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, "." * node.level + (node.module or "")))
    return out


def test_imports_of_reads_every_depth(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\nif TYPE_CHECKING:\n    from loadtest.sim import spec\n"
                 "def f():\n    import loadtest.sim.spec as s\n    from . import x\n")
    assert imports_of(f) == [(1, "os"), (3, "loadtest.sim"), (5, "loadtest.sim.spec"), (6, ".")]


def test_no_module_of_gateway_or_routing_imports_loadtest():
    files = [p for top in ("gateway", "routing") for p in sorted((ROOT / top).rglob("*.py"))]
    assert len(files) > 100
    found = [f"{p.relative_to(ROOT)}:{line} imports {name}" for p in files for line, name in imports_of(p)
             if name.split(".")[0] == "loadtest"]
    assert found == []
