"""How the gateway serves its clients: where it listens (``listen``, the endpoint
picker), pools, what a request may carry (``limits``), the life cycle and
streaming keep-alives."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    field_validator,
)

from gateway.config.base import PositiveSeconds, Strict


class Pool(Strict):
    """A named group of backends with a role (``mixed``, ``prefill`` or ``decode``)."""

    name: str = Field(description="The pool's name, as `backends[].pool` and `routing.canaries[]` give it.")
    role: Literal["mixed", "prefill", "decode"] = Field(
        "mixed", description="`mixed` serves whole requests; `prefill` takes long uncached prompts (the "
        "prefill leg when a `decode` pool exists too); `decode` takes the decode leg of a disaggregated "
        "request.")


class EndpointPicker(Strict):
    """The gateway as the endpoint picker (EPP) of the Kubernetes Gateway API Inference
    Extension: Envoy's ``ext_proc`` filter asks it, over gRPC, which backend takes each
    request (:mod:`gateway.epp.picker`; protocol: ``docs/proposals/004-endpoint-picker-protocol``
    in kubernetes-sigs/gateway-api-inference-extension)."""

    enabled: bool = Field(False, description="Serve the ext_proc gRPC API; `--epp` sets it.")
    host: str | None = Field(None, description="gRPC listen address (default: `listen.host`).")
    port: int = Field(9002, ge=0, le=65535, description="gRPC listen port; `--grpc-port` overrides it.")
    response_body: bool = Field(
        True, description="Read each response's body (Envoy sends every chunk over gRPC): the first "
        "token's time and the final `usage` teach the load model as behind the gateway's own data "
        "plane. `false`: one gRPC message per response instead of one per chunk, and the load model "
        "learns only from response status, stream end and the engines' scraped metrics (no TTFT, ITL "
        "or token counts from these requests; see docs/endpoint-picker.md).")
    fallback_endpoints: int = Field(
        2, ge=0, le=16, description="Endpoints listed after the chosen one, soonest estimated TTFT first, "
        "for Envoy to retry on when the chosen one fails before answering.")
    pass_through_paths: list[str] = Field(
        [], description="Paths besides the ones the picker serves (every API of docs/apis/, `GET /v1/models`, "
        "the stored responses and conversations, `/health`, `/ready`) that Envoy may pass on to a backend, e.g. "
        "`/version`: each request is still "
        "authenticated, counted against its key's request rate and held to `limits.engine_fields`, and "
        "goes to the ready backend with the fewest requests in flight with the backend's own key. Every "
        "other path is refused with 404 `unknown_route`. Paths are matched after normalisation "
        "(percent-decoding, `//`, a trailing `/`), so give them in that form.")

    @field_validator("pass_through_paths")
    @classmethod
    def _canonical_paths(cls, v: list[str]) -> list[str]:
        from gateway.paths import canonical_path

        for p in v:
            if canonical_path(p) != p or p == "/":
                raise ValueError(f"{p!r} is not a normalised path (give it as {canonical_path(p)!r})"
                                 if p != "/" else "'/' would pass every path on")
        return v


class Listen(Strict):
    """Where the gateway listens, and on which server protocol."""

    host: str = Field("127.0.0.1", description="Listen address; `--host` overrides it.")
    port: int = Field(8080, ge=0, le=65535, description="Listen port (0: any free port); `--port` overrides it.")
    fast_path: bool = Field(
        True, description="Serve plain `POST /v1/chat/completions` and `/v1/completions` on the lean "
        "HTTP/1.1 data-plane protocol; every other request (another path, a body coding, `Expect`, "
        "HTTP/1.0, an unusual head) is handed to aiohttp's server unchanged. `false`: aiohttp serves "
        "everything.")
    epp: EndpointPicker = Field(
        EndpointPicker(), description="Also serve as the endpoint picker behind Envoy (gRPC ext_proc); "
        "`/metrics` and the admin API stay on HTTP.")
    head_timeout_s: PositiveSeconds = Field(
        10.0, description="A request head (request line and headers) must arrive whole within this long of "
        "its first byte (of the connection's opening, for its first request); else the connection is "
        "closed. Both server stacks.")
    body_timeout_s: PositiveSeconds = Field(
        10.0, description="A request body gets this long, plus its length at `body_min_bytes_per_s`, to "
        "arrive whole once its head did; else the connection is closed. Both server stacks.")
    body_min_bytes_per_s: int = Field(
        16384, gt=0, description="The slowest body upload accepted on average (see `body_timeout_s`): at the "
        "default, a 1 MiB body gets 10 + 64 s.")
    keepalive_timeout_s: PositiveSeconds = Field(
        75.0, description="An idle keep-alive connection (no request in flight or arriving) is closed after "
        "this long. Both server stacks.")
    max_connections: int = Field(
        8192, ge=1, description="Client connections this process holds open at once (also bounded by 3/4 of "
        "its open-file limit). A connection accepted past it closes the one idle longest (no request in "
        "flight), or itself when every one is busy, so trickling clients cannot stop accepting.")
    max_connections_per_address: int = Field(
        1024, ge=1, description="Client connections one client IP address holds open at once in this process; "
        "past it the same rule as `max_connections`, among that address's connections. Behind a proxy or "
        "NAT that shares one address, raise it to `max_connections`.")


ENGINE_FIELDS = ("kv_transfer_params", "priority", "bootstrap_host", "bootstrap_port", "bootstrap_room", "rid",
                 "request_id")


class Limits(Strict):
    """Limits on what a request may carry."""

    max_body_bytes: int = Field(
        32 * 1024 * 1024, gt=0, description="Largest request body accepted; a larger one gets 413.")
    engine_fields: list[str] = Field(
        list(ENGINE_FIELDS),
        description="Body fields that steer an engine and only the gateway may set (a KV connector's peer, "
        "the engine's queue priority, SGLang's bootstrap server, the engine's own request id). A request "
        "carrying one is refused or stripped (`engine_fields_action`) on every path, unless its key was "
        "granted that field (`auth.keys[].engine_fields`). The gateway's own disaggregated serving still "
        "sets `kv_transfer_params` itself.")
    engine_fields_action: Literal["refuse", "strip"] = Field(
        "refuse", description="What a request carrying a field of `engine_fields` gets: `refuse`, a 400 "
        "`unsupported_parameter` naming the field; `strip`, the field is removed and the rest served (the "
        "body is then re-serialized).")


class Lifecycle(Strict):
    """Shutdown and reload."""

    drain_timeout_s: float = Field(
        30.0, ge=0, description="After SIGTERM the gateway stops accepting connections and lets in-flight "
        "requests (streams included) finish for at most this long, then exits 0 (deploy/ assumes 30 s).")
    watch_config_s: float = Field(
        2.0, ge=0, description="How often the config file is checked for changes; a changed file is "
        "reloaded like SIGHUP (0: no watch).")


class Streaming(Strict):
    """Streamed answers whose first token is long in coming.

    Proxies and load balancers in front of a gateway commonly cut a connection that
    carries no byte for 60 s, and a reasoning model can think longer than that before
    its first token. Once ``keepalive_after_s`` has passed since a streamed request
    arrived with no first byte from the backend, the gateway commits the answer: it
    sends the 200 head and an SSE comment (``: keep-alive``, which SSE clients and the
    openai SDKs skip), then another every ``keepalive_every_s`` until the first event.
    The trade-off: attempts go on behind the comments (retries, fallbacks), but the
    status and headers are committed: a final failure ends the stream with an error
    event instead of an error status, and the headers describe the attempt under way
    when the head went out."""

    keepalive_after_s: float | None = Field(
        30.0, gt=0, description="Seconds after a streamed request's arrival, with no first byte from the "
        "backend yet, at which the gateway sends the 200 head and a `: keep-alive` SSE comment. Retries and "
        "fallbacks go on behind the comments, but a final failure then ends the stream with an error event "
        "instead of an error status. Unset: never; the head waits for the first byte.")
    keepalive_every_s: float = Field(
        15.0, gt=0, description="Interval between `: keep-alive` comments until the first event.")
