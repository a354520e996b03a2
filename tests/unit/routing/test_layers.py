"""``routing/`` is pure logic (DESIGN.md section 2): no sockets, no Redis client, no
background tasks, nothing from the data planes.

Every ``.py`` file under ``routing/`` is parsed with :mod:`ast` (nothing is imported),
and every import anywhere in it (module level, inside a function, under
``if TYPE_CHECKING:``) and every call is checked: importing a socket-level or I/O
library, or ``gateway``/``loadtest``, fails; so does starting a task
(``asyncio.create_task``, ``asyncio.ensure_future``, ``loop.create_task``, or those
names imported from ``asyncio``). What shares the routing view between replicas lives
in ``gateway/store/`` and talks to the decision core through :mod:`routing.store`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# top-level modules that open sockets or talk to a server, and the packages routing/ serves
FORBIDDEN_MODULES = frozenset({"redis", "socket", "aiohttp", "zmq", "grpc", "gateway", "loadtest"})
TASK_STARTERS = frozenset({"create_task", "ensure_future"})


def violations(source: str, filename: str = "<string>") -> list[str]:
    """What in ``source`` breaks the rule, as ``line: what`` strings."""
    out = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Import):
            out += [f"{node.lineno}: import {a.name}" for a in node.names
                    if a.name.partition(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            top = node.module.partition(".")[0]
            if top in FORBIDDEN_MODULES:
                out.append(f"{node.lineno}: from {node.module} import ...")
            elif top == "asyncio":
                out += [f"{node.lineno}: from asyncio import {a.name}" for a in node.names if a.name in TASK_STARTERS]
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in TASK_STARTERS:
                out.append(f"{node.lineno}: {ast.unparse(f)}(...)")
    return out


def test_routing_imports_no_io_library_and_starts_no_task():
    found = {}
    files = sorted((ROOT / "routing").rglob("*.py"))
    assert len(files) > 10, "routing/ not found"
    for path in files:
        bad = violations(path.read_text(), str(path))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    assert not found, "routing/ must stay pure (DESIGN.md section 2):\n" + "\n".join(
        f"  {p}: {', '.join(v)}" for p, v in sorted(found.items()))


def test_the_scan_sees_what_it_must():
    src = """
import socket
import redis.asyncio as aioredis
from aiohttp import web
import asyncio
from asyncio import ensure_future
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from gateway.runtime import GatewayState
def f(loop):
    import zmq
    asyncio.create_task(g())
    loop.create_task(g())
    asyncio.ensure_future(g())
"""
    assert violations(src) == [
        "2: import socket", "3: import redis.asyncio", "4: from aiohttp import ...",
        "6: from asyncio import ensure_future", "9: from gateway.runtime import ...", "11: import zmq",
        "12: asyncio.create_task(...)", "13: loop.create_task(...)", "14: asyncio.ensure_future(...)"]
    assert violations("import asyncio\nimport socketserver\nfrom . import gateway\nasyncio.sleep(0)\n") == []
