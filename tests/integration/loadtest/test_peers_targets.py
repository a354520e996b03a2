"""The Envoy + endpoint picker targets of ``python -m loadtest.peers`` start, serve through
Envoy to the zero backends, and report the CPU of Envoy and the picker together, so that
the benchmark cannot rot. Behaviour checks only: real processes on 127.0.0.1, bounded
request counts, no timing bound."""

from __future__ import annotations

import pytest

from loadtest import peers, procs

pytestmark = pytest.mark.slow

TARGETS = {p.name: p for p in peers.all_proxies()}


@pytest.fixture(scope="module")
def zeros():
    started = [procs.start_zero(16), procs.start_zero(16)]
    try:
        yield [u for _, u in started]
    finally:
        for p, _ in started:
            procs.stop(p)


@pytest.mark.parametrize("name", ["envoy-epp", "envoy-epp-nobody"])
def test_envoy_epp_target_serves_and_counts_both_processes(name, zeros, tmp_path):
    target = TARGETS[name]
    if target.start is None:
        pytest.skip(target.missing)
    proc, url = target.start(zeros, str(tmp_path), None)
    try:
        tree = procs.tree_pids(proc.pid)
        assert len(tree) >= 3  # the launcher, the picker (python -m gateway --epp) and Envoy
        served0 = peers._served(zeros)
        cpu0 = procs.tree_cpu_seconds(proc.pid)
        whole = peers._run(peers._drive([url], 20, 4, False, 16, timeout_s=60))
        streamed = peers._run(peers._drive([url], 20, 4, True, 16, timeout_s=60, measure_ttft=True))
        cpu = procs.tree_cpu_seconds(proc.pid) - cpu0
        assert (whole.requests, whole.errors) == (20, 0), whole.first_error
        assert (streamed.requests, streamed.errors) == (20, 0), streamed.first_error
        assert len(streamed.ttft_ms) == 20
        # every request reached exactly one backend (the one the picker chose): none twice
        assert sum(peers._served(zeros)) - sum(served0) == 40
        assert cpu > 0
        parts = procs.tree_cpu_by_process(proc.pid)  # what the harness splits the CPU column by
        assert {"loadtest.envoy_epp", "gateway", "envoy"} <= set(parts)
        assert parts["envoy"] > 0 and parts["gateway"] > 0
    finally:
        procs.stop(proc)
    assert proc.returncode == 0  # SIGTERM stops Envoy and the picker and exits cleanly
    for pid in tree[1:]:
        with pytest.raises(OSError):
            procs.tree_cpu_seconds(pid)  # no child outlived the launcher
