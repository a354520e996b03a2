"""Migration: a stream that survives its backend.

When a streamed answer's backend fails after output reached the client (the engine
crashed or was killed, the connection was reset, an idle or total timeout), an eligible
stream is continued on another backend of the same model instead of ending with an
error event: the continuation is the request with the text already relayed as the start
of the answer (the API's adapter builds it: :meth:`gateway.apis.base.Api.continuation`),
routed, attempted and retried like any attempt by the one retry executor
(:func:`gateway.pipeline.attempt.with_retries`, the failed backend excluded), and its
events are relayed into the client's stream rewritten as the original's
(:meth:`~gateway.apis.base.Api.spliced`): one uninterrupted stream, announced by an SSE
comment (``: migrated from A to B``) that SDKs ignore.

The steps call in here at three points:

| when | call | caller |
|---|---|---|
| a stream's first bytes go to the client | :func:`scan_for` | the relay's start (:mod:`~gateway.pipeline.relay`) |
| an attempt failed after bytes reached the client | :func:`prepare` | the retry loop |
| the request is counted, whatever its end | :func:`settle` | :func:`gateway.pipeline.settlement.finish` |

Eligible: a streamed request of an API that says it can be continued
(:meth:`~gateway.apis.base.Api.continuable`), on the gateway's own data plane, not a
disaggregated one, with ``migration`` allowing its model a continuation. Only an eligible
stream's bytes are kept (its scan's ``kept``: a list of the reads, no copy), and only
while it is open (a 10,000-token answer keeps about 2.5 MB), up to
``migration.max_kept_bytes`` (:class:`KeptReads`); at a failure
they are read for the text relayed (:meth:`~gateway.apis.base.Api.relayed_text`), and a
stream is not continued when half an event reached the client, when what was relayed is
not plain text (a tool call, reasoning) or no token of ``max_tokens`` is left.

The usage ledger charges what the engines did: each leg's prompt and the tokens it
relayed, and the last leg's own usage (:func:`settle`); the client's usage counts the
original prompt and the whole answer.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import orjson

from gateway.errors import UpstreamError
from gateway.pipeline import token_continuation
from gateway.pipeline.context import Continuation, RequestContext
from gateway.pipeline.stream_scan import StreamScan, TypedEventScan
from gateway.pipeline.stream_scan import scan_for as plain_scan_for

if TYPE_CHECKING:
    from gateway.apis.base import Api
    from gateway.runtime import GatewayState

log = logging.getLogger("gateway.pipeline")


# the bytes a streamed token's event is assumed to take at most, to bound a stream's bytes by
# its max_tokens (a chat chunk of vLLM or llama.cpp takes about 250)
EVENT_BYTES_MAX = 1024


class KeptReads(list[bytes]):
    """The reads of a stream kept for its continuation, counted against ``room``
    (bytes): past it they are let go and no more are kept (``room`` stays negative),
    so the stream is no longer continued. Used where a stream's ``max_tokens`` does
    not bound its bytes within ``migration.max_kept_bytes`` (:func:`kept_for`); the
    others keep a plain list, whose ``append`` costs nothing more per read."""

    __slots__ = ("room",)

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room

    def append(self, chunk: bytes) -> None:
        if self.room < 0:
            return
        self.room -= len(chunk)
        if self.room < 0:
            self.clear()
        else:
            list.append(self, chunk)


def kept_for(state: GatewayState, ctx: RequestContext) -> list[bytes] | None:
    """The list that keeps the reads of a stream that may be continued: a plain one
    when the stream's ``max_tokens`` bounds its bytes within ``migration.max_kept_bytes``
    (at :data:`EVENT_BYTES_MAX` a token), else a :class:`KeptReads` that counts them;
    ``None`` when nothing may be kept (``max_kept_bytes`` 0)."""
    room = state.cfg.migration.max_kept_bytes
    if room <= 0:
        return None
    max_tokens = ctx.parsed.max_tokens
    if max_tokens is not None and max_tokens * EVENT_BYTES_MAX <= room:
        return []
    return KeptReads(room)


def overflowed(kept: list[bytes]) -> bool:
    """Whether ``kept`` let its reads go (:class:`KeptReads` past its room)."""
    return isinstance(kept, KeptReads) and kept.room < 0


class Splice:
    """What the scan of a continuation adds to its API's scan (:class:`SpliceScan`,
    :class:`TypedSpliceScan`): its own bytes are scanned by the API's scan for its own
    usage and end and kept for a further continuation, as an eligible stream's are;
    the bytes relayed are its events rewritten into the client's stream
    (:meth:`Api.spliced`), whole lines only, after ``prefix`` (the migration's
    comment). An event the API drops goes with its ``event:`` line and blank line.
    (Not slotted: a continuation's scan is rare.)"""

    api: Api
    head: dict[str, Any]
    prompt_tokens: int | None
    tokens: int
    prefix: bytes
    echo: str
    pending: bytes
    held: bytes
    drop_blank_line: bool
    final: dict[str, Any] | None

    def _start(self, api: Api, m: Continuation, prefix: bytes) -> None:
        self.api, self.head, self.prompt_tokens, self.tokens = api, m.head, m.prompt_tokens, m.tokens
        self.echo = m.text  # the text relayed before, which the engine may send again (Api.spliced)
        self.prefix = prefix
        self.final: dict[str, Any] | None = None
        self.pending = self.held = b""
        self.drop_blank_line = False

    def feed(self, chunk: bytes) -> bytes:
        out = super().feed(chunk)  # type: ignore[misc]
        if self.pending:
            out = self.pending + out
        nl = out.rfind(b"\n") + 1
        self.pending = out[nl:]
        return self._rewritten(out[:nl]) if nl else b""

    def flush(self) -> bytes:
        super().flush()  # type: ignore[misc]  # a partial last line is dropped: it cannot be rewritten
        self.pending = b""
        return b""

    def _typed(self, events: list[dict[str, Any]]) -> bytes:
        """``events`` as typed SSE events; the last one that carries a response with its
        usage is the answer's (``final``, as :class:`TypedEventScan` keeps it)."""
        out = []
        for e in events:
            response = e.get("response")
            if isinstance(response, dict) and response.get("usage") is not None:
                self.final = e
            out.append(b"event: %s\ndata: %s\n\n" % (str(e.get("type", "")).encode(), orjson.dumps(e)))
        return b"".join(out)

    def _rewritten(self, lines: bytes) -> bytes:
        out = []
        for line in lines.splitlines(keepends=True):
            if self.drop_blank_line:
                self.drop_blank_line = False
                if not line.strip():
                    continue
            if line.startswith(b"event:"):  # a typed event's name: goes out with its data, or not at all
                self.held = line
                continue
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                try:
                    event = orjson.loads(line[5:])
                except orjson.JSONDecodeError:
                    event = None
                if isinstance(event, dict):
                    echo = self.echo
                    if echo and self.api.relayed_text(event):  # the continuation's first text
                        self.echo = ""
                    spliced = self.api.spliced(event, self.head, self.prompt_tokens, self.tokens, echo)
                    if spliced is None or isinstance(spliced, list):  # dropped, or typed events instead
                        self.drop_blank_line = True
                        self.held = b""
                        if spliced:
                            out.append(self._typed(spliced))
                        continue
                    line = b"data: " + orjson.dumps(spliced) + b"\n"
            elif line.startswith(b"data:") and not self.api.relays_done:  # a client API without [DONE]
                self.drop_blank_line = True
                continue
            if self.held:
                out.append(self.held)
                self.held = b""
            out.append(line)
        data = b"".join(out)
        if data and self.prefix:
            data, self.prefix = self.prefix + data, b""
        return data


class SpliceScan(Splice, StreamScan):
    """The scan of a continuation of a stream that ends with ``data: [DONE]``."""

    def __init__(self, withhold: bool, api: Api, m: Continuation, prefix: bytes, kept: list[bytes] | None) -> None:
        StreamScan.__init__(self, withhold)
        self.kept = kept
        self._start(api, m, prefix)


class TypedSpliceScan(Splice, TypedEventScan):
    """The scan of a continuation of a stream of typed events (Messages)."""

    def __init__(self, api: Api, m: Continuation, prefix: bytes, kept: list[bytes] | None) -> None:
        TypedEventScan.__init__(self, api)
        self.kept = kept
        self._start(api, m, prefix)


def scan_for(state: GatewayState, ctx: RequestContext) -> StreamScan:
    """The scan of the stream whose first bytes are going to the client now: a
    continuation's (:class:`SpliceScan`, counted and logged as a migration here), or the
    plain scan of its API, which keeps the bytes read (``kept``) when the stream may be
    continued."""
    parsed = ctx.parsed
    m = ctx.migration
    if m is not None and m.continuing:
        return _continued(state, ctx, m)
    scan = plain_scan_for(parsed.api, not parsed.include_usage)
    api = parsed.api
    if state.cfg.migration.limit(ctx.model) and api.continuable(ctx.data or parsed.data) and \
            (ctx.request is None or not ctx.request.remote_prefill) and \
            (api.continues_text or ctx.model in state.core.tokenizers):
        scan.kept = kept_for(state, ctx)
    return scan


def prepare(state: GatewayState, ctx: RequestContext, err: UpstreamError, backend: str) -> bool:
    """The attempt on ``backend`` failed with ``err`` after bytes of its stream reached
    the client: make ``ctx.body`` the continuation's request and return ``True`` when
    the stream may be continued elsewhere (the retry loop then routes it like any
    attempt), else ``False`` (it ends with an error event). A continuation attempt that
    failed before its first byte keeps the request made for it."""
    m = ctx.migration
    if m is not None and m.continuing:
        return True
    scan = ctx.scan
    if scan is None or scan.kept is None or overflowed(scan.kept):
        return False
    if scan.tail and not scan.withhold and not isinstance(scan, Splice):  # half an event reached the client
        return False
    if m is None:
        m = ctx.migration = Continuation(state.cfg.migration.limit(ctx.model))
    if m.used >= m.limit:
        return False
    api = ctx.parsed.api
    relayed = _relayed(m.leg or api, scan.kept)
    if relayed is None:
        return False
    text, tokens, head, usage, ids, prompt_ids = relayed
    data = ctx.data or ctx.parsed.data
    prompt, cached, completion = (m.leg or api).counts(usage) if usage is not None else (None, None, None)
    if completion is not None:  # the engine reported usage on every event: exact counts
        tokens = completion
    body: dict[str, Any] | None
    token_path = token_continuation.by_token_ids(state, ctx, m, data, text, tokens, ids, prompt_ids)
    if token_path is not None:
        body, gen, tokens, m.resent = token_path
        if prompt is None and m.prompt_ids is not None:  # this leg's prompt, exactly
            prompt = len(m.prompt_ids) + len(m.ids)
        m.ids += gen
        m.leg = api.token_leg
    elif m.leg is None:
        body = api.continuation(data, m.text + text, m.tokens + tokens)
        m.resent = "text"
    else:  # continued by token ids before: no text continuation can follow
        body = None
    if body is None:
        return False
    if not m.head:
        m.head = head
        if prompt is not None:
            m.prompt_tokens = prompt
    if prompt is None:
        estimate = ctx.estimate.prompt_tokens if ctx.estimate is not None else 0
        prompt = estimate + m.tokens
    m.charged.append((prompt, min(cached or 0, prompt), tokens))
    m.text += text
    m.tokens += tokens
    m.used += 1
    m.source, m.reason, m.continuing = backend, err.reason, True
    ctx.body = orjson.dumps(body)
    return True


def leg_api(ctx: RequestContext) -> Api:
    """The API of the stream ``ctx`` reads now, whose usage it counts: a token
    continuation's (completions), else the client's."""
    m = ctx.migration
    return m.leg if m is not None and m.leg is not None else ctx.parsed.api


def settle(ctx: RequestContext) -> None:
    """Add the legs that ended before the last one to the request's counts
    (``ctx.usage``, ``ctx.tokens``), which hold the last leg's: the ledger's entry and
    the per-key token limit charge what each engine did. A continuation that never sent
    a byte leaves its failed leg's counts where they are."""
    m = ctx.migration
    if m is None:
        return
    legs = m.charged[:-1] if m.continuing else m.charged
    if not legs:
        return
    prompt, cached, completion = ctx.usage or (0, 0, 0)
    for p, c, t in legs:
        prompt, cached, completion = prompt + p, cached + c, completion + t
    ctx.usage = (prompt, cached, completion)
    ctx.tokens = prompt + completion


def _continued(state: GatewayState, ctx: RequestContext, m: Continuation) -> StreamScan:
    """A continuation's first bytes arrived from ``ctx.backend``: count the migration,
    log it, mark its attempt, and return its scan."""
    m.continuing = False
    metrics = state.metrics
    metrics.child(metrics.stream_migrations, ctx.model, m.reason).inc()
    log.info("stream %s migrated from %s to %s after %s (%d tokens relayed, resent as %s)", ctx.request_id, m.source,
             ctx.backend, m.reason, m.tokens, m.resent)
    if ctx.attempts:
        name, started, _ = ctx.attempts[-1]
        ctx.attempts[-1] = (name, started, "continuation")
    comment = b": migrated from %s to %s\n\n" % (m.source.encode(), ctx.backend.encode())
    api = m.leg or ctx.parsed.api
    if api.end_events:
        return TypedSpliceScan(api, m, comment, kept_for(state, ctx))
    return SpliceScan(not ctx.parsed.include_usage, api, m, comment, kept_for(state, ctx))


Relayed = tuple[str, int, dict[str, Any], dict[str, Any] | None, list[int] | None, list[int] | None]


def _relayed(api: Api, kept: list[bytes]) -> Relayed | None:
    """What one leg relayed, read from its bytes ``kept`` (whole lines only): its text,
    its tokens (one per event that carried text), the identity fields of its first
    event, the last usage it reported, and when its engine streamed them
    (``return_token_ids``: vLLM's choice ``token_ids``, and ``prompt_token_ids`` on its
    first chunk, top-level for chat, in the choice for completions) the ids it
    generated (``None`` when an event with text came without them) and the prompt's
    ids (or ``None``); ``None`` when it cannot be continued as text
    (:meth:`Api.relayed_text`) or it had ended (``[DONE]``)."""
    data = b"".join(kept)
    parts: list[str] = []
    tokens = 0
    head: dict[str, Any] = {}
    usage: dict[str, Any] | None = None
    ids: list[int] | None = []
    prompt_ids: list[int] | None = None
    for line in data[: data.rfind(b"\n") + 1].splitlines():
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return None
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(event, dict):
            return None
        api.follow(event, head)
        if isinstance(event.get("usage"), dict):
            usage = event["usage"]
        text = api.relayed_text(event)
        if text is None:
            return None
        choices = event.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        if prompt_ids is None:
            p = event.get("prompt_token_ids", choice.get("prompt_token_ids"))
            prompt_ids = p if token_continuation.id_list(p) else None
        t = choice.get("token_ids")
        if ids is not None and isinstance(t, list) and token_continuation.id_list(t):
            ids.extend(t)
        elif text:
            ids = None
        if text:
            parts.append(text)
            tokens += 1
    return "".join(parts), tokens, head, usage, ids, prompt_ids

