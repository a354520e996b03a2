"""Suite-wide: a hung test prints every asyncio task's stack before faulthandler's
thread dump (which shows only an idle event loop), so a rare hang can be diagnosed
from the CI log."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

HANG_DUMP_S = 150.0  # well above any test's normal run time, below faulthandler_timeout


def _dump_tasks(name: str) -> None:
    out = sys.__stderr__
    tasks = list(getattr(asyncio.tasks, "_all_tasks", ()))  # read from this thread while the loop idles
    print(f"\n==== {name} still running after {HANG_DUMP_S:.0f} s: {len(tasks)} asyncio task(s) ====", file=out)
    for t in tasks:
        if t.done():
            continue
        print(f"--- {t!r}", file=out)
        try:
            t.print_stack(limit=12, file=out)
        except Exception as e:  # diagnostics only
            print(f"(no stack: {e!r})", file=out)
    out.flush()


@pytest.fixture(autouse=True)
def _asyncio_hang_dump(request):
    timer = threading.Timer(HANG_DUMP_S, _dump_tasks, args=(request.node.nodeid,))
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()
