"""Fleet files: many simulated backends in one YAML file, and the gateway config that
fronts them.

A fleet file (see ``loadtest/fleets/*.yaml``)::

    models: [meta-llama/Llama-3.1-8B-Instruct]   # default `models` of every backend
    speed: 1.0                                   # default speed factor
    host: 127.0.0.1                              # where every backend listens
    pools:                                       # copied into the gateway config
      - {name: mixed, role: mixed}
      - {name: prefill, role: prefill}
    gateway:                                     # optional: merged into the gateway config
      listen: {port: 8080}
      routing: {policy: least_requests}
    backends:
      - name: h100                               # with replicas: h100-0, h100-1, ...
        replicas: 2
        profile: h100-llama3-8b
        pool: mixed                              # gateway pool (default: mixed)
        weight: 1                                # gateway weight (default: 1)
        # ...and any SimBackendConfig field: speed, role, faults, eos_after,
        # profile_overrides, models, port, max_tokens_default

A backend's ``role`` defaults to its pool's role. :func:`gateway_config` writes each
backend's ``hints`` (prefill and single-stream decode rates, KV capacity) from its
profile and speed, in the caller's clock, its ``kv_events`` when it publishes them, and
the ``models.<m>.tokenizer`` of a backend with a ``tokenizer``, so that the gateway
routes on the engines' own KV events with no other config.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from loadtest.sim.spec import ROLES, SimBackendConfig

_FLEET_KEYS = {"models", "speed", "host", "pools", "gateway", "backends"}
_GATEWAY_ONLY = {"pool", "weight", "replicas", "hints"}


@dataclass
class FleetBackend:
    sim: SimBackendConfig
    pool: str
    weight: float
    hints: dict[str, Any] | None = None


@dataclass
class Fleet:
    backends: list[FleetBackend]
    pools: list[dict[str, str]]
    gateway: dict[str, Any]


def parse_fleet(data: Any, where: str = "<fleet>") -> Fleet:
    """Validate a parsed fleet document. Raises ValueError naming the file and field."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a fleet file must be a YAML mapping")
    unknown = sorted(set(data) - _FLEET_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown top-level key(s) {unknown}; known: {sorted(_FLEET_KEYS)}")
    pools = data.get("pools") or [{"name": "mixed", "role": "mixed"}]
    if not isinstance(pools, list) or not all(isinstance(p, dict) and "name" in p for p in pools):
        raise ValueError(f"{where}: `pools` must be a list of {{name, role}}")
    roles = {}
    for p in pools:
        role = p.get("role", "mixed")
        if role not in ROLES:
            raise ValueError(f"{where}: pool {p['name']!r} has role {role!r}; choose one of {ROLES}")
        roles[p["name"]] = role
    gateway = data.get("gateway") or {}
    if not isinstance(gateway, dict):
        raise ValueError(f"{where}: `gateway` must be a mapping")
    raw = data.get("backends")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: `backends` must be a non-empty list")
    defaults = {k: data[k] for k in ("models", "speed", "host") if k in data}
    out: list[FleetBackend] = []
    for i, b in enumerate(raw):
        if not isinstance(b, dict) or "name" not in b:
            raise ValueError(f"{where}: backends[{i}] must be a mapping with a `name`")
        b = dict(b)
        pool = b.pop("pool", "mixed")
        if pool not in roles:
            raise ValueError(f"{where}: backend {b['name']!r} names pool {pool!r}, which is not in `pools`")
        weight = b.pop("weight", 1.0)
        hints = b.pop("hints", None)
        replicas = b.pop("replicas", 1)
        if not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"{where}: backend {b['name']!r}: `replicas` must be an integer >= 1")
        spec = {**defaults, **b}
        spec.setdefault("role", roles[pool])
        for r in range(replicas):
            s = copy.deepcopy(spec)
            if replicas > 1:
                s["name"] = f"{spec['name']}-{r}"
                if s.get("port"):
                    s["port"] = spec["port"] + r
            try:
                cfg = SimBackendConfig.from_dict(s)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{where}: {e}") from None
            out.append(FleetBackend(cfg, pool, float(weight), hints))
    names = [b.sim.name for b in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{where}: duplicate backend names {dup}")
    return Fleet(out, [{"name": p["name"], "role": roles[p["name"]]} for p in pools], gateway)


def load_fleet(path: str | Path) -> Fleet:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"{p}: cannot read fleet file: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: YAML syntax error: {e}") from None
    return parse_fleet(data, str(p))


def profile_hints(cfg: SimBackendConfig) -> dict[str, Any]:
    """Load-model seeds for the gateway from the profile, in the caller's clock:
    prefill tokens/s (GEMM cost only), single-stream decode tokens/s, KV tokens."""
    p = cfg.build_profile()
    return {
        "prefill_tokens_per_s": round(cfg.speed / p.prefill_s_per_token, 1),
        "decode_tokens_per_s": round(cfg.speed / (p.step_overhead_s + p.decode_s_per_seq), 2),
        "kv_capacity_tokens": p.num_gpu_blocks * p.block_size,
    }


def gateway_config(fleet: Fleet, urls: dict[str, str],
                   kv_sources: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The gateway config (``backends.yaml`` format) fronting the running fleet.

    ``kv_sources``: by backend name, where a backend that publishes KV events bound
    them (``{endpoint, replay_endpoint, topic}``, as its ``/kv_event_sources`` says);
    each such backend gets ``kv_events`` with those and its profile's ``block_size``.
    A backend with a ``tokenizer`` makes it its models' ``models.<m>.tokenizer``
    (absolute; a model the fleet's ``gateway:`` section already gives one keeps it)."""
    cfg: dict[str, Any] = copy.deepcopy(fleet.gateway)
    cfg["pools"] = copy.deepcopy(fleet.pools)
    cfg["backends"] = []
    for b in fleet.backends:
        out = {"name": b.sim.name, "url": urls[b.sim.name], "models": list(b.sim.models), "pool": b.pool,
               "weight": b.weight, "hints": b.hints if b.hints is not None else profile_hints(b.sim)}
        src = (kv_sources or {}).get(b.sim.name)
        if src is not None:
            out["kv_events"] = {"endpoint": src["endpoint"], "replay_endpoint": src["replay_endpoint"],
                                "topic": src["topic"], "block_size": b.sim.build_profile().block_size}
        cfg["backends"].append(out)
        if b.sim.tokenizer is not None:
            models = cfg.setdefault("models", {})
            for m in b.sim.models:
                models.setdefault(m, {}).setdefault("tokenizer", str(Path(b.sim.tokenizer).resolve()))
    return cfg


def dump_gateway_config(cfg: dict[str, Any], header: str = "") -> str:
    text = yaml.safe_dump(cfg, sort_keys=False, default_flow_style=None, width=100)
    return (header + text) if header else text
