"""Sessions in the router's decisions (:class:`SessionRouting`, a part of
:class:`routing.router.Router`): where a session's turn is counted as cached, where it
is placed and why it moved, what the engines' reported hits teach, and what the
sessions waiting at a backend are worth to it: the KV they probably still hold there
and how much of it is likely asked for again (:meth:`SessionRouting.kv_turnover`).

The eviction cost of :mod:`routing.policies.estimated_ttft` charges a placement the
recompute of the cached tokens it evicts, each weighted by the chance that it is asked
for again. That chance is measured per backend from the ghosts of evicted blocks
(:mod:`routing.prefix_index.turnover`), a rate of the past; a session waiting between
turns says more of its own future. For the sessions waiting at a backend
(:class:`routing.sessions.Waiting`, by how long they have waited) this module gives:

- ``held``: their blocks the engine probably still holds, each bin's blocks times the
  chance that a prefix idle that long is still held there (the backend's
  :class:`routing.gaps.RetentionFit`; 1 for a backend whose KV events are live, where
  a session stops being counted when its engine removes its last block, and before
  any observation);
- ``value``: of those, the ones likely asked for again while still held: each bin's
  blocks times :meth:`routing.gaps.GapEstimator.return_values` (the likelihood and the
  nearness of the session's return).

:meth:`SessionRouting.kv_turnover` folds them into the backend's turnover: the sessions' held KV
takes room even where the approximate index has forgotten it (its blocks aged out
after ``prefix_ttl_s``), and the chance that an evicted token is asked for again is
the sessions' value for their share of the cache, the measured rate for the rest.
The evicted tokens are taken as drawn from what the cache holds in proportion (the LRU
order inside the cache is not modelled): an approximation that errs towards keeping
sessions whose return is near, which is what the term is for.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import mul

from routing.backend import BackendState
from routing.gaps import N_BINS, GapEstimator, RetentionFit
from routing.policies import Decision, Match, RouteRequest
from routing.prefix_index import PrefixIndex
from routing.sessions import CHEAPER, NO_HIT, UNAVAILABLE, SessionTable, Waiting

HELD_ALWAYS: tuple[float, ...] = (1.0,) * N_BINS  # a retention without observations, or precisely known


def bin_factors(gaps: GapEstimator, held_by_bin: Sequence[float],
                waiting: Sequence[float]) -> tuple[Sequence[float], list[float]]:
    """Per bin of waiting time, (the chance that the engine still holds a waiting
    session's blocks, the chance that they are asked for again while held) at a backend
    whose engine holds a prefix idle for a time of bin ``j`` with chance
    ``held_by_bin[j]``, ``waiting[j]`` sessions waiting now for a time of bin ``j``
    (:meth:`GapEstimator.return_values`). O(bins)."""
    return held_by_bin, gaps.return_values(held_by_bin, waiting)


def waiting_value(w: Waiting, factors: tuple[Sequence[float], Sequence[float]],
                  block_tokens: float) -> tuple[float, float]:
    """(tokens of the waiting sessions ``w`` the engine probably still holds, tokens of
    them likely asked for again while held), with the ``factors`` of
    :func:`bin_factors`, in blocks of ``block_tokens``. O(bins), in C."""
    held, value = factors
    return sum(map(mul, w.blocks, held)) * block_tokens, sum(map(mul, w.blocks, value)) * block_tokens


class SessionRouting:
    """The session part of :class:`routing.router.Router` (a base of it), over its
    ``sessions`` (:class:`SessionTable`), ``retention`` (per backend without live KV
    events, how long its engine keeps an idle prefix), ``index`` and ``block_tokens``."""

    sessions: SessionTable
    _waiting: dict[str, Waiting]  # sessions.waiting
    retention: dict[str, RetentionFit]
    index: PrefixIndex
    block_tokens: int
    _factors: dict[str, tuple[list[float], list[float]]]  # backend -> bin_factors in tokens, until the next tick

    def kv_turnover(self, b: BackendState) -> tuple[float, float]:
        """(KV tokens ``b``'s cache can take without evicting, share of its evicted
        blocks asked for again): the prefix index's
        :meth:`~routing.prefix_index.PrefixIndex.turnover`, with the sessions waiting at
        ``b`` folded in (see the module docstring): their ``held`` tokens take room
        even where the index has none, and the share is their ``value`` for their part
        of what is used, the measured rate for the rest (``value <= held``
        (:meth:`value_waiting`): it stays within [0, 1]). O(1), one call per candidate
        of every decision (``Match.kv_turnover``), so the fold is written out here;
        where no backend publishes KV events, a backend's result is kept
        (``Waiting.turnover``) until its approximate entries change
        (``BackendBlocks.changes``), its valuation does (a new ``Waiting.value``) or
        its capacity does: a decision recomputes it for the backend the last one chose
        and the few whose counters that dispatch moved, not for every candidate."""
        name = b.name
        capacity = b.load.kv_capacity_tokens
        index = self.index
        w = self._waiting.get(name)
        if w is None:
            return index.turnover(name, self.block_tokens, capacity)
        v = w.value or self.value_waiting(name, w)
        entries = None if index.engines else index.backends.get(name)
        if entries is not None:  # kept while neither the index's entries nor the valuation changed
            kept = w.turnover
            if kept is not None and kept[0] is entries and kept[1] == entries.changes and kept[2] is v \
                    and kept[3] == capacity:
                return kept[4]
        free, reuse = index.turnover(name, self.block_tokens, capacity)
        held, value = v
        used = capacity - free
        if used < held:
            used = held
            free = capacity - held if capacity > held else 0.0
        if used > 0:
            reuse = (value + reuse * (used - held)) / used
        t = free, reuse
        if entries is not None:
            w.turnover = (entries, entries.changes, v, capacity, t)
        return t

    def _kv_gone(self, backend: str, keys: list[int]) -> None:
        """The prefix index's word that ``backend``'s engine removed ``keys``."""
        self.sessions.kv_gone(backend, keys)

    def _at_home(self, m: Match, session: str, now: float) -> None:
        """Set ``m.home`` to the home of ``session``, if it has one, and count there the
        blocks the session's last turn placed (:meth:`SessionTable.held_blocks`) when
        the prefix index has fewer (another replica's dispatch not synced yet, or
        blocks it aged out), and, when another replica placed its last turn, that
        turn's uncached tokens (``Match.home_queued``).

        Once the home's engine has reported hits after gaps (:meth:`learn_cached`),
        the blocks counted are the expected ones: those placed times the chance that
        a prefix idle that long is still held there (:class:`RetentionFit`), which
        then decides even where the prefix index holds them (it ages entries by its
        time to live, not by what the engine showed), unless the index holds more than
        the session's own context. A home with live KV events is decided by them
        (``Match.exact_tokens``)."""
        s = self.sessions.get(session, now)
        if s is None:
            return
        home = s.home
        m.home = home
        if not s.here:
            m.home_queued = float(s.queued)
        held = self.sessions.held_blocks(s, m.request.block_hashes)
        if not held:
            return
        idle = now - s.seen
        m.home_held, m.home_idle = held, idle
        indexed = m.matched_blocks.get(home, 0)
        fit = self.retention.get(home)
        if fit is not None and indexed <= held:
            expected = int(held * fit.held(idle))
            if expected != indexed:
                m.matched_blocks = {**m.matched_blocks, home: expected}
        elif held > indexed:
            m.matched_blocks = {**m.matched_blocks, home: held}

    def learn_cached(self, decision: Decision, prompt_tokens: int, cached_tokens: int) -> None:
        """The engine that served ``decision`` reported ``cached_tokens`` of the
        request's ``prompt_tokens`` as cached (``usage.prompt_tokens_details.
        cached_tokens``). For a turn of a session: counted for the session hit ratio by
        placement (``SessionTable.hit_tokens``); when it went home counting its
        context as held on approximate evidence (``Decision.held_tokens``), the share
        of that context the engine still held after ``Decision.idle_s`` teaches the
        home's :class:`RetentionFit`, which the session claims
        (:meth:`_at_home`), the waiting sessions' valuation and the approximate
        index's time to live there (:meth:`PrefixIndex.set_retention`, at most
        ``sessions.ttl_s``) follow."""
        if decision.session is None:
            return
        counts = self.sessions.hit_tokens.get(decision.placement)
        if counts is not None:
            counts[0] += prompt_tokens
            counts[1] += min(cached_tokens, prompt_tokens)
        held = decision.held_tokens
        if held <= 0:
            return
        name = decision.backend.name
        fit = self.retention.get(name)
        if fit is None:
            fit = self.retention[name] = RetentionFit()
        fit.observe(decision.idle_s, cached_tokens / held)
        self.index.set_retention(name, min(fit.horizon(), self.sessions.ttl_s))
        self._factors.pop(name, None)
        w = self.sessions.waiting.get(name)
        if w is not None:
            w.value = None

    def _place(self, request: RouteRequest, candidates: list[BackendState], match: Match, decision: Decision,
               cached: float, now: float) -> None:
        """Record where ``request``'s session now lives (``decision``'s backend, which
        holds ``cached`` of its prompt tokens by ``match``), why it left its home if it
        did (not a candidate: ``unavailable``; counted as holding nothing of it:
        ``no_hit``; else ``cheaper``), its last block's token-exact key where the
        backend's KV events are live, and what the engine's reported cached tokens will
        be compared with (:meth:`learn_cached`)."""
        session = request.session
        assert session is not None
        decision.session = session
        chosen = decision.backend.name
        queued = int(request.prompt_tokens - cached)
        home = match.home
        reason = CHEAPER
        if home is not None and home != chosen:
            if not any(b.name == home for b in candidates):
                reason = UNAVAILABLE
            elif match.cached_tokens(home) <= 0:
                reason = NO_HIT
        key_tail = 0
        if request.token_keys:
            e = self.index.engines.get(chosen)
            if e is not None and e.live:
                keys = request.token_keys.get(e.block_size)
                if keys:
                    key_tail = keys[-1]
        decision.placement = self.sessions.place(session, chosen, request.block_hashes, now, queued, reason, key_tail)
        if match.home_held and chosen == home and decision.evidence == "approximate":
            decision.held_tokens = min(match.home_held * request.tokens_per_block, float(request.prompt_tokens))
            decision.idle_s = match.home_idle

    def value_waiting(self, name: str, w: Waiting) -> tuple[float, float]:
        """The valuation of the sessions ``w`` waiting at backend ``name``
        (:func:`waiting_value`), kept in ``w.value`` (updated as they come and go:
        :meth:`Waiting.add`); the bins' factors (:func:`bin_factors` in tokens: the
        gaps learned, the backend's retention, 1 where its KV events are live) are kept
        until the router's next tick or a new retention observation (``_factors``)."""
        factors = self._factors.get(name)
        if factors is None:
            fit = self.retention.get(name)
            e = self.index.engines.get(name)
            held_by_bin = HELD_ALWAYS if fit is None or (e is not None and e.live) else fit.fit()
            sessions = self.sessions
            held, value = bin_factors(sessions.gaps, held_by_bin, sessions.waiting_sessions)
            bt = self.block_tokens
            factors = self._factors[name] = ([h * bt for h in held], [v * bt for v in value])
        w.factors = factors
        v = w.value = waiting_value(w, factors, 1.0)
        return v
