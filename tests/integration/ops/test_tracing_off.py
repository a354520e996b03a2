"""Tracing off (issue 33): a gateway serving a request with the default config loads no
module of OpenTelemetry and sends no ``traceparent``; enabling it without the SDK is a
config error that names the extra. Each check runs in a fresh Python process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


def _env() -> dict[str, str]:
    """This environment, with the repository first on the child's import path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_with_tracing_off_no_opentelemetry_module_is_loaded(tmp_path):
    # a gateway process serving a request with the default config (tracing off)
    script = tmp_path / "serve_one.py"
    script.write_text(
        "import asyncio, sys\n"
        "import openai\n"
        "from tests.support.servers import ScriptedBackend, gateway_config, running_gateway\n"
        "async def main():\n"
        "    be = ScriptedBackend()\n"
        "    async with be.running():\n"
        "        cfg = gateway_config([{'name': 'b', 'url': be.url, 'models': ['m']}])\n"
        "        async with running_gateway(cfg) as gw:\n"
        "            c = openai.AsyncOpenAI(base_url=gw.url + '/v1', api_key='x', max_retries=0)\n"
        "            r = await c.chat.completions.create(model='m', messages=[{'role': 'user', 'content': 'hi'}],\n"
        "                extra_headers={'traceparent': '00-%s-%s-01'})\n"
        "            assert r.choices[0].message.content == 'hello'\n"
        "            await c.close()\n"
        "        assert 'traceparent' not in {k.lower() for k in be.headers[0]}\n"
        "asyncio.run(main())\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'opentelemetry' or m == 'gateway.ops.tracing'))\n"
        % (TRACE_ID, CALLER_SPAN))
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_enabling_tracing_without_the_sdk_is_a_config_error_naming_the_extra(tmp_path):
    # a Python whose import path hides the SDK: validation says what to install
    script = tmp_path / "check.py"
    script.write_text(
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'opentelemetry.sdk' or name.startswith(('opentelemetry.sdk.', 'opentelemetry.exporter')):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from gateway.config import ConfigError, parse_config\n"
        "try:\n"
        "    parse_config({'backends': [{'name': 'b', 'url': 'http://127.0.0.1:1', 'models': ['m']}],\n"
        "                  'tracing': {'enabled': True}})\n"
        "except ConfigError as e:\n"
        "    print(e)\n")
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tracing" in out.stdout and "turbo-gateway[otel]" in out.stdout
