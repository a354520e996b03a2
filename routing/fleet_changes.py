"""What changes the decision core's fleet outside requests: a new config (startup and reload
both go through :meth:`FleetChanges.apply`, so a fleet is built one way), the models an engine
lists in its own ``/v1/models``, a LoRA adapter loaded on demand, an engine's KV capacity and
LoRA activity, a backend that may have restarted with an empty KV cache.

:class:`FleetChanges` is a part of :class:`routing.core.DecisionCore`, which holds the
attributes declared here; the data planes call these methods on the core.
"""

from __future__ import annotations

from routing.backend import BackendSpec, BackendState, LoraActivity, ServedModel
from routing.fleet import Fleet
from routing.kv_event_decoding import KVEventStats
from routing.policies import make_policy
from routing.prefix_index import PrefixIndex
from routing.router import Router
from routing.tokenizer import ModelTokenizer, TokenizeStats


class FleetChanges:
    """The fleet's changes, on the decision core's state (set by ``DecisionCore.__init__``)."""

    fleet: Fleet
    router: Router
    index: PrefixIndex
    kv_stats: dict[str, KVEventStats]
    policy_name: str
    tokenizers: dict[str, ModelTokenizer]
    tokenize_stats: dict[str, TokenizeStats]

    def apply(self, specs: list[BackendSpec], policy: str, canaries: dict[str, tuple[str, str, float]],
              tokenizers: dict[str, ModelTokenizer] | None = None) -> None:
        """Make the fleet ``specs`` (in place, in one synchronous step), with the
        models' own ``tokenizers`` (by model name; see :func:`load_tokenizer`): a backend kept
        by name keeps its live state (in flight, learned speeds, health, breaker,
        draining) under its new spec, a new one starts fresh, a removed one leaves
        routing and the prefix index (its reservations still release cleanly). The
        policy is made anew when its name or the set of backends changed (policies
        may keep per-backend state). Raises ``ValueError`` on duplicate names."""
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"duplicate backend name {dup!r}")
        fleet = self.fleet
        old = fleet.backends
        states: dict[str, BackendState] = {}
        for spec in specs:
            st = old.get(spec.name)
            if st is None:
                st = BackendState(spec)
            else:
                st.spec = spec
                if spec.lora_load_s is not None:
                    st.load.lora_load_s = spec.lora_load_s
            states[spec.name] = st
        changed = set(states) != set(old)
        for name in set(old) - set(states):
            self.router.forget_backend(name)
        fleet.backends = states
        fleet.index_models()
        if policy != self.policy_name or changed:
            self.router.policy = make_policy(policy)
            self.policy_name = policy
        self.router.set_canaries(canaries)
        self.tokenizers = dict(tokenizers or {})
        for model in self.tokenizers:
            self.tokenize_stats.setdefault(model, TokenizeStats())
        for st in states.values():
            self.index.set_capacity(st.name, self.router.capacity_blocks(st))
        for st in states.values():
            size = st.spec.kv_block_size
            before = self.index.engine(st.name)
            self.index.set_engine(st.name, size, st.spec.kv_base_model)
            if size is None:
                self.kv_stats.pop(st.name, None)
            elif before is None or before.block_size != size:
                self.kv_stats[st.name] = KVEventStats()
        for name in set(self.kv_stats) - set(states):
            del self.kv_stats[name]
        self._index_event_backends()

    def _models_changed(self) -> None:
        """A backend's served models changed (discovery, an adapter loaded on demand):
        index them for routing and for the backends' KV events."""
        self.fleet.index_models()
        self._index_event_backends()

    def _index_event_backends(self) -> None:
        """For each model, the backends serving it now (discovered models and adapters
        included) whose KV events are on, by their block size: whose requests get
        token-exact keys and precise lookups (``Router.event_backends``)."""
        events: dict[str, dict[int, list[str]]] = {}
        for st in self.fleet.backends.values():
            size = st.spec.kv_block_size
            if size is None:
                continue
            for model in sorted(st.models()):
                events.setdefault(model, {}).setdefault(size, []).append(st.name)
        self.router.event_backends = events

    # ---- what the data plane learns outside requests ------------------------------------

    def set_kv_capacity(self, backend: BackendState, tokens: int) -> None:
        """``backend``'s KV cache size in tokens, e.g. from an engine's metrics."""
        self.router.set_kv_capacity(backend, tokens)

    def set_served_models(self, backend: BackendState, models: list[ServedModel]) -> bool:
        """What ``backend``'s own ``/v1/models`` lists now (base models and LoRA
        adapters). With ``spec.discover`` set, a model newly listed becomes routable
        there and one no longer listed stops being routed there, at once and without a
        reload; the configured ``spec.models`` stay either way. Returns whether the
        served set changed. A backend no longer in the fleet is ignored."""
        if self.fleet.backends.get(backend.name) is not backend:
            return False
        new = {m.name: m for m in models}
        if new == backend.discovered:
            return False
        before = backend.models()
        backend.discovered = new
        if backend.models() != before:
            self._models_changed()
            return True
        return False

    def adapter_loaded(self, backend: BackendState, adapter: str) -> None:
        """``backend`` loaded LoRA ``adapter`` on demand: it is listed there (with its
        base model) until the next read of the backend's ``/v1/models`` says otherwise."""
        base = backend.adapter_base(adapter)
        listed = dict(backend.discovered or {})
        listed[adapter] = ServedModel(adapter, base)
        backend.discovered = listed
        self._models_changed()

    def set_lora_activity(self, backend: BackendState, activity: LoraActivity | None) -> None:
        """``backend``'s LoRA adapters at work (from its engine metrics), read by the
        LoRA-affinity term of the estimated TTFT (:mod:`routing.load`)."""
        backend.lora = activity

    def backend_restarted(self, backend: BackendState) -> None:
        """``backend`` may have restarted with an empty KV cache: it came back after
        failing its health checks, or its engine's counters went back between two
        scrapes. Its prefix entries, approximate and precise, are dropped (its KV
        capacity in the index stays), and so are its sessions' blocks there."""
        self.router.forget_backend(backend.name)
        self.index.set_capacity(backend.name, self.router.capacity_blocks(backend))
