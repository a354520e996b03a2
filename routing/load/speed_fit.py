"""The online fit behind every learned speed: least squares with forgetting.

A backend's TTFT and inter-token latency are each a line fitted to what it served
(:mod:`routing.load.learned_speeds`). :class:`DecayedLinearFit` fits it sample by sample
in O(1): exponentially weighted least squares, seeded by a prior line, forgetting old
samples per sample and per unit of time, and faster after a surprise (a change of
regime) or while samples are still few.
"""

from __future__ import annotations

import math

# A sample this many times off the fit's prediction (either way) is a change of regime,
# not noise: the observations before it keep only SURPRISE_KEEP of their weight (a
# variable forgetting factor, after Fortescue, Kershenbaum and Ydstie, "Implementation
# of self-tuning regulators with variable forgetting factors", Automatica 17, 1981).
SURPRISE_RATIO = 5.0
FASTER_RATIO = 2.0  # after a silence, a sample this many times faster than predicted is a surprise too
UNSETTLED_RATIO = 1.5  # either way, while the fit is unsettled: the new regime takes over in a few samples
SURPRISE_KEEP = 0.1
SETTLED_RATIO = 1.03  # a sample this close to the prediction ends the surprise (``unsettled``)
# While samples are few the prior is forgotten faster: per sample its weight is kept at
# lambda(t) = STARTUP_GROWTH * lambda(t-1) + (1 - STARTUP_GROWTH), from STARTUP_KEEP up to the
# fit's own decay (the growing forgetting factor of Ljung and Soderstrom, "Theory and
# Practice of Recursive Identification", MIT Press 1983, section 5.6).
STARTUP_KEEP = 0.5
STARTUP_GROWTH = 0.8


class DecayedLinearFit:
    """Least-squares fit of ``y = intercept + slope * x`` with exponential forgetting,
    seeded by a prior line worth ``prior_weight`` samples at ``x = 0`` and
    ``x = prior_x``.

    Observations are forgotten per sample (each new one multiplies older weights, the
    prior's included, by ``decay``) and per unit of time (their weight halves every
    ``half_life_s`` seconds: :meth:`age`). The prior's weight never falls below
    ``prior_floor``, so a backend that gets no traffic drifts back to its prior instead
    of keeping a bad estimate forever, and a sample after a long silence outweighs the
    old ones. While samples are few the prior is forgotten faster (:data:`STARTUP_KEEP`).
    The prior can be replaced (:meth:`set_prior`). ``slope`` is kept within
    ``[min_slope, max_slope]`` and the intercept at >= 0, so a few noisy samples cannot
    produce a negative speed.
    """

    __slots__ = ("decay", "half_life_s", "prior", "wprior", "prior_intercept", "prior_slope", "prior_x", "prior_w",
                 "prior_floor", "s", "sx", "sy", "sxx", "sxy", "min_slope", "max_slope", "samples", "slope",
                 "intercept", "aged_at", "age_due", "last_sample_at", "unsettled", "prior_keep")

    def __init__(self, intercept: float, slope: float, prior_x: float, *, decay: float = 0.97,
                 prior_weight: float = 2.0, min_slope: float = 1e-9, max_slope: float = 1e3,
                 half_life_s: float = 30.0, prior_floor: float = 0.02) -> None:
        self.decay = decay
        self.half_life_s = half_life_s
        self.min_slope, self.max_slope = min_slope, max_slope
        self.prior_x, self.prior_w, self.prior_floor = prior_x, prior_weight, prior_floor
        self.s = self.sx = self.sy = self.sxx = self.sxy = 0.0  # the observations' weighted sums
        self.samples = 0
        self.aged_at: float | None = None  # the time the observations' weights refer to
        self.age_due = -math.inf  # the next ageing step is taken from this time on
        self.last_sample_at: float | None = None
        self.unsettled = False  # a sample came in much faster than predicted, and none has agreed since
        self.prior_keep = STARTUP_KEEP  # the prior's weight kept per sample while samples are few
        self.set_prior(intercept, slope)

    def set_prior(self, intercept: float, slope: float) -> None:
        """The line the fit starts from and returns to as observations age."""
        self.prior_intercept, self.prior_slope = intercept, slope
        x = self.prior_x
        # (s, sx, sy, sxx, sxy) of the points (0, b) and (x, b + m x), each of weight 1/2
        self.prior = (1.0, x / 2, (2 * intercept + slope * x) / 2, x * x / 2, x * (intercept + slope * x) / 2)
        self._weigh_prior()
        self._refit()

    def _weigh_prior(self) -> None:
        w = self.prior_w
        self.wprior = tuple([w * v for v in self.prior])

    def age(self, now: float, refit: bool = True) -> None:
        """Forget the observations by the time passed since they were last aged (loop
        time, seconds): their weight halves every ``half_life_s``. Steps shorter than
        a hundredth of the half-life wait to be taken together."""
        if now < self.age_due:
            return
        at = self.aged_at
        self.aged_at = now
        self.age_due = now + self.half_life_s * 0.01
        if at is None or not self.s:
            return
        f = 0.5 ** ((now - at) / self.half_life_s)
        self.s *= f
        self.sx *= f
        self.sy *= f
        self.sxx *= f
        self.sxy *= f
        if refit:
            self._refit()

    def add(self, x: float, y: float, now: float | None = None) -> None:
        """Add one observation (made at loop time ``now``, when given)."""
        silent = False  # the first sample after a third of a half-life without one (a probe's)
        if now is not None:
            if now >= self.age_due:
                self.age(now, refit=False)  # the refit below covers it
            last = self.last_sample_at
            silent = last is not None and now - last >= self.half_life_s / 3
            self.last_sample_at = now
        d = self.decay
        if self.samples:
            pred = self.intercept + self.slope * x
            unsettled = self.unsettled
            if y > (UNSETTLED_RATIO if unsettled else SURPRISE_RATIO) * pred:  # slower than thought: learn it at once
                d *= SURPRISE_KEEP
                self.unsettled = False
            elif y * (UNSETTLED_RATIO if unsettled else FASTER_RATIO if silent else SURPRISE_RATIO) < pred:
                # faster than thought: learn it, and measure again soon
                d *= SURPRISE_KEEP
                self.unsettled = True
            elif unsettled and y < SETTLED_RATIO * pred and y * SETTLED_RATIO > pred:
                self.unsettled = False
        if self.prior_w > self.prior_floor:
            keep = self.prior_keep
            if keep < d:
                self.prior_keep = STARTUP_GROWTH * keep + (1.0 - STARTUP_GROWTH)
            else:
                keep = d
            self.prior_w = max(self.prior_w * keep, self.prior_floor)
            self._weigh_prior()
        self.s = self.s * d + 1.0
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxy = self.sxy * d + x * y
        self.samples += 1
        self._refit()

    def _refit(self) -> None:
        # ``slope`` and ``intercept`` are plain attributes, refitted on each change:
        # routing reads them for every candidate of every request
        ps, psx, psy, psxx, psxy = self.wprior
        s, sx, sy, sxx, sxy = ps + self.s, psx + self.sx, psy + self.sy, psxx + self.sxx, psxy + self.sxy
        # comparisons rather than min() and max(): this runs for every sample
        scale = s * sxx
        var = scale - sx * sx
        if var <= 1e-12 * (scale if scale > 1e-30 else 1e-30):
            slope = self.min_slope
        else:
            slope = (s * sxy - sx * sy) / var
            if slope < self.min_slope:
                slope = self.min_slope
            elif slope > self.max_slope:
                slope = self.max_slope
        self.slope = slope
        intercept = (sy - slope * sx) / s
        self.intercept = intercept if intercept > 0.0 else 0.0

    def predict(self, x: float) -> float:
        return self.intercept + self.slope * x


# Samples before :class:`EstimateError` reports a spread (fewer say little of it).
ERROR_MIN_SAMPLES = 16


class EstimateError:
    """How far a backend's TTFT estimates fall from the TTFTs that followed: the
    exponentially weighted mean and standard deviation of ``ln(ttft / estimate)``
    (natural log of the ratio, so an estimate twice too high and one twice too low are
    equally far), each sample weighing ``1 - decay`` (the TTFT fit's per-sample memory:
    :class:`DecayedLinearFit`), by the incremental weighted variance of Finch,
    "Incremental calculation of weighted mean and variance", University of Cambridge
    Computing Service, 2009, section 9. ``sigma`` is 0.0 until
    :data:`ERROR_MIN_SAMPLES` samples. O(1) per sample."""

    __slots__ = ("alpha", "mean", "var", "samples", "sigma")

    def __init__(self, decay: float = 0.97) -> None:
        self.alpha = 1.0 - decay
        self.mean = self.var = self.sigma = 0.0
        self.samples = 0

    def add(self, estimate_s: float, ttft_s: float) -> None:
        """One request's estimated and observed TTFT (seconds); either not positive:
        ignored."""
        if not (estimate_s > 0 and ttft_s > 0):
            return
        x = math.log(ttft_s / estimate_s)
        if not self.samples:
            self.mean = x
        else:
            diff = x - self.mean
            incr = self.alpha * diff
            self.mean += incr
            self.var = (1.0 - self.alpha) * (self.var + diff * incr)
        self.samples += 1
        if self.samples >= ERROR_MIN_SAMPLES:
            self.sigma = math.sqrt(self.var)
