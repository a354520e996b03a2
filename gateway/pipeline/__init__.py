"""The request pipeline: how a completion request goes from a server stack to a backend
and back. Read :mod:`~gateway.pipeline.director` first; it calls the others in order.

| module | the step |
|---|---|
| :mod:`~gateway.pipeline.director` | the front door both server stacks call, then admit -> estimate -> route -> attempt (retry) -> relay -> settle |
| :mod:`~gateway.pipeline.attempt` | one attempt on one backend: send, head and first byte under its :class:`~gateway.pipeline.attempt.Deadlines` |
| :mod:`~gateway.pipeline.retry` | :class:`~gateway.pipeline.retry.RetryPolicy`: which failures retry, backoff, budget, ``Retry-After`` |
| :mod:`~gateway.pipeline.relay` | the answer to the client: SSE relay (scan, ITL, backpressure, idle/total timer), whole responses |
| :mod:`~gateway.pipeline.settle` | what an ended attempt or request teaches and counts; the reservation released once; error answers |
| :mod:`~gateway.pipeline.prefill` | the prefill leg of a disaggregated request |
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
