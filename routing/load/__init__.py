"""Token-level load of each backend, and the speeds learned from what it served.

For every backend the gateway keeps its queued prefill tokens, running decode streams
and KV tokens in use, corrected by the engine's own metrics, and learns its speeds
online (DESIGN.md section 3, "Token-level load"). One module per concept:

- :mod:`routing.load.accounting`: :class:`BackendLoad` (queues, running streams, KV in
  use, drift corrections from the engine's metrics, a LoRA adapter's wait) and
  :class:`RequestLoad`, one request's share of it, released exactly once;
- :mod:`routing.load.learned_speeds`: the TTFT and inter-token-latency lines a backend
  is learned to follow, their priors (hint, engine, pool peers, default) and the
  engine's own prefill rate (:class:`~routing.load.learned_speeds.LearnedSpeeds`, the
  base of :class:`BackendLoad`);
- :mod:`routing.load.speed_fit`: :class:`DecayedLinearFit`, the online least-squares
  fit with forgetting behind each learned line;
- :mod:`routing.load.reports`: what other sources report of a backend's load: the
  other gateway replicas (:class:`RemoteLoad`) and the engine's metrics
  (:class:`EngineSample`).
"""

from routing.load.accounting import BackendLoad, RequestLoad
from routing.load.reports import EngineSample, RemoteLoad
from routing.load.speed_fit import DecayedLinearFit

__all__ = ["BackendLoad", "DecayedLinearFit", "EngineSample", "RemoteLoad", "RequestLoad"]
