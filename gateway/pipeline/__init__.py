"""The request pipeline: how a completion request goes from a server stack to a backend
and back. Read :mod:`~gateway.pipeline.director` first; it calls the others in order.

| module | the step |
|---|---|
| :mod:`~gateway.pipeline.director` | the front door every data plane calls: the request's story in one function |
| :mod:`~gateway.pipeline.context` | :class:`~gateway.pipeline.context.RequestContext` and :data:`~gateway.pipeline.context.Send`: the types every step takes |
| :mod:`~gateway.pipeline.admit` | admission: the batch gate, the caller's limits, the admission queue |
| :mod:`~gateway.pipeline.prompt` | the prompt's estimate and the context-length check |
| :mod:`~gateway.pipeline.prefill` | the prefill leg of a disaggregated request |
| :mod:`~gateway.pipeline.attempt` | route, attempt, retry; one attempt on one backend under its :mod:`~gateway.pipeline.deadlines` |
| :mod:`~gateway.pipeline.retry` | :class:`~gateway.pipeline.retry.Retrier`, the one retry executor (the policy: :mod:`routing.retry`) |
| :mod:`~gateway.pipeline.fallback` | fallback models |
| :mod:`~gateway.pipeline.relay` | the answer to the client: SSE relay (ITL, backpressure, idle/total timer), whole responses, the early answer |
| :mod:`~gateway.pipeline.stream_scan`, :mod:`~gateway.pipeline.headers`, :mod:`~gateway.pipeline.keepalive` | what the relay reads, the headers it sends, the comments before a first event |
| :mod:`~gateway.pipeline.settlement` | what an ended attempt or request teaches and counts; the reservation released once; error answers |
| :mod:`~gateway.pipeline.downstream` | where answers go: one interface, three kinds |

Around it: :mod:`gateway.server.listener` (the listening socket) with :mod:`gateway.server.fast_path` (the
lean HTTP/1.1 protocol) and :mod:`gateway.server.app` (aiohttp, for everything else), which
both call :func:`~gateway.pipeline.director.handle`; :mod:`gateway.upstream.client` and
:mod:`gateway.upstream.connection` (the one upstream HTTP client); :mod:`gateway.errors` (the
error body and the one upstream exception hierarchy); :mod:`gateway.runtime` (what a
running gateway holds) and the decision core, :mod:`routing.core`, the only door into
``routing/``. No module here imports ``gateway.server.app``, ``gateway.server.listener`` or
``gateway.server.fast_path``.
"""  # noqa: E501 - a table, one row a line
