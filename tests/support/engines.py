"""Real llama.cpp ``llama-server`` processes and a ``python -m gateway`` process in
front of them, for the real-engine suite (``tests/engines/test_real_engine.py``), and real
vLLM CPU servers with KV-cache events on (``tests/engines/test_real_vllm.py``).

Everything runs as child processes on 127.0.0.1 and is stopped by its own PID.

- :func:`llama_server_bin` finds the binary: ``$LLAMA_SERVER_BIN``, else
  ``<cache>/llama-server/llama-server`` (built there by ``scripts/ci_build_llama_server.sh``).
- :func:`tiny_model` generates the random-weight tiny model once into
  ``<cache>/models/`` with ``scripts/make_tiny_model.py`` (numpy, gguf, tokenizers: in the ``test`` extra).
- :class:`LlamaServer` and :class:`GatewayProcess` start one process each and wait
  until it answers.
- :func:`vllm_python` finds the vLLM CPU virtualenv's interpreter: ``$VLLM_CPU_VENV``,
  else ``<cache>/vllm-cpu`` (built there by ``scripts/ci_build_vllm_cpu.sh``);
  :func:`tiny_hf_model` generates the tiny model's Hugging Face checkpoint (with its
  ``tokenizer.json``) once into ``<cache>/models/``; :class:`VLLMServer` starts one
  vLLM OpenAI server with ``--kv-events-config`` (PUB and replay sockets on free
  ports) and waits until it answers.

``<cache>`` is ``$TURBO_GATEWAY_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/turbo-gateway``.

By hand (prints the URLs, Ctrl-C stops everything)::

    python -m tests.support.engines            # two llama-servers + a gateway in front
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
MODEL_ALIAS = "tiny"
# The model's declared context; slots get up to this many tokens, so a long
# generation ends only when asked to (or when the client goes away), not at once.
MODEL_CTX = 65536
ENABLE_HINT = ("llama-server not found: run `bash scripts/ci_build_llama_server.sh` (7-9 min, once) or set "
               "LLAMA_SERVER_BIN")
VLLM_ENABLE_HINT = ("vLLM CPU virtualenv not found: run `bash scripts/ci_build_vllm_cpu.sh` (3.5 GB, a few "
                    "minutes, once) or set VLLM_CPU_VENV")
# vLLM's context for the tiny model (its max_position_embeddings and --max-model-len).
VLLM_MODEL_CTX = 4096
# vLLM's CPU attention needs a block size that is a multiple of 32.
VLLM_BLOCK_SIZE = 32


def cache_dir() -> Path:
    if os.environ.get("TURBO_GATEWAY_CACHE"):
        return Path(os.environ["TURBO_GATEWAY_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "turbo-gateway"


def llama_server_bin() -> Path | None:
    """The llama-server executable, or ``None`` when there is none."""
    env = os.environ.get("LLAMA_SERVER_BIN")
    path = Path(env) if env else cache_dir() / "llama-server" / "llama-server"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def missing_model_deps() -> list[str]:
    """The model generator's modules that cannot be imported (needed once, to
    generate the model)."""
    import importlib.util
    return [m for m in ("numpy", "gguf", "tokenizers") if importlib.util.find_spec(m) is None]


def require_model_deps(suite: str) -> None:
    """Skip the calling test module (``suite``: its name in the message) when the model
    generator's modules are missing."""
    missing = missing_model_deps()
    if missing:
        import pytest
        pytest.skip(f"the {suite} suite needs {', '.join(missing)} to generate its model: pip install -e '.[test]'",
                    allow_module_level=True)


def require_llama_server() -> Path:
    """The llama-server executable and the model generator's modules, or skip the
    calling test module with the hint that builds them."""
    import pytest
    path = llama_server_bin()
    if path is None:
        pytest.skip(ENABLE_HINT, allow_module_level=True)
    require_model_deps("real-engine")
    return path


def tiny_model() -> Path:
    """``model.gguf`` of the tiny random-weight model, generated on first use into
    the cache (atomically: a half-written model is never picked up)."""
    out = cache_dir() / "models" / f"tiny-ctx{MODEL_CTX}"
    return _generated(out, out / "model.gguf", MODEL_CTX, "--no-hf")


def _generated(out: Path, marker: Path, ctx: int, skip: str) -> Path:
    """``marker`` once ``make_tiny_model.py`` wrote the tiny model (context ``ctx``,
    without the format ``skip`` names) into ``out``: generated into a temporary
    directory and renamed, so a half-written model is never picked up."""
    if marker.is_file():
        return marker
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        subprocess.run([sys.executable, str(SCRIPTS / "make_tiny_model.py"), "--out", str(tmp), "--preset", "tiny",
                        "--tokenizer", str(SCRIPTS / "tokenizer.json"), "--ctx", str(ctx), skip],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            os.rename(tmp, out)
        except OSError:  # another process won the race
            if not marker.is_file():
                raise
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"make_tiny_model.py failed:\n{e.stderr}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return marker


def vllm_python() -> Path | None:
    """The Python of a vLLM CPU virtualenv, or ``None`` when there is none (a venv
    under the cache counts only once ``scripts/ci_build_vllm_cpu.sh`` marked it built)."""
    env = os.environ.get("VLLM_CPU_VENV")
    venv = Path(env) if env else cache_dir() / "vllm-cpu"
    py = venv / "bin" / "python"
    if not py.exists() or (not env and not (venv / ".turbo-gateway-built").is_file()):
        return None
    return py


def tiny_hf_model() -> Path:
    """The Hugging Face checkpoint directory of the tiny random-weight model
    (``config.json``, ``model.safetensors``, ``tokenizer.json``, ...), generated on first
    use into the cache, atomically."""
    out = cache_dir() / "models" / f"tiny-hf-ctx{VLLM_MODEL_CTX}"
    return _generated(out, out / "hf" / "model.safetensors", VLLM_MODEL_CTX, "--no-gguf").parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    """``(status, body)``; status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def wait_for(predicate, what: str, timeout_s: float, proc: subprocess.Popen | None = None,
             log: Path | None = None, interval_s: float = 0.05) -> Any:
    """Poll ``predicate()`` until it returns something truthy (returned); a condition
    wait bounded by ``timeout_s``, failing with ``what`` and the log's tail."""
    end = time.monotonic() + timeout_s
    while True:
        v = predicate()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with code {proc.returncode}{_tail(log)}")
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not within {timeout_s} s{_tail(log)}")
        time.sleep(interval_s)


def _tail(log: Path | None, n: int = 30) -> str:
    if log is None or not log.exists():
        return ""
    lines = log.read_text(errors="replace").splitlines()[-n:]
    return f"\n--- {log} (last {len(lines)} lines) ---\n" + "\n".join(lines)


class _Child:
    """A child process stopped by its own PID: SIGTERM, then SIGKILL."""

    proc: subprocess.Popen | None = None
    log: Path

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        os.kill(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class LlamaServer(_Child):
    """One ``llama-server`` on a free loopback port serving ``model`` as ``alias``.

    ``parallel`` slots with continuous batching, ``ctx_per_slot`` tokens each,
    ``--cache-ram 0`` (only the prompts resident in the slots are cached), Prometheus
    ``/metrics`` on, ``/slots`` on.
    """

    def __init__(self, binary: Path, model: Path, log_dir: Path, *, name: str = "llama", alias: str = MODEL_ALIAS,
                 parallel: int = 2, ctx_per_slot: int = 32768, threads: int = 1, extra: list[str] = ()) -> None:
        self.binary, self.model, self.name, self.alias = binary, model, name, alias
        self.parallel, self.ctx_per_slot, self.threads, self.extra = parallel, ctx_per_slot, threads, list(extra)
        self.log = log_dir / f"{name}.log"
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> LlamaServer:
        for attempt in range(3):  # a free port can be taken between probe and bind
            self.port = free_port()
            cmd = [str(self.binary), "-m", str(self.model), "-a", self.alias, "--host", "127.0.0.1",
                   "--port", str(self.port), "-c", str(self.ctx_per_slot * self.parallel), "-np", str(self.parallel),
                   "-t", str(self.threads), "--cache-ram", "0", "--metrics", "--slots", *self.extra]
            with open(self.log, "wb") as logf:
                self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT)
            try:
                wait_for(lambda: http_get(self.url + "/health", 1.0)[0] == 200,
                         f"llama-server {self.name} on {self.url}", timeout_s, self.proc, self.log)
                return self
            except RuntimeError:
                if attempt < 2 and "bind" in self.log.read_text(errors="replace").lower():
                    continue
                raise
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def slots(self) -> list[dict[str, Any]]:
        status, body = http_get(self.url + "/slots")
        assert status == 200, f"GET {self.url}/slots -> {status}: {body[:200]!r}"
        return json.loads(body)

    def busy_slots(self) -> list[int]:
        return [s["id"] for s in self.slots() if s.get("is_processing")]

    def metrics(self) -> dict[str, float]:
        """``llamacpp:*`` samples from ``/metrics`` (no labels on those)."""
        status, body = http_get(self.url + "/metrics")
        assert status == 200, f"GET {self.url}/metrics -> {status}"
        out: dict[str, float] = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out


class VLLMServer(_Child):
    """One vLLM CPU OpenAI server (``python -m vllm.entrypoints.openai.api_server``)
    serving the HF checkpoint ``model`` as ``alias`` on a free loopback port, with
    KV-cache events published on ``kv_events_endpoint`` (ZMQ PUB) and replayed on
    ``kv_replay_endpoint`` (ZMQ ROUTER), topic ``topic``.

    Settings that make vLLM run here (see /work/shared/engines/README.md): both cores
    for the engine (``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``),
    ``kv_cache_gib`` GiB of KV cache, float32, ``--enforce-eager -O0`` (no compilation:
    a much faster start), block size 32, ``--enable-prompt-tokens-details`` (so
    ``usage.prompt_tokens_details.cached_tokens`` is reported). ``num_blocks`` caps
    the KV cache at that many blocks (``--num-gpu-blocks-override``; at least
    ``VLLM_MODEL_CTX / VLLM_BLOCK_SIZE``), so that a test can fill it and see
    evictions. ``VLLM_SERVER_DEV_MODE=1`` serves ``POST /reset_prefix_cache``.
    Stopped by its PID (SIGTERM to its process group, which holds the engine-core
    process it starts, then SIGKILL).
    """

    def __init__(self, python: Path, model: Path, log_dir: Path, *, name: str = "vllm", alias: str = MODEL_ALIAS,
                 topic: str = "kv-events", kv_cache_gib: int = 1, num_blocks: int | None = None,
                 extra: list[str] = ()) -> None:
        self.python, self.model, self.name, self.alias, self.topic = python, model, name, alias, topic
        self.kv_cache_gib, self.num_blocks, self.extra = kv_cache_gib, num_blocks, list(extra)
        self.log = log_dir / f"{name}.log"
        self.port = self.kv_port = self.replay_port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_port}"

    @property
    def kv_replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def start(self, timeout_s: float = 600.0) -> VLLMServer:
        """Start the server and wait until it answers. The first start picks free
        ports, and picks others (up to 3 times) when the engine finds one taken
        meanwhile (a free port is only free until someone binds it); a start after
        :meth:`stop` keeps them (an engine restart: same HTTP, PUB and replay
        addresses, a cold KV cache, event sequence numbers from 0)."""
        first = not self.port
        for attempt in range(3 if first else 1):
            if first:
                self.port, self.kv_port, self.replay_port = free_port(), free_port(), free_port()
            mark = self.log.stat().st_size if self.log.exists() else 0
            try:
                self._launch(timeout_s)
                return self
            except RuntimeError:
                with open(self.log, "rb") as f:
                    f.seek(mark)
                    taken = b"Address already in use" in f.read()
                if not (first and taken and attempt < 2):
                    raise
        raise AssertionError("unreachable")

    def _launch(self, timeout_s: float) -> None:
        # vLLM binds the PUB socket only for a wildcard address (else it connects).
        kv_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.kv_port}",
                     "replay_endpoint": f"tcp://*:{self.replay_port}", "topic": self.topic}
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--served-model-name", self.alias, "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--max-model-len", str(VLLM_MODEL_CTX), "--block-size", str(VLLM_BLOCK_SIZE),
               "--enable-prompt-tokens-details", "--enforce-eager", "-O0",
               "--kv-events-config", json.dumps(kv_config), *self.extra]
        if self.num_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_blocks)]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
        with open(self.log, "ab") as logf:  # a restart (or another try) appends
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        try:
            wait_for(lambda: http_get(self.url + "/health", 1.0)[0] == 200, f"vLLM {self.name} on {self.url}",
                     timeout_s, self.proc, self.log, interval_s=0.5)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGTERM to the server's process group (it and the engine-core process it
        started), then SIGKILL."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """The engine's own token ids of ``prompt`` (vLLM's ``POST /tokenize``)."""
        body = json.dumps({"model": self.alias, "prompt": prompt, "add_special_tokens": add_special_tokens}).encode()
        req = urllib.request.Request(self.url + "/tokenize", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())["tokens"]


class GatewayProcess(_Child):
    """``python -m gateway --config <tmp yaml> --port 0`` in front of ``backends``
    (name -> base URL), each serving ``model`` unless ``models`` (name -> model) names
    its own; waits for the "listening on" line and for ``/ready``."""

    def __init__(self, backends: dict[str, str], work_dir: Path, *, name: str = "gateway",
                 policy: str = "round_robin", model: str = MODEL_ALIAS, models: dict[str, str] | None = None,
                 extra_config: dict[str, Any] | None = None) -> None:
        self.name = name
        self.config = {
            "routing": {"policy": policy},
            "health": {"interval_s": 2},
            "backends": [{"name": n, "url": u, "models": [(models or {}).get(n, model)]} for n, u in backends.items()],
            **(extra_config or {}),
        }
        self.config_path = work_dir / f"{name}.yaml"
        self.log = work_dir / f"{name}.log"
        self.url = ""

    def start(self, timeout_s: float = 30.0) -> GatewayProcess:
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        with open(self.log, "wb") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway", "--config", str(self.config_path), "--port", "0",
                 "--log-level", "warning"],
                cwd=ROOT, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT)
        marker = "turbo-gateway listening on "
        try:
            def listening() -> str | None:
                for line in self.log.read_text(errors="replace").splitlines():
                    if line.startswith(marker):
                        return line[len(marker):].strip()
                return None
            self.url = wait_for(listening, f"gateway {self.name}", timeout_s, self.proc, self.log)
            wait_for(lambda: http_get(self.url + "/ready", 1.0)[0] == 200, f"gateway {self.name} /ready",
                     timeout_s, self.proc, self.log)
        except BaseException:
            self.stop()
            raise
        return self

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples called ``name`` in the gateway's ``/metrics`` whose
        labels include ``labels`` (a label not given is summed over, as ``sum
        without`` it; 0 when none), as :meth:`tests.support.servers.RunningGateway.metric`."""
        from prometheus_client.parser import text_string_to_metric_families
        status, body = http_get(self.url + "/metrics")
        assert status == 200, f"GET {self.url}/metrics -> {status}"
        return sum(s.value for fam in text_string_to_metric_families(body.decode()) for s in fam.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def main() -> int:
    """Start two llama-servers and a gateway in front; print the URLs; Ctrl-C stops."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m tests.support.engines", description=main.__doc__)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=2)
    a = ap.parse_args()
    binary = llama_server_bin()
    if binary is None:
        print(ENABLE_HINT, file=sys.stderr)
        return 1
    model = tiny_model()
    work = Path(tempfile.mkdtemp(prefix="turbo-engines."))
    servers: list[LlamaServer] = []
    gw = None
    try:
        for i in range(a.servers):
            servers.append(LlamaServer(binary, model, work, name=f"llama-{i}", parallel=a.parallel).start())
            print(f"llama-{i}: {servers[-1].url} (pid {servers[-1].pid})", flush=True)
        gw = GatewayProcess({s.name: s.url for s in servers}, work).start()
        print(f"gateway: {gw.url} (pid {gw.pid}); logs and config in {work}", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if gw is not None:
            gw.stop()
        for s in servers:
            s.stop()
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops like Ctrl-C
    sys.exit(main())
