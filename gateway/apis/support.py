"""Which backend serves which API.

Every backend serves every API unless its config says otherwise (``backends[].apis``)
or it answered an API's path with a 404 that is not about the model (the engine has no
such route: an older vLLM without ``/v1/responses``) or with llama.cpp's 501 "This
server does not support ..." (a llama-server started without ``--embeddings`` or
``--reranking``, or with ``--embeddings`` for a generating API). Such a backend is then
left out of that API's routing, its circuit breaker untouched
(:func:`gateway.pipeline.attempt.with_retries`), until the config is reloaded with a
different ``apis`` list or the gateway restarts.
"""

from __future__ import annotations

from collections.abc import Iterable

_NONE: frozenset[str] = frozenset()


class ApiSupport:
    """The backends (names) that do not serve each API (name)."""

    def __init__(self) -> None:
        self.configured: dict[str, set[str]] = {}
        self.learned: dict[str, set[str]] = {}
        self.unserved: dict[str, frozenset[str]] = {}

    def configure(self, backends: Iterable[tuple[str, Iterable[str] | None]], apis: Iterable[str]) -> None:
        """``backends``: (name, the APIs it serves, ``None``: all) from the config, for
        the APIs named ``apis``. What was learned stays, for backends still there."""
        names = set()
        self.configured = {}
        for name, served in backends:
            names.add(name)
            if served is not None:
                for api in set(apis) - set(served):
                    self.configured.setdefault(api, set()).add(name)
        self.learned = {api: s & names for api, s in self.learned.items()}
        self._update()

    def learn(self, api: str, backend: str) -> None:
        """``backend`` answered that it has no route for ``api``."""
        self.learned.setdefault(api, set()).add(backend)
        self._update()

    def unserved_by(self, api: str) -> frozenset[str]:
        """The backends that do not serve ``api``."""
        return self.unserved.get(api, _NONE)

    def _update(self) -> None:
        self.unserved = {api: frozenset(self.configured.get(api, set()) | self.learned.get(api, set()))
                         for api in self.configured.keys() | self.learned.keys()}
