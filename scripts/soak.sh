#!/usr/bin/env bash
# Soak run (not in CI): a simulated fleet with faults injected (errors, hangs, a
# backend that crashes and comes back every minute, streams cut mid-way, a slow drip),
# mixed streamed load through one gateway for DURATION seconds (default 600), then a
# report: requests served, failures by kind, and the gateway's memory at start and end.
#
#   bash scripts/soak.sh                # 10 minutes
#   DURATION=60 RATE=10 bash scripts/soak.sh
#
# Needs the venv (`pip install -e .`). Everything runs on 127.0.0.1 and is stopped by
# PID at the end; the work directory is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-600}
RATE=${RATE:-20}
PORT=${PORT:-18080}
WORK=$(mktemp -d -t tg-soak-XXXX)
echo "soak: ${DURATION}s at ${RATE} req/s, work dir ${WORK}"

cat > "$WORK/fleet.yaml" <<EOF
models: [demo-model]
speed: 10.0
gateway:
  listen: {port: ${PORT}}
  timeouts: {ttft_s: 5, idle_s: 5}
  breaker: {failure_threshold: 3, open_s: 5}
  admission: {max_in_flight_per_backend: 64, queue_timeout_s: 10}
  routing: {scrape_interval_s: 2}
backends:
  - {name: steady, replicas: 2, profile: demo}
  - {name: flaky, profile: demo, faults: {error_rate: 0.05, error_status: 503, hang_rate: 0.02, seed: 1}}
  - {name: crashy, profile: demo, faults: {crash_after_s: 30, crash_down_s: 5, crash_every_s: 60}}
  - {name: cutter, profile: demo, faults: {close_after_chunks: 40, drip_s: 0.005, rate_limit_rate: 0.02, retry_after_s: 1}}
EOF

python -m loadtest.sim --fleet "$WORK/fleet.yaml" --write-gateway-config "$WORK/gw.yaml" \
    > "$WORK/fleet.out" 2> "$WORK/fleet.err" &
FLEET=$!
for _ in $(seq 100); do [ -s "$WORK/gw.yaml" ] && break; sleep 0.2; done
python -m gateway --config "$WORK/gw.yaml" --log-level warning 2> "$WORK/gateway.err" &
GW=$!
cleanup() { kill -TERM "$GW" 2>/dev/null || true; wait "$GW" 2>/dev/null || true;
            kill -TERM "$FLEET" 2>/dev/null || true; wait "$FLEET" 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq 300); do curl -sf "http://127.0.0.1:${PORT}/ready" > /dev/null && break; sleep 0.2; done
rss() { awk '/VmRSS/ {print $2 " kB"}' "/proc/$GW/status"; }
RSS_START=$(rss)

python -m loadtest run --target "http://127.0.0.1:${PORT}" --out "$WORK/results" --workload fixed \
    --input-len 256 --output-len 64 --rate "$RATE" --duration "$DURATION" --request-timeout 60 --no-plots --quiet \
    || echo "(the load run exited non-zero: see $WORK/results)"

RSS_END=$(rss)
curl -s "http://127.0.0.1:${PORT}/metrics" > "$WORK/metrics.txt"
echo
echo "== requests by status (turbo_gateway_requests_total)"
grep '^turbo_gateway_requests_total' "$WORK/metrics.txt" \
    | sed -E 's/.*status="([0-9]+)".*\} ([0-9.e+]+)/\1 \2/' | awk '{s[$1]+=$2} END {for (k in s) printf "  %s %d\n", k, s[k]}'
echo "== upstream failures by kind (turbo_gateway_upstream_errors_total)"
grep '^turbo_gateway_upstream_errors_total' "$WORK/metrics.txt" \
    | sed -E 's/.*reason="([^"]+)".*\} ([0-9.e+]+)/\1 \2/' | awk '{s[$1]+=$2} END {for (k in s) printf "  %s %d\n", k, s[k]}'
echo "== failures after the first byte, retries, breaker openings, admission refusals"
grep -E '^turbo_gateway_(stream_errors_total|retries_total|backend_breaker_opened_total|admission_rejected_total)' \
    "$WORK/metrics.txt" | sed 's/^/  /'
echo "== in flight at the end (must be 0)"
grep '^turbo_gateway_backend_in_flight' "$WORK/metrics.txt" | sed 's/^/  /'
echo "== gateway memory (RSS): start ${RSS_START}, end ${RSS_END}"
echo "== load report: $WORK/results"
