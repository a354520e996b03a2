"""What Envoy tells the endpoint picker about each failed upstream attempt: Envoy's
gRPC access log service (``envoy.service.accesslog.v3.AccessLogService``), fed by the
router's upstream log (:mod:`gateway.epp.envoy_config` renders it, for attempts
answered with a status of 429 or more only, with their ``Retry-After``).

The picker sees only the final answer of a request; when Envoy retried elsewhere, an
earlier attempt's ``Retry-After`` reaches it here: the backend is kept out of routing
for as long as it asked, as on the gateway's own data plane.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from gateway.pipeline.retry import parse_retry_after

if TYPE_CHECKING:
    from gateway.runtime import GatewayState

log = logging.getLogger("gateway.epp.picker")

LOG_NAME = "turbo-gateway-upstream-attempts"
RETRY_AFTER = "retry-after"


class UpstreamAttempts(als_pb2_grpc.AccessLogServiceServicer):
    """The access log service: each logged attempt's ``Retry-After`` cools its backend down."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def StreamAccessLogs(self, request_iterator: Any,  # gRPC's name
                               context: grpc.aio.ServicerContext) -> als_pb2.StreamAccessLogsResponse:
        async for msg in request_iterator:
            for entry in msg.http_logs.log_entry:
                self.attempt(entry)
        return als_pb2.StreamAccessLogsResponse()

    def attempt(self, entry: Any) -> None:
        """One upstream attempt's log entry (``HTTPAccessLogEntry``)."""
        retry_after = parse_retry_after(entry.response.response_headers.get(RETRY_AFTER))
        if retry_after is None:
            return
        addr = entry.common_properties.upstream_remote_address.socket_address
        endpoint = f"{addr.address}:{addr.port_value}"
        state = self.state
        client = next((c for c in state.clients.values() if c.endpoint == endpoint), None)
        if client is None:
            return
        log.info("endpoint picker: backend %s asked for %.1f s (Retry-After)", client.state.name, retry_after)
        state.core.cool_down(client.state, state.loop.time() + retry_after)
