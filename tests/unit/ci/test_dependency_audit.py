"""The dependency audit of ``.ci/run`` (scripts/dependency_audit.py): what fails CI and
what does not, on pip-audit reports of the shape ``pip-audit -f json`` writes."""

from __future__ import annotations

import datetime
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("dependency_audit", ROOT / "scripts" / "dependency_audit.py")
assert spec is not None and spec.loader is not None
audit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(audit)

VULN = {"id": "GHSA-9548-qrrj-x5pj", "aliases": ["CVE-2025-53643"], "fix_versions": ["3.12.14"],
        "description": "request smuggling (trailer sections)"}


def report(*deps):
    return {"dependencies": list(deps), "fixes": []}


def test_a_known_vulnerability_fails_and_says_the_fix():
    status, lines = audit.verdict(report({"name": "aiohttp", "version": "3.12.13", "vulns": [VULN]},
                                         {"name": "yarl", "version": "1.9.0", "vulns": []}), {}, warn_offline=True)
    assert status == 1
    assert any("aiohttp 3.12.13" in x and "CVE-2025-53643" in x and "3.12.14" in x for x in lines)


def test_a_clean_audit_passes():
    assert audit.verdict(report({"name": "aiohttp", "version": "3.14.5", "vulns": []}), {}, warn_offline=False)[0] == 0


def test_an_accepted_vulnerability_passes_until_its_date(tmp_path):
    f = tmp_path / "audit-accepted"
    f.write_text("# id until date reason\nCVE-2025-53643 until 2030-01-01 pure-Python parser only; we ship the C one\n")
    acc = audit.accepted(f, today=datetime.date(2029, 12, 31))
    assert audit.verdict(report({"name": "aiohttp", "version": "3.12.13", "vulns": [VULN]}), acc,
                         warn_offline=False)[0] == 0
    assert audit.accepted(f, today=datetime.date(2030, 1, 2)) == {}  # expired: it fails again


def test_nothing_audited_is_no_pass_unless_told():
    offline = report({"name": "aiohttp", "skip_reason": "Dependency not found on PyPI and could not be audited"})
    assert audit.verdict(offline, {}, warn_offline=False)[0] == 2
    assert audit.verdict(offline, {}, warn_offline=True)[0] == 0
