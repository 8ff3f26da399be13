"""The soak's memory judgement: a leak or not, from the scheduler's RSS series (pure: series in,
verdict out).

The CPU engine warms up for minutes (the DSV4 kit's stock boot grew 25 % in its first three), so
growth against an absolute share from an early sample judges the warm-up, not a leak. A leak adds
a fixed amount per request for as long as requests come; a warm-up levels off. Two rules, first
that applies:

* plateau (the run's second half): the floor of the RSS (its lower quartile: transient peaks of a
  big prefill do not count, a leak lifts the floor) in the third and the fourth quarter of the run,
  and the requests served between the two quarters' middles; growth per 1,000 requests above
  :data:`LEAK_MIB_PER_1000` is a leak. Needs :data:`MIN_WINDOW_SAMPLES` samples a quarter and
  :data:`MIN_PLATEAU_REQUESTS` requests between them. When the stock control is long enough for
  the same test (``--stock-minutes`` equal to ``--minutes``), what is judged is the profile's rate
  above the stock's: a warm-up both boots share cancels out.
* control (too short for the plateau): the profile's floor growth over the stock control's minutes
  (the floor of the window after the sample at :data:`WARM_FRACTION` of those minutes to the floor
  of their last fifth) against the stock's over the same minutes; more than
  :data:`CONTROL_MARGIN_PCT` points above it is a leak.

Each rule knows its own resolution: the floor's noise (:func:`floor_noise_kib`: how far the floors
of short windows of the judged span stray from the parabola through them), twice over for the
difference of two floors and for the two boots compared. A figure inside that is not
read as a leak nor as its absence: the DSV4 kit's floor moves by tens of MiB from one half-minute
to the next, so a run of a hundred requests cannot tell 100 KiB a request from nothing. So:

* ``leak``: the figure is above the limit and above the resolution;
* ``pass``: it is at or under the limit, and the resolution is finer than the limit;
* ``inconclusive``: the resolution is coarser than the limit and the figure is inside it (the
  reason says what the run could resolve; a longer or busier run resolves more).

Neither rule applies (a soak of a minute, no control): ``unjudged``, said as such.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import median, quantiles
from typing import Any

LEAK_MIB_PER_1000 = 100.0  # 100 KiB a request
MIN_PLATEAU_REQUESTS = 40
MIN_WINDOW_SAMPLES = 5
CONTROL_MARGIN_PCT = 5.0
WARM_FRACTION = 0.2
NOISE_WINDOWS = 8  # short windows over the judged span whose floors give the noise
NOISE_SIGMAS = 2.0  # a figure counts once it is this many standard deviations of its noise away


@dataclass(frozen=True)
class RssSample:
    """One reading of the scheduler's RSS: seconds since the traffic began, requests served so far."""

    t_s: float
    served: int
    kib: int


@dataclass(frozen=True)
class MemoryVerdict:
    verdict: str  # "pass", "leak", "inconclusive" or "unjudged"
    rule: str | None  # "plateau", "control" or None
    reason: str
    mib_per_1000_requests: float | None = None  # plateau: floor growth over the second half
    requests_between: int | None = None  # plateau: requests between the two quarters' middles
    stock_mib_per_1000_requests: float | None = None  # plateau: the stock control's own, when long enough
    profile_growth_pct: float | None = None  # control: over the stock's minutes
    stock_growth_pct: float | None = None
    resolution: float | None = None  # the smallest figure the rule can tell from noise (its unit)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def samples_of(rows: list[Any]) -> list[RssSample]:
    """Samples from ``(t_s, served, kib)`` rows (the sampler's, or a recorded series)."""
    return [r if isinstance(r, RssSample) else RssSample(float(r[0]), int(r[1]), int(r[2])) for r in rows]


def _floor(window: list[RssSample]) -> float:
    return quantiles([s.kib for s in window], n=4, method="inclusive")[0]


def plateau(samples: list[RssSample], stock: list[RssSample] | None = None) -> MemoryVerdict | None:
    """The second-half rule, above the stock control's own rate when it has one; None when the run
    is too short or too thin for it."""
    rate_between = _plateau_rate(samples)
    if rate_between is None:
        return None
    rate, between = rate_between
    end = samples[-1].t_s
    # The control counts only over the same minutes: a stock boot that ran as long (within a tenth).
    theirs = _plateau_rate(stock, end) if stock and stock[-1].t_s >= 0.9 * end else None
    excess = rate - (theirs[0] if theirs else 0.0)
    # The resolution: the noise of a difference of two floors, per 1,000 requests between them
    # (the stock's own too when it is subtracted).
    noises = [(floor_noise_kib(samples, end / 2, end), between)]
    if theirs:
        noises.append((floor_noise_kib(stock, end / 2, end), theirs[1]))
    # A quarter's floor pools NOISE_WINDOWS / 2 windows: its noise is a window's over the root of that.
    pooled = (NOISE_WINDOWS / 2) ** 0.5
    resolution = NOISE_SIGMAS * sum(2 * (n / 1024 / pooled) ** 2 / b**2 * 1e6 for n, b in noises) ** 0.5
    verdict = _verdict(excess, LEAK_MIB_PER_1000, resolution)
    control_note = f", stock control {theirs[0]:.1f}" if theirs else ""
    return MemoryVerdict(
        verdict, "plateau",
        f"RSS floor moved {rate:.1f} MiB per 1,000 requests over the second half ({between} requests between "
        f"its quarters{control_note}; a leak above {LEAK_MIB_PER_1000:g}; this run resolves {resolution:.0f}"
        + (", too coarse: a longer or busier run" if verdict == "inconclusive" else "") + ")",
        mib_per_1000_requests=round(rate, 2), requests_between=between,
        stock_mib_per_1000_requests=round(theirs[0], 2) if theirs else None, resolution=round(resolution, 1))


def _verdict(excess: float, limit: float, resolution: float) -> str:
    if excess > max(limit, resolution):
        return "leak"
    return "pass" if resolution <= limit else "inconclusive"


def floor_noise_kib(samples: list[RssSample], start: float, end: float) -> float:
    """The standard deviation (KiB) of the RSS floor of one of :data:`NOISE_WINDOWS` windows of
    ``[start, end)`` around the parabola through them (a steady leak's line and a warm-up's bend
    taken out). Not a robust spread: the floor moves in steps (the allocator keeps or gives back
    what a burst took), and the steps are the noise. 0 with fewer than four windows of three
    samples."""
    width = (end - start) / NOISE_WINDOWS
    points = []
    for i in range(NOISE_WINDOWS):
        window = [s for s in samples if start + i * width <= s.t_s < start + (i + 1) * width]
        if len(window) >= 3:
            points.append((start + (i + 0.5) * width, _floor(window)))
    if len(points) < 4:
        return 0.0
    import numpy as np

    ts, fs = np.array([t for t, _ in points]), np.array([f for _, f in points])
    fitted = np.polyval(np.polyfit(ts - ts.mean(), fs, 2), ts - ts.mean())
    return float(np.sqrt(((fs - fitted) ** 2).sum() / (len(points) - 3)))


def _plateau_rate(samples: list[RssSample], end: float | None = None) -> tuple[float, int] | None:
    """MiB per 1,000 requests between the floors of the last two quarters of ``[0, end]`` (default:
    the last sample), and the requests served between them."""
    if not samples:
        return None
    end = samples[-1].t_s if end is None else end
    third = [s for s in samples if end / 2 <= s.t_s < end * 3 / 4]
    fourth = [s for s in samples if s.t_s >= end * 3 / 4]
    if min(len(third), len(fourth)) < MIN_WINDOW_SAMPLES:
        return None
    between = int(median(s.served for s in fourth) - median(s.served for s in third))
    if between < MIN_PLATEAU_REQUESTS:
        return None
    return (_floor(fourth) - _floor(third)) / 1024 / between * 1000, between


def growth_pct(samples: list[RssSample], span_s: float) -> float | None:
    """Floor growth over ``span_s``: from the window after the sample at ``WARM_FRACTION`` of it (a
    fifth of it long) to its last fifth."""
    fifth = span_s / 5
    first = [s for s in samples if span_s * WARM_FRACTION <= s.t_s < span_s * WARM_FRACTION + fifth]
    last = [s for s in samples if span_s - fifth <= s.t_s <= span_s]
    if min(len(first), len(last)) < MIN_WINDOW_SAMPLES:
        return None
    return (_floor(last) - _floor(first)) / _floor(first) * 100


def control(profile: list[RssSample], stock: list[RssSample]) -> MemoryVerdict | None:
    """The same-minutes rule against the stock control; None without a usable control."""
    if not stock or not profile:
        return None
    span = min(stock[-1].t_s, profile[-1].t_s)
    ours, theirs = growth_pct(profile, span), growth_pct(stock, span)
    if ours is None or theirs is None:
        return None
    # The resolution in points: each boot's floor noise over the span, relative to its floor, for a
    # difference of two floors, both boots.
    warm = span * WARM_FRACTION
    points = [floor_noise_kib(s, warm, span) / _floor([x for x in s if x.t_s <= span]) * 100 for s in (profile, stock)]
    # A fifth of the span pools NOISE_WINDOWS / 4 windows of the four fifths after the warm sample.
    pooled = (NOISE_WINDOWS / 4) ** 0.5
    resolution = NOISE_SIGMAS * sum(2 * (p / pooled) ** 2 for p in points) ** 0.5
    verdict = _verdict(ours - theirs, CONTROL_MARGIN_PCT, resolution)
    return MemoryVerdict(
        verdict, "control",
        f"RSS grew {ours:.1f} % over the stock control's {span / 60:.1f} minutes, stock {theirs:.1f} % "
        f"(a leak more than {CONTROL_MARGIN_PCT:g} points above; this run resolves {resolution:.1f} points"
        + (", too coarse: a longer or busier run" if verdict == "inconclusive" else "") + ")",
        profile_growth_pct=round(ours, 2), stock_growth_pct=round(theirs, 2), resolution=round(resolution, 2))


def judge(profile: list[Any], stock: list[Any]) -> MemoryVerdict:
    """The verdict on the profile's RSS series, with the stock control's beside it."""
    ours, theirs = samples_of(profile), samples_of(stock)
    verdict = plateau(ours, theirs) or control(ours, theirs)
    if verdict is not None:
        return verdict
    return MemoryVerdict("unjudged", None,
                         f"too short to judge: {len(ours)} RSS samples, {ours[-1].served if ours else 0} requests, "
                         f"and no stock control of {MIN_WINDOW_SAMPLES} samples or more")
