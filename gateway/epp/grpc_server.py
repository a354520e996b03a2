"""The endpoint picker's gRPC server: Envoy's ``ext_proc`` service (one
:class:`~gateway.epp.picker.EppStream` per call), the access log service of Envoy's
failed upstream attempts (:mod:`gateway.epp.access_log`) and the gRPC health service
(``liveness``, ``readiness``, the ext_proc service name), in the gateway's event loop.
What one stream does is :mod:`gateway.epp.picker`'s.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import grpc
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.epp.access_log import UpstreamAttempts
from gateway.epp.ext_proc import SERVICE
from gateway.epp.picker import EppStream
from gateway.pipeline.downstream import ClientGone

if TYPE_CHECKING:
    from gateway.runtime import GatewayState

log = logging.getLogger("gateway.epp.picker")


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """The ext_proc service: one :class:`EppStream` per call."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def Process(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:  # gRPC's name
        try:
            await EppStream(self.state, context).run()
        except ClientGone:
            pass
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("endpoint picker: unhandled error in a stream")
            await context.abort(grpc.StatusCode.INTERNAL, "the endpoint picker hit an internal error")


class EndpointPicker:
    """The gRPC server: ext_proc and the health service, in the gateway's loop."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(state), self.server)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(UpstreamAttempts(state), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port) and report serving. Returns the
        port. Raises ``OSError`` when the address cannot be bound."""
        try:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as e:
            raise OSError(f"cannot listen on {host}:{port} for gRPC: {e}") from e
        await self.server.start()
        for name in ("", "liveness", "readiness", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def drain(self) -> None:
        """Not ready any more (new streams still served): Envoy's health checks steer away."""
        await self.health.set("readiness", health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace_s: float) -> None:
        """Stop: streams in flight get up to ``grace_s`` seconds to end."""
        await self.drain()
        await self.server.stop(grace_s)
