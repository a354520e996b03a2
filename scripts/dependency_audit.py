"""Audit the installed dependencies for known vulnerabilities (what ``.ci/run`` runs).

Runs ``pip-audit`` over the current environment against the PyPI vulnerability
service (``-s pypi``: the advisories PyPI publishes per release, from the Python
Packaging Advisory Database and GitHub's) and exits:

- 0 when every dependency was audited and none has a known vulnerability that is not
  accepted in ``.ci/audit-accepted`` (one ``ID  until YYYY-MM-DD  reason`` per line;
  an entry past its date stops counting);
- 1 on a known vulnerability (its package, version, id and the versions that fix it
  are printed): raise the dependency's floor in ``pyproject.toml`` to a fixed version,
  or, when no fix exists yet or it does not apply here, accept it with a date;
- 2 when the service answered for no dependency (offline, or a mirror without
  vulnerability data): nothing was audited, so that is no pass. ``TG_AUDIT=warn``
  makes it a warning (exit 0) on runners that cannot reach pypi.org; a vulnerability
  found still fails.

The project itself (installed editable) is skipped: it is the code under audit's
consumer, not a dependency.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ACCEPTED = Path(__file__).resolve().parent.parent / ".ci" / "audit-accepted"


def accepted(path: Path = ACCEPTED, today: datetime.date | None = None) -> dict[str, str]:
    """Vulnerability id -> reason, for the accepted entries not yet past their date."""
    today = today or datetime.datetime.now(datetime.UTC).date()
    out: dict[str, str] = {}
    if not path.exists():
        return out
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split(None, 3)
        if len(parts) < 4 or parts[1] != "until":
            raise SystemExit(f"{path}: `{raw}` is not `ID until YYYY-MM-DD reason`")
        if datetime.date.fromisoformat(parts[2]) >= today:
            out[parts[0]] = parts[3]
    return out


def verdict(report: dict[str, Any], accept: dict[str, str], *, warn_offline: bool) -> tuple[int, list[str]]:
    """The exit status and the lines to print for a ``pip-audit -f json`` report."""
    deps = report.get("dependencies", [])
    found: list[str] = []
    lines: list[str] = []
    audited = 0
    for d in deps:
        if "skip_reason" in d:
            continue
        audited += 1
        for v in d.get("vulns", []):
            ids = [v["id"], *v.get("aliases", [])]
            hit = next((i for i in ids if i in accept), None)
            if hit is not None:
                lines.append(f"accepted: {d['name']} {d['version']} {v['id']} ({accept[hit]})")
                continue
            fixes = ", ".join(v.get("fix_versions") or []) or "none yet"
            found.append(f"{d['name']} {d['version']}: {' / '.join(ids)} (fixed in: {fixes})")
    lines.append(f"dependency audit: {audited} of {len(deps)} packages audited, {len(found)} known vulnerabilities")
    if found:
        return 1, lines + [f"  {x}" for x in found] + [
            "raise the floor in pyproject.toml to a fixed version, or accept it with a date in .ci/audit-accepted"]
    if deps and audited == 0:
        msg = "the vulnerability service answered for no package: nothing was audited"
        return (0, [*lines, f"WARNING: {msg} (TG_AUDIT=warn)"]) if warn_offline else (2, [*lines, f"FAILED: {msg}"])
    return 0, lines


def main() -> int:
    cmd = [sys.executable, "-m", "pip_audit", "-s", "pypi", "-l", "--skip-editable", "-f", "json",
           "--progress-spinner", "off"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        sys.stderr.write(proc.stderr)
        print("dependency audit: pip-audit gave no report", file=sys.stderr)
        return 2
    status, lines = verdict(report, accepted(), warn_offline=os.environ.get("TG_AUDIT") == "warn")
    for line in lines:
        print(line, file=sys.stderr if status else sys.stdout)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
