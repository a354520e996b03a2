"""Time between uses, learned from what is observed: the gaps between a session's turns
(:class:`GapEstimator`) and how long an engine keeps an idle prefix in its KV cache
(:class:`RetentionFit`).

Both are kept on one set of log-spaced bins of idle time (:data:`EDGES`: one bin per
octave from a quarter of a second to about four and a half hours, and one bin each side
of them): the gaps of agent traffic span milliseconds (a fast tool call) to many minutes
(a human in the loop, a long job), so a bin's width grows with its time and a quantile
read from the bins is off by at most a factor of two, whatever its scale: the
log-spaced buckets of DDSketch (Masson, Rim and Lee, "DDSketch: A Fast and
Fully-Mergeable Quantile Sketch with Relative-Error Guarantees", VLDB 2019), here with
a relative accuracy of one octave. Counts are halved together once they pass twice a
window, as :class:`routing.prefix_index.turnover.Evictions` does, so that both follow
traffic that changes. Neither keeps a clock: every call takes the time it is about.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

EDGES: tuple[float, ...] = tuple(2.0 ** k for k in range(-2, 15))  # bin upper edges, seconds
N_BINS = len(EDGES) + 1  # [0, EDGES[0]), [EDGES[0], EDGES[1]), ..., [EDGES[-1], inf)
_LOG_FIRST = int(math.log2(EDGES[0]))

GAP_WINDOW = 512  # gaps: counts halve past twice this many
KEEP_QUANTILE = 0.99  # a session is kept until all but this share of returning sessions are back
HORIZON_MARGIN = 2.0  # times the quantile bin's upper edge: one more octave of the bins' resolution
MIN_GAPS = 32  # gaps seen before the horizon is learned (fewer: the cap)
RETENTION_WINDOW = 64  # retention observations per backend: counts halve past twice this many


def bin_of(idle_s: float) -> int:
    """The bin of an idle time of ``idle_s`` seconds (0 for a negative one)."""
    if idle_s < EDGES[0]:
        return 0
    if not idle_s < EDGES[-1]:  # (NaN included)
        return N_BINS - 1
    return math.floor(math.log2(idle_s)) - _LOG_FIRST + 1


def upper_edge(i: int) -> float:
    """The upper edge of bin ``i`` in seconds (``inf`` for the last)."""
    return EDGES[i] if i < len(EDGES) else math.inf


class GapEstimator:
    """The gaps between consecutive turns of sessions (seconds from one turn's dispatch to
    the next's), and how many sessions did not come back.

    - :meth:`observe` a gap (a session's next turn came); :meth:`ended` a session that
      was forgotten without coming back; :meth:`came_back` one forgotten that came back
      after all (its gap is observed too).
    - :meth:`horizon`: how long to keep a waiting session: the :data:`KEEP_QUANTILE`
      quantile of the gaps (the upper edge of its bin, times :data:`HORIZON_MARGIN`),
      at most ``cap``; ``cap`` until :data:`MIN_GAPS` gaps were seen. So of the
      sessions that come back, about one in a hundred comes back after it was forgotten,
      whatever the shape of the gaps' tail.
    - :meth:`return_values`: per bin of waiting time, the chance that a waiting session
      comes back while an engine still holds its KV cache, the sessions still waiting
      counted as not (yet) back.
    """

    def __init__(self) -> None:
        self.counts = [0.0] * N_BINS
        self.returns = 0.0  # gaps observed (decayed): the sum of counts
        self.ends = 0.0  # sessions forgotten without coming back (decayed with the gaps)

    def observe(self, gap_s: float) -> None:
        """A session's next turn came ``gap_s`` seconds after its last one."""
        self.counts[bin_of(gap_s)] += 1.0
        self.returns += 1.0
        if self.returns > 2 * GAP_WINDOW:
            self.counts = [c * 0.5 for c in self.counts]
            self.returns *= 0.5
            self.ends *= 0.5

    def ended(self) -> None:
        """A session was forgotten (it waited past the horizon)."""
        self.ends += 1.0

    def came_back(self, gap_s: float) -> None:
        """A forgotten session came back after ``gap_s`` seconds: not an end after all."""
        self.ends = max(self.ends - 1.0, 0.0)
        self.observe(gap_s)

    def horizon(self, cap: float) -> float:
        """Seconds a waiting session is kept (see the class), at most ``cap``."""
        if self.returns < MIN_GAPS:
            return cap
        target = KEEP_QUANTILE * self.returns
        acc = 0.0
        for i, c in enumerate(self.counts):
            acc += c
            if acc >= target:
                return min(cap, upper_edge(i) * HORIZON_MARGIN)
        return cap

    def return_values(self, held: Sequence[float], waiting: Sequence[float] | None = None) -> list[float]:
        """Per bin ``k`` of waiting time, the chance that a session that has waited that
        long comes back while its KV cache is still held, given ``held[j]``: the chance
        that an engine still holds a prefix idle for a time of bin ``j``
        (:meth:`RetentionFit.fit`), and ``waiting[j]``: how many sessions are waiting
        now, for a time of bin ``j`` (not yet back, not yet ended: right-censored).

        The chance of a return in each bin is the Kaplan-Meier estimate (Kaplan and
        Meier, "Nonparametric Estimation from Incomplete Observations", JASA 53, 1958)
        over the bins: of the sessions at risk in bin ``j`` (``n_j``: back with a gap of
        bin ``j`` or later, ended, or waiting now for a time of bin ``j`` or later),
        ``d_j`` came back in it, the hazard ``h_j = d_j / n_j``; then, backwards::

            value_k = h_k held[k] + (1 - h_k) value_{k+1}

        the chance that it comes back times the chance that its KV is still there when
        it does: a session that comes back in seconds is worth its whole context, one
        whose return is likely only after the engine would have evicted it anyway is
        worth little. Without the sessions waiting now, the sessions that will never
        come back are counted only once they end (:meth:`ended`, after the horizon),
        and until then every session looks sure to come back. Before :data:`MIN_GAPS`
        gaps, a waiting session is taken to come back: ``value_k = held[k]``.
        O(bins)."""
        if self.returns < MIN_GAPS:
            return list(held)
        counts = self.counts
        out = [0.0] * N_BINS
        at_risk = self.ends
        value = 0.0
        for k in range(N_BINS - 1, -1, -1):
            d = counts[k]
            at_risk += d + waiting[k] if waiting is not None else d
            if at_risk > 0:
                h = d / at_risk
                value = h * held[k] + (1.0 - h) * value
            out[k] = value
        return out


class RetentionFit:
    """How long one engine keeps an idle prefix: the chance that it still holds a prefix
    last used ``w`` seconds ago, learned from the prefix hits it reports after gaps.

    Each observation is a prefix the gateway expected a backend to hold (a session's
    context, at its home), the time it had been idle, and the share of it the engine
    reported cached (``usage.prompt_tokens_details.cached_tokens``). Each is *current
    status* data: it says only whether the prefix had been evicted by then, not when.
    The nonparametric maximum-likelihood estimate of the survival function from such
    data is the isotonic (non-increasing) regression of the outcomes on the time,
    computed by the pool-adjacent-violators algorithm (Ayer, Brunk, Ewing, Reid and
    Silverman, "An Empirical Distribution Function for Sampling with Incomplete
    Information", Ann. Math. Statist. 26, 1955; Groeneboom and Wellner, "Information
    Bounds and Nonparametric Maximum Likelihood Estimation", 1992); with shares instead
    of 0/1 outcomes it is the least-squares isotonic fit of them. Here over the bins of
    :data:`EDGES`: a bin without observation takes the fit of the nearest observed bin
    before it (1 before the first: a prefix idle for no time is held).
    """

    def __init__(self) -> None:
        self.sums = [0.0] * N_BINS  # retained shares, per bin
        self.weights = [0.0] * N_BINS  # observations, per bin
        self.total = 0.0
        self._fit: list[float] | None = None

    def observe(self, idle_s: float, retained: float) -> None:
        """A prefix idle for ``idle_s`` seconds was found held for a share ``retained``
        (clipped to [0, 1])."""
        i = bin_of(idle_s)
        self.sums[i] += min(max(retained, 0.0), 1.0)
        self.weights[i] += 1.0
        self.total += 1.0
        if self.total > 2 * RETENTION_WINDOW:
            self.sums = [s * 0.5 for s in self.sums]
            self.weights = [w * 0.5 for w in self.weights]
            self.total *= 0.5
        self._fit = None

    def fit(self) -> list[float]:
        """Per bin, the chance that a prefix idle that long is still held (see the
        class); recomputed after an observation, O(bins)."""
        fit = self._fit
        if fit is not None:
            return fit
        blocks: list[list[float]] = []  # pooled runs: [sum, weight, first bin]
        for i in range(N_BINS):
            w = self.weights[i]
            if w <= 0:
                continue
            blocks.append([self.sums[i], w, float(i)])
            while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] < blocks[-1][0] * blocks[-2][1]:
                s, w2, _ = blocks.pop()
                blocks[-1][0] += s
                blocks[-1][1] += w2
        fit = [1.0] * N_BINS
        for n, (s, w, first) in enumerate(blocks):
            end = int(blocks[n + 1][2]) if n + 1 < len(blocks) else N_BINS
            fit[int(first):end] = [s / w] * (end - int(first))
        self._fit = fit
        return fit

    def held(self, idle_s: float) -> float:
        """The chance that a prefix idle for ``idle_s`` seconds is still held."""
        return self.fit()[bin_of(idle_s)]

    def horizon(self) -> float:
        """Seconds an idle prefix is probably (chance at least one half) still held, as
        far as observed: the upper edge of the last observed bin whose fit is at least
        one half; 0 when there is none. Nothing is extrapolated past the observations."""
        fit = self.fit()
        best = 0.0
        for i in range(N_BINS):
            if self.weights[i] > 0 and fit[i] >= 0.5:
                best = upper_edge(i)
        return best
