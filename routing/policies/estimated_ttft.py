"""``estimated_ttft`` (the default): send each request where its first token comes soonest.

For each candidate backend ``b`` (DESIGN.md section 3), in seconds::

    TTFT_est(b) = overhead_b
                + (queued_prefill_b + uncached_b) / prefill_rate_b      # queue + own prefill
                + evicted_b * reuse_b / prefill_rate_b                  # eviction cost
                + steps * itl_per_stream_b * running_b                  # decode interference
                + kv_wait_b                                             # KV pressure

- ``uncached_b`` = prompt tokens minus those ``b`` probably holds (prefix index), so a
  prefix hit is worth exactly the prefill time it saves, and a hot backend loses once
  its queue costs more than recomputing elsewhere: no hand-set affinity thresholds.
- ``queued_prefill_b`` includes the other gateway replicas' load (shared store) and
  load the engine reports that no gateway sent.
- Eviction cost: what placing the request on ``b`` costs later requests. Its
  ``uncached_b + output`` tokens enter ``b``'s prefix cache; beyond the KV that cache
  can still take without evicting (``free_b``, tokens), they evict as many cached
  tokens, ``evicted_b = max(0, uncached_b + output - free_b)``, and each evicted token
  is asked for again, and prefilled again, with probability ``reuse_b`` (measured per
  backend from the prefix index's ghosts of evicted blocks:
  :meth:`routing.prefix_index.PrefixIndex.turnover`, from the engine's own KV events
  where they are live), and, where sessions wait between turns, their blocks valued by
  the likelihood and nearness of their return (:mod:`routing.session_kv`: they take
  room even where the approximate index aged them out). This is the eviction cost of
  Preble's E2 scheduler (Srivatsa et al., "Preble: Efficient Distributed Prompt
  Scheduling for LLM Serving", ICLR 2025, section 3.2: the recompute time of the
  cached prefixes a placement evicts,
  weighted by how likely they are to be hit again), with the hit likelihood of the
  blocks at the LRU's end measured per backend rather than per prefix. It makes a
  placement pay for the KV it takes where KV is scarce: a new prefix goes where the
  cache has room or turns over blocks nobody asks for again, a prefix that is
  partly held stays with its holder unless a queue costs more than the holder's hit
  plus what moving would evict, so prefixes are not duplicated needlessly. Nothing
  is added where the request fits in the free KV or where evicted blocks never
  come back (``reuse_b`` 0: one-off prompts). Cost per scored candidate: O(1) (the
  router gives ``Match.kv_turnover``); without it (a match built outside the
  router) the term is absent.
- Decode interference: with chunked prefill each engine step also runs one token of every
  running stream, so the prefill's ``steps = ceil(work / CHUNK_TOKENS)`` steps each cost
  ``running * itl_per_stream`` more (the learned ITL slope).
- KV pressure: when in-use KV tokens plus this request's prompt and expected output
  exceed capacity, the request waits for running streams to free blocks; the wait is
  the overflow's share of capacity times the mean remaining decode time there.
- LoRA: a request for an adapter that is not at work on ``b`` pays its load there
  (unless it was sent there recently enough to be in the engine's cache), and the
  wait for an adapter slot when ``b``'s batch already holds ``max_lora`` adapters
  (:meth:`routing.load.BackendLoad.adapter_wait_s`). Among the candidates, an
  adapter's request goes to its placement set, which grows only while the adapter's
  share of the requests needs more backends (or its members carry far more than the
  mean) and the set's best estimate exceeds the best other by more than a load there,
  and shrinks as its members fall idle (:func:`routing.lora.place`).

The lowest estimate wins; candidates within ``TIE_RELATIVE`` (2%) + ``TIE_ABSOLUTE_S``
(0.5 ms) of the best are ties broken at random, so that several gateway replicas with
the same view do not herd onto one backend; a turn of a session whose home is among
the ties goes home (``session_home``). A session's home counts the blocks its last turn
placed there as cached (:mod:`routing.sessions`), so the home wins by its hit, and a
session moves only when the home's queue costs more than recomputing its context
elsewhere by more than the estimates' error explains: the best of the other ``k``
candidates must lead the home by more than ``exp(curse(k) * sigma)`` times, ``sigma``
the spread of that backend's past estimates around the TTFTs that followed
(:class:`routing.load.speed_fit.EstimateError`), ``curse(k)`` the expected maximum of
``k`` standard normals: the lead that choosing the least of ``k`` noisy estimates shows
by chance (the optimizer's curse, :func:`curse`). A move recomputes the session's whole
context and duplicates its KV; a lead that is only noise is not worth that. The load
the session's last turn may still show at the home in another replica's snapshot is
not counted there (``Match.home_queued``: the turn is over).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from statistics import NormalDist

from routing.backend import BackendState
from routing.lora import Scored, place
from routing.policies.base import BasePolicy, Decision, Match, RouteRequest

# vLLM's default token budget per step with chunked prefill (max_num_batched_tokens
# 2048 for online serving: vllm/engine/arg_utils.py, "default_max_num_batched_tokens").
CHUNK_TOKENS = 2048
TIE_RELATIVE = 0.02
TIE_ABSOLUTE_S = 0.0005
# Above this many candidates, score the backends holding the longest prefix matches
# plus a random sample of the rest ("power of d choices", Mitzenmacher, IEEE TPDS 2001:
# a few random probes already give most of the benefit of scoring everyone).
FULL_SCAN_MAX = 32
SAMPLE_MATCHED = 8
SAMPLE_RANDOM = 16
# A backend with no TTFT sample for this long, and nothing in flight here, is judged by
# its prior (its pool's speed) rather than by what it last showed: optimism in the face
# of uncertainty (Auer, Cesa-Bianchi and Fischer, "Finite-time Analysis of the
# Multiarmed Bandit Problem", Machine Learning 47, 2002), so that a backend that was
# slow for a while is measured again; at most one such probe per backend per period, or,
# while its latest samples keep surprising its fit (``DecayedLinearFit.unsettled``), one
# at a time until they agree.
PROBE_AFTER_S = 30.0


def estimate_ttft(b: BackendState, request: RouteRequest, match: Match) -> tuple[float, float]:
    """(estimated TTFT in seconds, uncached prompt tokens) of ``request`` on ``b``, as
    ``match`` (the router's, at ``match.now``) says what ``b`` holds of it."""
    load = b.load
    remote = load.remote
    uncached = request.prompt_tokens - match.cached_tokens(b.name)
    work = load.queued_prefill_tokens + remote.queued_prefill_tokens + uncached  # total_queued_prefill_tokens
    running = load.running + remote.running  # total_running
    if match.home_queued and b.name == match.home:  # the session's last turn, over, maybe still in remote load
        work -= min(match.home_queued, remote.queued_prefill_tokens)
        running -= min(1.0, remote.running)
    if load.engine is not None:
        now = match.now
        work += load.external_queued_tokens(now)
        running += load.external_running(now)
    overhead, rate = load.ttft_params()
    if load.waiting:
        oldest = load.waiting[0]
        # The oldest streamed request still waiting for its first token bounds the
        # prefill rate from above: the work ahead of and including its own is not done
        # after the time it has waited (a right-censored TTFT). With nothing to prefill
        # its wait says nothing of the rate.
        waited = match.now - oldest.dispatched_at - overhead
        done_by = oldest.queued_ahead_tokens + oldest.uncached_tokens
        if waited > 0 and 0 < done_by < rate * waited:
            rate = done_by / waited
    est = overhead + work / rate
    turnover = match.kv_turnover
    if turnover is not None:
        free, reuse = turnover(b)
        evicted = uncached + request.output_tokens - free
        if evicted > 0 and reuse > 0:
            est += evicted * reuse / rate
    if running:
        now = match.now
        est += math.ceil(work / CHUNK_TOKENS) * load.itl_per_stream_s * running
        need = request.prompt_tokens + request.output_tokens
        overflow = load.kv_used_tokens(now) + need - load.kv_capacity_tokens
        if overflow > 0:
            mean_remaining = load.total_decode_tokens_remaining / max(load.total_running, 1)
            est += min(overflow / load.kv_capacity_tokens, 1.0) * mean_remaining * load.itl_s()
    if (b.discovered or b.spec.loadable) and b.adapter_base(request.model) is not None:
        active, max_lora = b.active_adapters(match.now)
        resident = b.adapter_resident(request.model, active, max_lora)
        est += load.adapter_wait_s(request.model, active, resident, max_lora, request.output_tokens)
    if load.engine is not None:
        stale = load.metrics_staleness(match.now)
        if stale:
            est *= 1.0 + stale
    return est, uncached


def _probe(match: Match, scored: list[Scored], limit: float) -> Scored | None:
    """The candidate to measure again, if any (see :data:`PROBE_AFTER_S`): idle here,
    unmeasured for that long or unsettled, and by its peers' speed (else its prior) at
    least as fast as the best (within ``limit``, the tie band)."""
    now = match.now
    for (est, uncached), b in scored:
        load = b.load
        fit = load.ttft_fit
        if load.queued or load.running or (not fit.unsettled and load.stale_s(now) < PROBE_AFTER_S):
            continue
        overhead, per_token = load.peer_ttft or (fit.prior_intercept, fit.prior_slope)
        if overhead + uncached * per_token <= limit:
            return (est, uncached), b
    return None


def _home(match: Match, ties: list[Scored]) -> Scored | None:
    """The tie that is the home of the request's session, if any."""
    home = match.home
    for t in ties:
        if t[1].name == home:
            return t
    return None


def _kept_home(match: Match, scored: list[Scored], best: float) -> Scored | None:
    """The home of the request's session when it is not among the ties but the
    ``best`` estimate's lead over it is within what choosing the least of the other
    candidates' estimates wins by their error alone (:func:`curse`), and moving would
    recompute something the home holds; else ``None``."""
    home = match.home
    h = lead = None
    for s in scored:
        if s[1].name == home:
            h = s
        elif lead is None and s[0][0] == best:
            lead = s
    if h is None or lead is None or lead[0][1] <= h[0][1]:
        return None
    sigma = lead[1].load.estimate_error.sigma
    if sigma and h[0][0] <= best * math.exp(curse(len(scored) - 1) * sigma):
        return h
    return None


_CURSE: list[float] = []


def curse(k: int) -> float:
    """The expected maximum of ``k`` independent standard normal variables, by Blom's
    approximation ``Phi^-1((k - 0.375) / (k + 0.25))`` (Blom, "Statistical Estimates
    and Transformed Beta-Variables", Wiley 1958; 0 for ``k`` 1, 0.59 for 2, 0.87
    for 3, within 0.03 of the exact expectation). The least of ``k`` estimates whose logarithms err by a
    standard deviation ``sigma`` around equal truths lies ``sigma * curse(k)`` below
    them on average: the optimizer's curse (Smith and Winkler, "The Optimizer's Curse:
    Skepticism and Postdecision Surprise in Decision Analysis", Management Science
    52(3), 2006). A session's turn leaves its home, whose estimate was not chosen as
    the least of several, only for a lead larger than that."""
    table = _CURSE
    if k >= len(table):
        dist = NormalDist()
        table.extend(dist.inv_cdf((n - 0.375) / (n + 0.25)) if n else 0.0 for n in range(len(table), k + 1))
    return table[k]


class EstimatedTTFT(BasePolicy):
    """Lowest estimated time to first token wins; near-ties broken at random."""

    name = "estimated_ttft"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._probe_at = 0.0  # probes are looked for at most once a second (they are 30 s apart)

    def choose(self, request: RouteRequest, candidates: Sequence[BackendState], match: Match) -> Decision:
        if len(candidates) > FULL_SCAN_MAX:
            candidates = self._sample(request, candidates, match)
        scored = [(estimate_ttft(b, request, match), b) for b in candidates]
        if match.adapter_set is not None and len(scored) > 1:  # a LoRA adapter: its placement set
            ((est, uncached), chosen), reason = place(request.model, match.adapter_set, scored,
                                                      TIE_RELATIVE, TIE_ABSOLUTE_S)
        elif len(scored) == 1:
            (est, uncached), chosen = scored[0]
            reason = "only_candidate"
        else:
            best = min([s[0][0] for s in scored])
            limit = best * (1 + TIE_RELATIVE) + TIE_ABSOLUTE_S
            ties = [s for s in scored if s[0][0] <= limit]
            probe = None
            if match.now >= self._probe_at:
                self._probe_at = match.now + 1.0
                probe = _probe(match, scored, limit)
            home = None
            if match.home is not None:  # a session's turn: stays home on a tie, or a lead within the error
                home = _home(match, ties) if len(ties) > 1 else None
                if home is None and ties[0][1].name != match.home:
                    home = _kept_home(match, scored, best)
            if home is not None:  # a session stays home when moving saves nothing
                probe = None
            (est, uncached), chosen = home or probe or (ties[0] if len(ties) == 1 else self._rng.choice(ties))
            if probe is not None:
                reason = "probe"
            elif home is not None:
                reason = "session_home"
            elif len(ties) > 1:
                reason = "tie"
            elif request.prompt_tokens - uncached > 0 and \
                    uncached < min([s[0][1] for s in scored if s[1] is not chosen], default=uncached):
                reason = "prefix_hit"
            else:
                reason = "least_load"
        cached = request.prompt_tokens - uncached
        detail = {"ttft_est_s": est, "matched_tokens": cached, "uncached_tokens": uncached}
        if chosen.load.engine is not None and chosen.load.metrics_staleness(match.now):
            detail["metrics_stale"] = 1  # its estimate counted its stale engine metrics as uncertainty
        return Decision(chosen, self.name, reason, detail)

    def _sample(self, request: RouteRequest, candidates: Sequence[BackendState], match: Match) -> list[BackendState]:
        matched = match.matched_blocks
        exact = match.exact_tokens
        holders: list[tuple[float, BackendState]] = []
        rest: list[BackendState] = []
        for b in candidates:
            name = b.spec.name
            m = matched.get(name) if not exact or name not in exact else exact[name] or None
            if m is None:
                rest.append(b)
            else:
                holders.append((match.cached_tokens(name), b))
        holders.sort(key=lambda mb: -mb[0])
        picked = [b for _, b in holders[:SAMPLE_MATCHED]]
        rest = rest or [b for _, b in holders[SAMPLE_MATCHED:]]
        picked += self._rng.sample(rest, min(SAMPLE_RANDOM, len(rest)))
        if match.adapter_set:  # a LoRA adapter's placement set is always scored
            have = {b.name for b in picked}
            members = set(match.adapter_set) - have
            picked += [b for b in candidates if b.name in members]
        return picked
