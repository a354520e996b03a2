"""Run a Markdown page's shell and Python blocks as written, on loopback.

:func:`blocks` extracts the code blocks of a page that a reader would run: fenced
blocks tagged ``sh``/``bash``/``shell``/``console`` or untagged, indented blocks (four
spaces, not inside a list item), and ``python`` blocks. A block preceded by the comment
``<!-- not run: REASON -->`` is skipped on purpose; every other block must be run.

:class:`DocSession` runs the commands of such blocks as a reader would: from a scratch
working directory holding copies of the repository files the commands name, with every
documented port moved to a free one (in the commands, the Python blocks and the copied
files alike), each long-running command (a server) in a process group of its own, which
:meth:`DocSession.close` stops by its PID, and nothing else. Install steps are dropped:
``python3 -m venv``, ``. .venv/bin/activate`` and ``pip install ...`` (this environment is
installed already); ``python`` and the project's console scripts (``envoy``) are this
interpreter's and its environment's, and the checkout is on ``PYTHONPATH``.
:meth:`DocSession.assert_every_block_run` fails while a block of the page was neither run
nor marked, so a new command in the docs is either tested or consciously skipped.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
# a reader's shell: Ctrl-C reaches the command, and the status is the command's
_BASH = shutil.which("bash") or "/bin/sh"
_SHELL = {"", "sh", "bash", "shell", "console"}
_SKIP = re.compile(r"^<!--\s*not run:\s*(.+?)\s*-->$")
_LIST_ITEM = re.compile(r"^\s*([-*+]|\d+[.)])\s")
# the install steps of a command, dropped: the test environment is installed already
_INSTALL = re.compile(r"^(python3? -m venv \S+|\. \S+/bin/activate|source \S+/bin/activate|pip install .+)$")


@dataclass(frozen=True)
class Block:
    doc: str  # the page, relative to the repository root
    line: int  # 1-based line of the block's first line of code
    lang: str  # "sh" or "python"
    text: str
    skip: str | None  # the reason given by <!-- not run: ... -->

    @property
    def commands(self) -> list[str]:
        """A shell block's commands: one per line, backslash continuations joined, a
        quoted string that spans lines kept whole."""
        out, cur = [], ""
        for line in self.text.splitlines():
            if line.rstrip().endswith("\\"):
                cur += line.rstrip()[:-1] + " "
                continue
            cur += line
            try:
                shlex.split(cur, comments=True)
            except ValueError:  # an open quote: the command goes on on the next line
                cur += "\n"
                continue
            if cur.strip():
                out.append(cur.strip())
            cur = ""
        assert not cur.strip(), f"{self.doc}:{self.line}: unterminated command {cur!r}"
        return out


def blocks(doc: str, text: str | None = None) -> list[Block]:
    """The shell and Python code blocks of the page ``doc`` (relative to the repository
    root), or of ``text`` when given."""
    lines = ((ROOT / doc).read_text() if text is None else text).splitlines()
    out: list[Block] = []
    i = 0
    prev = ""  # the last non-blank line before the current one, outside code

    def skip_reason() -> str | None:
        m = _SKIP.match(prev.strip())
        return m.group(1) if m else None

    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^\s*```\s*([\w+-]*)", line)
        if fence:
            lang = fence.group(1).lower()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            kind = "sh" if lang in _SHELL else "python" if lang == "python" else None
            if kind:
                out.append(Block(doc, i + 2, kind, "\n".join(lines[i + 1:end]) + "\n", skip_reason()))
            prev, i = lines[end], end + 1
            continue
        if (line.startswith("    ") and line.strip() and i > 0 and not lines[i - 1].strip()
                and prev and not prev.startswith((" ", "\t")) and not _LIST_ITEM.match(prev)):
            start, j = i, i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            body = [ln[4:] for ln in lines[start:j]]
            while body and not body[-1].strip():
                body.pop()
            out.append(Block(doc, start + 1, "sh", "\n".join(body) + "\n", skip_reason()))
            prev, i = lines[start], j
            continue
        if line.strip():
            prev = line
        i += 1
    return out


def _wait(what: str, proc: subprocess.Popen, log: Path, ok, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not ready within {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def _listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


@dataclass
class Server:
    cmd: str
    proc: subprocess.Popen
    log: Path


@dataclass
class DocSession:
    """Runs the blocks of ``doc`` in ``workdir``; ``ports`` are the documented ports, each
    moved to a free one."""

    doc: str
    workdir: Path
    ports: tuple[int, ...]
    port_map: dict[int, int] = field(init=False)
    ran: set[tuple[int, str]] = field(default_factory=set)  # (block line, command)
    servers: list[Server] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.port_map = {p: free_port() for p in self.ports}
        self.blocks = blocks(self.doc)
        bindir = os.path.dirname(sys.executable)
        self.env = {**os.environ, "PATH": os.pathsep.join([bindir, os.environ.get("PATH", "")]),
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                    "PYTHONUNBUFFERED": "1"}
        self.env.pop("REDIS_URL", None)

    # -- what is run
    def moved(self, text: str) -> str:
        """``text`` with every documented port replaced by its free one."""
        for doc_port, port in self.port_map.items():
            text = re.sub(rf"(?<![\d.]){doc_port}(?!\d)", str(port), text)
        return text

    def port(self, doc_port: int) -> int:
        return self.port_map[doc_port]

    def _find(self, needle: str, lang: str = "sh") -> tuple[Block, str]:
        hits = [(b, c) for b in self.blocks if b.lang == lang
                for c in (b.commands if lang == "sh" else [b.text]) if needle in c]
        assert len(hits) == 1, f"{self.doc}: {len(hits)} {lang} blocks hold {needle!r} (one expected)"
        block, cmd = hits[0]
        assert block.skip is None, f"{self.doc}:{block.line} is marked not run ({block.skip}) but the test runs it"
        self.ran.add((block.line, cmd))
        return block, cmd

    def _as_written(self, cmd: str) -> str:
        steps = [s for s in cmd.split(" && ") if not _INSTALL.match(s.strip())]
        assert steps, f"{cmd!r} installs only"
        cmd = self.moved(" && ".join(steps))
        for path in re.findall(r"[\w./-]+", cmd):  # the repository files it names, copied here
            src = ROOT / path
            if path and not path.startswith(("/", ".")) and src.is_file() and not (self.workdir / path).exists():
                (self.workdir / path).parent.mkdir(parents=True, exist_ok=True)
                (self.workdir / path).write_text(self.moved(src.read_text()))
        return cmd

    def run(self, needle: str, timeout_s: float = 120.0, cwd: Path | None = None, extra: str = "") -> str:
        """Run the one command holding ``needle`` to its end; it must exit 0. Its output."""
        _, cmd = self._find(needle)
        return self._run_shell(self._as_written(cmd) + extra, timeout_s, cwd)

    def _run_shell(self, cmd: str, timeout_s: float, cwd: Path | None = None, stdin: str | None = None) -> str:
        proc = subprocess.Popen(cmd, shell=True, executable=_BASH, cwd=cwd or self.workdir, env=self.env, text=True,
                                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = proc.communicate(stdin, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise AssertionError(f"{self.doc}: `{cmd}` did not end within {timeout_s:.0f} s:\n{out[-3000:]}") from None
        assert proc.returncode == 0, f"{self.doc}: `{cmd}` exited {proc.returncode}:\n{out[-3000:]}"
        return out

    def python(self, needle: str, timeout_s: float = 60.0) -> str:
        """Run the one Python block holding ``needle`` with this interpreter; it must exit 0."""
        block, _ = self._find(needle, "python")
        return self._run_shell(f"{sys.executable} -", timeout_s, stdin=self.moved(block.text))

    def serve(self, needle: str, ports: tuple[int, ...] = (), ready: str | None = None, log_line: str | None = None,
              timeout_s: float = 90.0) -> Server:
        """Start the long-running command holding ``needle`` and wait until it listens on
        (the free ports of) the documented ``ports``, ``ready`` (a documented URL) answers
        200 and its output holds ``log_line``."""
        _, cmd = self._find(needle)
        cmd = self._as_written(cmd)
        log = self.workdir / f"server-{len(self.servers)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, shell=True, executable=_BASH, cwd=self.workdir, env=self.env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        server = Server(cmd, proc, log)
        self.servers.append(server)
        for p in ports:
            _wait(f"`{cmd}` on port {self.port(p)}", proc, log, lambda p=p: _listens(self.port(p)), timeout_s)
        if ready:
            url = self.moved(ready)
            _wait(f"`{cmd}`: {url}", proc, log, lambda: _answers_200(url), timeout_s)
        if log_line:
            _wait(f"`{cmd}`: {log_line!r} in its log", proc, log, lambda: log_line in log.read_text(), timeout_s)
        return server

    def stop(self, server: Server, timeout_s: float = 40.0) -> int:
        """Ctrl-C to ``server``'s process group (the shell and what it started); it must
        still have been running. Its exit status."""
        assert server.proc.poll() is None, \
            f"`{server.cmd}` died while the page was followed:\n{server.log.read_text()[-3000:]}"
        os.killpg(server.proc.pid, signal.SIGINT)
        try:
            return server.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
            raise AssertionError(f"`{server.cmd}` did not stop on Ctrl-C within {timeout_s:.0f} s") from None

    def close(self) -> None:
        """Stop every server this session started, the last started first, each by its
        process group; servers still running were running the whole time."""
        errors = []
        for s in reversed(self.servers):
            if s.proc.poll() is None:
                try:
                    self.stop(s)
                except AssertionError as e:
                    errors.append(str(e))
        self.servers.clear()
        assert not errors, "\n".join(errors)

    def assert_every_block_run(self) -> None:
        """Every command of every block of the page was run, unless its block is marked
        ``<!-- not run: ... -->``."""
        missed = [f"{self.doc}:{b.line}: {c}" for b in self.blocks if b.skip is None
                  for c in (b.commands if b.lang == "sh" else [b.text]) if (b.line, c) not in self.ran]
        assert not missed, ("commands of the page neither run by the test nor marked "
                            "`<!-- not run: REASON -->`:\n" + "\n".join(missed))
