"""An Envoy bootstrap that puts the gateway's endpoint picker in front of a fleet.

``python -m gateway.envoy_config --config backends.yaml [--listen 0.0.0.0:10000]
[--epp 127.0.0.1:9002] [--admin 127.0.0.1:9901] [--fail-open]`` prints the YAML;
:func:`render` returns it as a dict (the tests start a real Envoy from it).

What it sets up, as the Gateway API Inference Extension documents for Envoy:

- a listener whose HTTP filter chain is ``envoy.filters.http.ext_proc`` (the endpoint
  picker over gRPC: request headers, the request body ``FULL_DUPLEX_STREAMED``, the
  response headers, and the response body ``STREAMED`` when ``listen.epp.response_body``;
  the ``upstream.address`` attribute with the response headers) then the router; on
  paths other than the completions' the response phase is skipped (a per-route
  processing mode: the picker follows only a completion's response). The completions'
  mode is set per route too, so that the picker may override it for one stream
  (``allow_mode_override``, which Envoy ignores when the filter's own mode is
  ``FULL_DUPLEX_STREAMED``): an error answer's body, buffered, to classify it;
- routes for what the gateway serves and nothing else: the completions, ``/health``,
  ``/ready``, ``/v1/models`` and the stored responses and conversations (answered by
  the picker), ``listen.epp.pass_through_paths``;
  any other path is Envoy's own 404 with an OpenAI error body, the picker not asked. The
  path is normalised first (``normalize_path``, ``merge_slashes``, escaped slashes
  decoded), as the picker normalises it (:mod:`gateway.paths`);
- the pool: one static cluster with every backend's ``ip:port``, chosen by the
  ``envoy.load_balancing_policies.override_host`` policy from the picker's dynamic
  metadata ``envoy.lb`` / ``x-gateway-destination-endpoint`` (the chosen endpoint, then
  the fallbacks; a retry takes the next one), round robin when the picker gave none
  (only when failing open);
- the gateway's retry and timeout semantics where Envoy has them: retries on connect
  failures, resets before the response (``reset``: also a backend that read the request
  and closed the connection without answering), 429, 502, 503 and 504, at most as many as the
  picker lists fallbacks (and ``retries.max_attempts - 1``), never past the picker's
  list (it sets ``x-envoy-max-retries``); each attempt answered 429 or above logged
  to the picker with its ``Retry-After`` (the router's upstream log, gRPC access log
  service: :mod:`gateway.epp.access_log`); ``timeouts.connect_s``,
  ``timeouts.total_s`` (the route timeout) and ``timeouts.idle_s`` (the stream's idle
  timeout, which Envoy also runs before the first token: no shorter than ``ttft_s``, so
  a first token within ``ttft_s`` is never cut, and a stall after it is cut at the
  longer of the two), ``timeouts.ttft_s`` (the per-try timeout: Envoy stops it once the
  answer's head went on, so it bounds the time to the response head), global values only;
- the picker's message timeout covers the admission queue's wait
  (``admission.queue_timeout_s``): a request may wait there before it is handed off;
- Envoy's own failures (a timeout, no endpoint that answers) answered as the gateway
  answers them: an OpenAI error body and ``x-should-retry: false``
  (``local_reply_config``); a request head must arrive whole within
  ``listen.head_timeout_s`` (``request_headers_timeout``).
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
from typing import Any

import yaml

from gateway.config import GatewayConfig, load_config
from gateway.epp.access_log import LOG_NAME as ATTEMPTS_LOG
from gateway.epp.access_log import RETRY_AFTER
from gateway.epp.ext_proc import (
    ANSWERED_PATHS,
    ANSWERED_PREFIXES,
    COMPLETION_PATHS,
    DESTINATION,
    LB_NAMESPACE,
    SUBSET_NAMESPACE,
    UPSTREAM_ADDRESS,
)
from gateway.errors import SHOULD_RETRY_HEADER, error_body
from gateway.upstream.client import endpoint_of
from routing.core import RETRYABLE_STATUSES

_T = "type.googleapis.com/envoy.extensions"
_NOT_FOUND = error_body("Unknown route: this gateway does not serve this path behind Envoy "
                        "(listen.epp.pass_through_paths lists the paths it passes on).", 404,
                        code="unknown_route").decode()


# Envoy's own failures (its response flags), answered as the gateway answers them: an
# OpenAI error body and ``x-should-retry: false`` (Envoy has retried already; a client
# SDK that retried too would multiply the attempts). Replies of the picker itself
# (ext_proc immediate responses) carry no such flag and pass unchanged.
_LOCAL_REPLIES = (
    # (response flags, status, code, message)
    (["UT"], 504, "timeout", "The backend did not answer within timeouts.total_s (Envoy: %LOCAL_REPLY_BODY%)."),
    (["SI"], 504, "idle_timeout", "The backend's stream went idle past timeouts.idle_s (Envoy: %LOCAL_REPLY_BODY%)."),
    (["UF", "UC", "URX", "UO", "UH", "NC"], 503, "no_backend_available",
     "No backend could serve the request (Envoy: %LOCAL_REPLY_BODY%)."),
)


def _local_reply_config() -> dict[str, Any]:
    """The HTTP connection manager's ``local_reply_config``: each of Envoy's own
    failures (:data:`_LOCAL_REPLIES`) as the gateway's failure answer."""
    mappers = []
    for flags, status, code, message in _LOCAL_REPLIES:
        body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
        mappers.append({
            "filter": {"response_flag_filter": {"flags": flags}},
            "status_code": status,
            "headers_to_add": [{"header": {"key": SHOULD_RETRY_HEADER, "value": "false"},
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
            "body_format_override": {"json_format": body, "content_type": "application/json"}})
    return {"mappers": mappers}


def _address(hostport: str) -> dict[str, Any]:
    host, _, port = hostport.rpartition(":")
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def _seconds(s: float | None) -> str:
    return "0s" if s is None else f"{s:.3f}s"  # Envoy's 0s: no limit


def _cluster(name: str, endpoints: list[str], connect_s: float | None = 1.0, **extra: Any) -> dict[str, Any]:
    return {"name": name, "type": "STATIC", "connect_timeout": _seconds(connect_s or 3600.0),
            "load_assignment": {"cluster_name": name, "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _address(e)}} for e in endpoints]}]}, **extra}


def render(cfg: GatewayConfig, listen: str = "127.0.0.1:10000", epp: str | None = None, admin: str | None = None,
           fail_open: bool = False, backend_urls: dict[str, str] | None = None) -> dict[str, Any]:
    """The Envoy bootstrap (a dict, YAML-ready) for ``cfg``'s backends behind the
    picker at ``epp`` (``host:port``; default ``listen.epp``). ``listen``: Envoy's
    ``host:port``; ``admin``: its admin interface, if any; ``fail_open``: when the
    picker is unreachable Envoy routes round robin instead of answering 500;
    ``backend_urls`` overrides backends' URLs by name. Raises ``ValueError`` for a
    backend without a URL (a simulated one)."""
    pe = cfg.listen.epp
    epp = epp or f"{pe.host or cfg.listen.host}:{pe.port}"
    urls = backend_urls or {}
    endpoints = []
    for b in cfg.backends:
        url = urls.get(b.name) or b.url
        if not url:
            raise ValueError(f"backend {b.name!r} has no url (a simulated backend cannot sit behind Envoy)")
        endpoints.append(endpoint_of(url))
    wait_s = cfg.admission.queue_timeout_s if cfg.admission.max_in_flight_per_backend is not None else 0.0
    # Envoy cannot fail open in FULL_DUPLEX_STREAMED mode (the protocol's): failing open
    # buffers the request body instead, up to the listener's buffer limit
    mode = {"request_header_mode": "SEND", "request_body_mode": "BUFFERED" if fail_open else "FULL_DUPLEX_STREAMED",
            "request_trailer_mode": "SKIP" if fail_open else "SEND", "response_header_mode": "SEND",
            "response_body_mode": "STREAMED" if pe.response_body else "NONE", "response_trailer_mode": "SKIP"}
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": f"{_T}.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "endpoint_picker"}, "timeout": "30s"},
            "failure_mode_allow": fail_open,
            "message_timeout": f"{max(wait_s + 5.0, 5.0):.3f}s",
            # every route the picker sees sets its own mode (below); Envoy lets the picker
            # override a stream's mode (an error answer's body, buffered: ERROR_BODY_MODE)
            # only when the filter's own mode is not FULL_DUPLEX_STREAMED
            "processing_mode": {**mode, "request_body_mode": "BUFFERED", "request_trailer_mode": "SKIP"},
            "allow_mode_override": True,
            # the picker sets x-envoy-max-retries: Envoy retries on its listed endpoints only
            "mutation_rules": {"allow_envoy": True},
            "response_attributes": [UPSTREAM_ADDRESS],
            "metadata_options": {"forwarding_namespaces": {"untyped": [LB_NAMESPACE, SUBSET_NAMESPACE]},
                                 "receiving_namespaces": {"untyped": [LB_NAMESPACE]}},
        },
    }
    # each upstream attempt answered 429 or above is logged to the picker with its
    # Retry-After (gateway/epp/access_log.py): the picker sees only a request's final
    # answer, and an attempt Envoy retried past must still keep its backend out of routing
    attempts_log = {
        "name": "envoy.access_loggers.http_grpc",
        "filter": {"status_code_filter": {"comparison": {
            "op": "GE", "value": {"default_value": 429, "runtime_key": "turbo_gateway.attempt_log_min_status"}}}},
        "typed_config": {
            "@type": f"{_T}.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {"log_name": ATTEMPTS_LOG, "transport_api_version": "V3", "buffer_size_bytes": 0,
                              "grpc_service": {"envoy_grpc": {"cluster_name": "endpoint_picker"}}},
            "additional_response_headers_to_log": [RETRY_AFTER]}}
    router = {"name": "envoy.filters.http.router",
              "typed_config": {"@type": f"{_T}.filters.http.router.v3.Router", "upstream_log": [attempts_log]}}
    t = cfg.timeouts
    route: dict[str, Any] = {
        "cluster": "pool", "timeout": _seconds(t.total_s),
        "retry_policy": {"retry_on": "connect-failure,refused-stream,reset-before-request,reset,retriable-status-codes",
                         "retriable_status_codes": sorted(RETRYABLE_STATUSES),
                         "num_retries": min(pe.fallback_endpoints, cfg.retries.max_attempts - 1)}}
    if t.ttft_s is not None:
        # Envoy's per-try timeout stops counting once the answer's head went on to the
        # client: it is a time to the response head, retried (``reset``) on the next endpoint
        route["retry_policy"]["per_try_timeout"] = _seconds(t.ttft_s)
    if t.idle_s is not None:
        # Envoy's route idle timer runs from the request's start, before the first token
        # too, where the gateway's own data plane waits up to ttft_s: never cut sooner
        route["idle_timeout"] = _seconds(t.idle_s if t.ttft_s is None else max(t.idle_s, t.ttft_s))
    # the picker follows the response only of a completion (its status, served endpoint,
    # first token and usage settle it): any other request is picked in its request phase,
    # so on other paths Envoy skips the response phase (no response messages, no answers)
    others = {"envoy.filters.http.ext_proc": {
        "@type": f"{_T}.filters.http.ext_proc.v3.ExtProcPerRoute",
        "overrides": {"processing_mode": {**mode, "response_header_mode": "SKIP", "response_body_mode": "NONE"}}}}
    # only what the gateway serves is routed (each path also with a trailing "/", which
    # the picker matches the same): the completions; what the picker answers itself; the
    # operator's pass-through paths. Anything else is Envoy's own 404, the picker not asked.
    def served(path: str, per_route: dict[str, Any] | None, prefix: bool = False) -> dict[str, Any]:
        regex = re.escape(path) + ("/.+" if prefix else "/?")
        r = {"match": {"safe_regex": {"regex": regex}}, "route": copy.deepcopy(route)}
        if per_route is not None:
            r["typed_per_filter_config"] = per_route
        return r

    completions = {"envoy.filters.http.ext_proc": {
        "@type": f"{_T}.filters.http.ext_proc.v3.ExtProcPerRoute", "overrides": {"processing_mode": mode}}}
    routes = [served(path, completions) for path in COMPLETION_PATHS]
    routes += [served(path, others) for path in (*ANSWERED_PATHS, *pe.pass_through_paths)]
    routes += [served(path, others, prefix=True) for path in ANSWERED_PREFIXES]
    routes.append({"match": {"prefix": "/"}, "direct_response": {"status": 404, "body": {"inline_string": _NOT_FOUND}},
                   "typed_per_filter_config": {"envoy.filters.http.ext_proc": {
                       "@type": f"{_T}.filters.http.ext_proc.v3.ExtProcPerRoute", "disabled": True}},
                   "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"},
                                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]})
    hcm = {"@type": f"{_T}.filters.network.http_connection_manager.v3.HttpConnectionManager",
           "stat_prefix": "inference", "stream_idle_timeout": "0s",
           # the path is normalised before routing and before the picker sees it, as the
           # picker and the gateway's own stacks normalise it (gateway/paths.py)
           "normalize_path": True, "merge_slashes": True,
           "path_with_escaped_slashes_action": "UNESCAPE_AND_FORWARD",
           "preserve_external_request_id": True,  # the caller's x-request-id, as the gateway keeps it
           # a request head must arrive whole within listen.head_timeout_s, as on the gateway's own stacks
           "request_headers_timeout": _seconds(cfg.listen.head_timeout_s),
           "local_reply_config": _local_reply_config(),
           "route_config": {"virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": routes}]},
           "http_filters": [ext_proc, router]}
    override_host = {"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": f"{_T}.load_balancing_policies.override_host.v3.OverrideHost",
            # the metadata only: the header names the first endpoint again, and the
            # policy tries every source's endpoints in turn
            "override_host_sources": [{"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION}]}}],
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.round_robin",
                "typed_config": {"@type": f"{_T}.load_balancing_policies.round_robin.v3.RoundRobin"}}}]},
        }}}
    h2 = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": f"{_T}.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}}}}
    out: dict[str, Any] = {"static_resources": {
        "listeners": [{"name": "inference", "address": _address(listen),
                       **({"per_connection_buffer_limit_bytes": cfg.limits.max_body_bytes} if fail_open else {}),
                       "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                       "typed_config": hcm}]}]}],
        "clusters": [_cluster("endpoint_picker", [epp], typed_extension_protocol_options=h2),
                     _cluster("pool", endpoints, t.connect_s, load_balancing_policy={"policies": [override_host]})],
    }}
    if admin:
        out["admin"] = {"address": _address(admin)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gateway.envoy_config", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="path to backends.yaml")
    ap.add_argument("--listen", default="127.0.0.1:10000", help="Envoy's listener, host:port")
    ap.add_argument("--epp", help="the endpoint picker's gRPC host:port (default: listen.epp)")
    ap.add_argument("--admin", help="Envoy's admin interface, host:port (default: none)")
    ap.add_argument("--fail-open", action="store_true", help="route round robin when the picker is unreachable")
    args = ap.parse_args(argv)
    try:
        doc = render(load_config(args.config), args.listen, args.epp, args.admin, args.fail_open)
    except Exception as e:  # noqa: BLE001 - a config error or a backend Envoy cannot reach
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        yaml.safe_dump(doc, sys.stdout, sort_keys=False)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader had enough (`... | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush writes nowhere
    return 0


