#!/usr/bin/env bash
# Make sure a llama.cpp `llama-server` binary exists for the real-engine test suite
# (tests/engines/test_real_engine.py); build it into the cache only when it is missing.
#
#   bash scripts/ci_build_llama_server.sh
#
# Where: $LLAMA_SERVER_BIN if set (then nothing is built: it must exist), else
# <cache>/llama-server/llama-server with <cache> = $TURBO_GATEWAY_CACHE, else
# ${XDG_CACHE_HOME:-$HOME/.cache}/turbo-gateway  (the same lookup as tests/support/engines.py).
# The build (scripts/build_llama_server.sh: llama.cpp from the llama-cpp-python sdist on
# PyPI) takes 7-9 minutes on 2 cores and needs python3 + pip, cmake and g++.
# Concurrent runs wait for each other (flock); the binary appears atomically.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if [ -n "${LLAMA_SERVER_BIN:-}" ]; then
  if [ -x "$LLAMA_SERVER_BIN" ]; then echo "llama-server: using LLAMA_SERVER_BIN=$LLAMA_SERVER_BIN"; exit 0; fi
  echo "error: LLAMA_SERVER_BIN=$LLAMA_SERVER_BIN is not an executable file" >&2; exit 1
fi

CACHE=${TURBO_GATEWAY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/turbo-gateway}
OUT="$CACHE/llama-server"
BIN="$OUT/llama-server"
mkdir -p "$CACHE"

usable() { [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; }

exec 9>"$CACHE/.llama-server-build.lock"
flock 9
if usable; then echo "llama-server: using cached $BIN"; exit 0; fi

for tool in cmake g++; do
  command -v "$tool" >/dev/null || { echo "error: building llama-server needs $tool (apt-get install cmake g++)" >&2; exit 1; }
done
echo "llama-server: not in the cache; building it into $OUT (7-9 minutes, once)"
STAGE=$(mktemp -d "$CACHE/llama-server.build.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
bash "$HERE/build_llama_server.sh" "$STAGE"
mkdir -p "$OUT"
[ -d "$STAGE/vocab" ] && rm -rf "$OUT/vocab" && mv "$STAGE/vocab" "$OUT/vocab"
mv -f "$STAGE/llama-server" "$BIN"     # same filesystem: atomic
usable || { echo "error: the freshly built $BIN does not run" >&2; exit 1; }
echo "llama-server: built $BIN"
