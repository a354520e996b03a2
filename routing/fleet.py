"""The fleet view: which backends exist, what they serve and how loaded they are.

A :class:`Fleet` holds one :class:`~routing.backend.BackendState` per configured
backend. Load is changed only through :class:`Reservation` objects, whose
:meth:`Reservation.release` is idempotent, so every exit path of a request (success,
error, timeout, cancel) can call it and the backend's counters move back exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from routing.backend import BackendSpec, BackendState, ServedModel
from routing.load import RequestLoad
from routing.lora import AdapterSets


class RoutingError(Exception):
    """Base class of the errors a routing decision can raise."""


class UnknownModel(RoutingError):
    """No backend in the fleet serves the requested model (maps to HTTP 404)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist or is not served by this gateway.")
        self.model = model


class NoBackendAvailable(RoutingError):
    """The model is known but every backend that serves it is excluded or cooling down
    (maps to HTTP 503).

    ``retry_after_s`` is the time in seconds until the earliest cooling backend becomes
    eligible again, or ``None`` when none will by itself. ``breaker_open``: that
    earliest backend is held back by its open circuit breaker (it failed
    ``failure_threshold`` attempts in a row and is presumed down until a probe says
    otherwise), not by a cool-down it asked for (``Retry-After``) or a short one after
    a refused connection.
    """

    def __init__(self, model: str, retry_after_s: float | None = None, breaker_open: bool = False) -> None:
        super().__init__(f"No backend is currently available for model `{model}`.")
        self.model = model
        self.retry_after_s = retry_after_s
        self.breaker_open = breaker_open


@dataclass(slots=True)
class Reservation:
    """The load one request put on one backend; release it exactly once.

    :meth:`release` may be called any number of times from any exit path: only the
    first call changes the backend's counters.
    """

    backend: BackendState
    request_load: RequestLoad | None = None
    released: bool = field(default=False)
    probe: bool = False  # a half-open circuit breaker's probe
    judged: bool = False  # the breaker heard this attempt's outcome
    adapter: str | None = None  # the LoRA adapter the request runs with there

    def outcome(self, ok: bool, now: float) -> None:
        """Tell the backend's circuit breaker how this attempt went (once)."""
        if self.judged:
            return
        self.judged = True
        if ok:
            self.backend.breaker.success(self.probe)
        else:
            self.backend.breaker.failure(now, self.probe)

    def first_token(self, now: float) -> None:
        """The first token arrived at monotonic time ``now`` (s): the request's prefill
        tokens leave the backend's queue and it counts as a running decode stream."""
        if self.request_load is not None and not self.released:
            self.request_load.first_token(now)

    def release(self, now: float = 0.0, completion_tokens: int | None = None, whole: bool = False) -> bool:
        """Return the reserved load to the backend. Returns ``True`` on the first call,
        ``False`` on later calls (which change nothing). ``completion_tokens``, when
        known, teaches the backend's inter-token latency; a ``whole`` (non-streamed)
        answer teaches its speeds from its total time (:meth:`RequestLoad.finish`)."""
        if self.released:
            return False
        self.released = True
        self.backend.in_flight -= 1
        if self.adapter is not None:
            streams = self.backend.adapter_streams
            n = streams[self.adapter] - 1
            if n:
                streams[self.adapter] = n
            else:
                del streams[self.adapter]
        if self.probe and not self.judged:
            self.judged = True
            self.backend.breaker.abandon(True)
        if self.request_load is not None:
            self.request_load.finish(now, completion_tokens, whole)
        return True


class Fleet:
    """All backends, indexed by name and by model served, and where each LoRA adapter
    is placed (``adapter_sets``, :mod:`routing.lora`).

    Raises :class:`ValueError` on duplicate backend names.
    """

    def __init__(self, specs: list[BackendSpec]) -> None:
        self.backends: dict[str, BackendState] = {}
        self.by_model: dict[str, list[BackendState]] = {}
        self.adapter_sets = AdapterSets()
        for spec in specs:
            if spec.name in self.backends:
                raise ValueError(f"duplicate backend name {spec.name!r}")
            self.backends[spec.name] = BackendState(spec)
        self.index_models()

    def index_models(self) -> None:
        """Rebuild ``by_model`` from every backend's :meth:`BackendState.models`, in
        one synchronous step (backends in config order for each model)."""
        by_model: dict[str, list[BackendState]] = {}
        for st in self.backends.values():
            for model in sorted(st.models()):
                by_model.setdefault(model, []).append(st)
        self.by_model = by_model

    def models(self) -> list[str]:
        """The served model names, sorted."""
        return sorted(self.by_model)

    def describe(self, model: str) -> ServedModel:
        """What the backends serving ``model`` say of it: the base model when it is a
        LoRA adapter on any of them, and the smallest ``max_model_len`` they report
        (``None`` when none does). Raises :class:`UnknownModel`."""
        parent: str | None = None
        lens: list[int] = []
        for b in self.candidates(model):
            parent = parent or b.adapter_base(model)
            n = b.max_model_len(model)
            if n is not None:
                lens.append(n)
        return ServedModel(model, parent, min(lens) if lens else None)

    def context_limit(self, model: str) -> int | None:
        """The longest prompt plus output in tokens that some backend serving ``model``
        takes: the largest ``max_model_len`` they report, or ``None`` when one of them
        (or the model) is unknown, so that nothing is refused on a guess."""
        best = 0
        for b in self.by_model.get(model, ()):
            n = b.max_model_len(model)
            if n is None:
                return None
            best = max(best, n)
        return best or None

    def candidates(self, model: str) -> list[BackendState]:
        """Backends serving ``model``, in config order. Raises :class:`UnknownModel`."""
        try:
            return self.by_model[model]
        except KeyError:
            raise UnknownModel(model) from None

    def reserve(self, backend: BackendState, request_load: RequestLoad | None = None, now: float = 0.0,
                adapter: str | None = None) -> Reservation:
        """Count one more in-flight request on ``backend`` (with its token load, if
        given, and its LoRA ``adapter``, which places the adapter there:
        :meth:`routing.lora.AdapterSets.dispatched`) and return its reservation."""
        backend.in_flight += 1
        backend.dispatched_total += 1
        r = Reservation(backend, request_load, adapter=adapter)
        if adapter is not None:
            backend.adapter_streams[adapter] = backend.adapter_streams.get(adapter, 0) + 1
            backend.sent_adapter(adapter)
            self.adapter_sets.dispatched(adapter, backend, self.backends, now)
        if backend.breaker.state != "closed":
            r.probe = backend.breaker.dispatched(now)
        return r

    def cool_down(self, backend: BackendState, until: float) -> None:
        """Keep ``backend`` out of routing until monotonic time ``until`` (seconds)."""
        if until > backend.cooldown_until:
            backend.cooldown_until = until
