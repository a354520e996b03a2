"""The usage report's hour window (gateway/ops/admin.py ``usage_report``)."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
from aiohttp.test_utils import make_mocked_request

from gateway.config import Usage
from gateway.ops import admin
from gateway.tenancy.usage_ledger import HOUR_S, UsageLedger


@pytest.mark.parametrize("into_hour_s", [0.5, 1.5, 1800.0, 3599.9])
async def test_the_default_window_includes_the_current_hour_from_its_first_instant(into_hour_s):
    """``until`` defaults to now: the hour that started before it is in the report, also
    within its first second (``until`` was truncated to whole seconds before rounding
    up, so a request counted at h:00:00.5 was missing from a report made then)."""
    now = 1000 * HOUR_S + into_hour_s
    ledger = UsageLedger(clock=lambda: now)
    ledger.record("anonymous", "m", 10, 0, 2, False, 0)
    state = SimpleNamespace(usage=ledger, usage_sync=None,
                            cfg=SimpleNamespace(usage=Usage(retention_days=90)))
    with mock.patch.object(admin.time, "time", lambda: now):
        report = await admin.usage_report(state, None, make_mocked_request("GET", "/admin/usage"))
    assert report["totals"]["requests"] == 1
    assert report["until"] == 1001 * HOUR_S
    with mock.patch.object(admin.time, "time", lambda: now):  # an explicit whole hour stays exclusive
        explicit = make_mocked_request("GET", f"/admin/usage?until={1000 * HOUR_S}")
        report = await admin.usage_report(state, None, explicit)
    assert report["totals"]["requests"] == 0
