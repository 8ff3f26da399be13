"""The soak's memory judgement: a leak or not, from the scheduler's RSS series (pure: series in,
verdict out).

The CPU engine warms up for minutes (the DSV4 kit's stock boot grew 25 % in its first three), so
growth against an absolute share from an early sample judges the warm-up, not a leak. A leak adds
a fixed amount per request for as long as requests come; a warm-up levels off. Three rules, first
that applies:

* paired (a stock control as long as the profile: ``--stock-minutes`` at least nine tenths of
  ``--minutes``, the default on DSV4): over the profile's second half, in :data:`PAIRED_WINDOWS`
  windows, the profile's RSS floor minus the stock boot's floor at the same count of requests
  served (the traffic is seeded: the n-th request is the same on both boots, so what both boots do
  at the same point of the traffic, a warm-up or the allocator handing back hundreds of MiB at
  once, cancels out); the least-squares slope of that difference against the requests served is
  the growth per 1,000 requests above stock's, and its resolution is its standard error (from the
  difference's scatter about the line) times :data:`NOISE_SIGMAS`. Needs :data:`MIN_PAIRED_WINDOWS`
  windows inside the requests the stock boot served and :data:`MIN_PLATEAU_REQUESTS` requests
  across them.
* plateau (the run's second half): the floor of the RSS (its lower quartile: transient peaks of a
  big prefill do not count, a leak lifts the floor) in the third and the fourth quarter of the run,
  and the requests served between the two quarters' middles; growth per 1,000 requests above
  the limit is a leak. Needs :data:`MIN_WINDOW_SAMPLES` samples a quarter and
  :data:`MIN_PLATEAU_REQUESTS` requests between them.
* control (too short for either): the profile's floor growth over the stock control's minutes
  (the floor of the window after the sample at :data:`WARM_FRACTION` of those minutes to the floor
  of their last fifth) against the stock's over the same minutes; more than
  :data:`CONTROL_MARGIN_PCT` points above it is a leak.

Each rule knows its own resolution: paired, from the difference's scatter about its line; plateau
and control, from the floor's noise (:func:`floor_noise_kib`: how far the floors of short windows
of the judged span stray from the parabola through them), twice over for the difference of two
floors (and for the two boots compared, control). A figure inside that is not read as a leak nor
as its absence. So:

* ``leak``: the figure is above the limit and above the resolution;
* ``pass``: it is at or under the limit, and the resolution is finer than the limit (the reason
  says "no leak above" the limit, in KiB a request);
* ``inconclusive``: the resolution is coarser than the limit and the figure is inside it (the
  reason says what the run could resolve; a longer or busier run resolves more).

The limit is per kit (:data:`LEAK_KIB_PER_REQUEST`), set by what a 10-minute soak can resolve.
Mellum's floor is flat to a few MiB: 100 KiB a request. The DSV4 kit's is not, on stock as on the
profile: glibc's in-use bytes (``mallinfo2``) grow by about 480 MiB over the first minutes while
Python's object count stays flat (native memory the CPU engine keeps, not cyclic garbage), then
fall by about 300 MiB at once near minute 8 on both boots; ``MALLOC_ARENA_MAX=2`` with fixed mmap
and trim thresholds, or oneDNN's primitive cache turned off, did not flatten it. Paired against
stock, what is left scatters by tens of MiB from one half-minute window to the next, and a
10-minute DSV4 soak serves 250 to 470 requests (a loaded machine to a quiet one), so its paired
slope resolves about 450 to 110 MiB per 1,000 requests, never 100 KiB a request with any margin:
the DSV4 kit's limit is 1 MiB a request, over twice the loaded figure. A leak below that is not
seen on this kit; the Mellum soak is the one that sees 100 KiB.

No rule applies (a soak of a minute, no control): ``unjudged``, said as such.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import median, quantiles
from typing import Any

LEAK_KIB_PER_REQUEST = {"mellum": 100, "dsv4": 1024}  # per kit: what a 10-minute soak resolves (above)
LEAK_MIB_PER_1000 = LEAK_KIB_PER_REQUEST["mellum"] * 1000 / 1024  # the default limit, per 1,000 requests
PAIRED_WINDOWS = 10  # windows over the profile's second half, paired against stock
MIN_PAIRED_WINDOWS = 5
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
    rule: str | None  # "paired", "plateau", "control" or None
    reason: str
    mib_per_1000_requests: float | None = None  # paired: above stock's; plateau: floor growth over the second half
    requests_between: int | None = None  # paired: requests across its windows; plateau: between the quarters' middles
    profile_growth_pct: float | None = None  # control: over the stock's minutes
    stock_growth_pct: float | None = None
    resolution: float | None = None  # the smallest figure the rule can tell from noise (its unit)
    limit: float | None = None  # a leak above this (its unit)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def limit_for(model: str) -> float:
    """A kit's leak limit in MiB per 1,000 requests (:data:`LEAK_KIB_PER_REQUEST`)."""
    return LEAK_KIB_PER_REQUEST[model] * 1000 / 1024


def samples_of(rows: list[Any]) -> list[RssSample]:
    """Samples from ``(t_s, served, kib)`` rows (the sampler's, or a recorded series)."""
    return [r if isinstance(r, RssSample) else RssSample(float(r[0]), int(r[1]), int(r[2])) for r in rows]


def _floor(window: list[RssSample]) -> float:
    return quantiles([s.kib for s in window], n=4, method="inclusive")[0]


def paired(samples: list[RssSample], stock: list[RssSample], limit: float = LEAK_MIB_PER_1000) -> MemoryVerdict | None:
    """The profile's floor minus stock's at the same requests served, over the profile's second
    half: its slope per 1,000 requests against ``limit``; None without a control as long or with
    too few windows inside what stock served."""
    if not samples or not stock or stock[-1].t_s < 0.9 * samples[-1].t_s:
        return None
    end = samples[-1].t_s
    ours = _window_floors(samples, end / 2, end, PAIRED_WINDOWS)
    theirs = _window_floors(stock, stock[-1].t_s / 2 - end / 2 / PAIRED_WINDOWS, stock[-1].t_s,
                            PAIRED_WINDOWS + 1)
    if len(theirs) < 2:
        return None
    import numpy as np

    served, floors = np.array([x for x, _ in theirs]), np.array([f for _, f in theirs])
    # Only where stock served as many: no extrapolation of its floor.
    points = [(x, f - float(np.interp(x, served, floors))) for x, f in ours if served[0] <= x <= served[-1]]
    xs, ds = np.array([x for x, _ in points]), np.array([d for _, d in points])
    if len(points) < MIN_PAIRED_WINDOWS or xs[-1] - xs[0] < MIN_PLATEAU_REQUESTS:
        return None
    spread = float(((xs - xs.mean()) ** 2).sum())
    slope = float(((xs - xs.mean()) * (ds - ds.mean())).sum() / spread)
    scatter = float(np.sqrt(((ds - ds.mean() - slope * (xs - xs.mean())) ** 2).sum() / (len(points) - 2)))
    rate, resolution = slope / 1024 * 1000, NOISE_SIGMAS * scatter / spread**0.5 / 1024 * 1000
    between = int(xs[-1] - xs[0])
    verdict = _verdict(rate, limit, resolution)
    return MemoryVerdict(
        verdict, "paired",
        f"RSS floor above the stock control's at the same requests moved {rate:.1f} MiB per 1,000 requests over "
        f"the second half ({between} requests across {len(points)} windows; {_limit_words(limit, verdict)}; "
        f"this run resolves {resolution:.0f}" + (", too coarse: a longer or busier run" if verdict == "inconclusive" else "")
        + ")",
        mib_per_1000_requests=round(rate, 2), requests_between=between, resolution=round(resolution, 1), limit=limit)


def _windows(samples: list[RssSample], start: float, end: float, windows: int, closed: bool = False
             ) -> list[tuple[float, list[RssSample]]]:
    """(midpoint, samples) of each of ``windows`` equal windows of ``[start, end)`` (``closed``: the
    last one takes a sample at ``end`` too) that holds three samples or more."""
    width = (end - start) / windows
    out = []
    for i in range(windows):
        window = [s for s in samples if start + i * width <= s.t_s < start + (i + 1) * width
                  or (closed and i == windows - 1 and s.t_s == end)]
        if len(window) >= 3:
            out.append((start + (i + 0.5) * width, window))
    return out


def _window_floors(samples: list[RssSample], start: float, end: float, windows: int) -> list[tuple[float, float]]:
    """(median requests served, RSS floor in KiB) of each of ``windows`` windows of ``[start, end]``
    that holds three samples or more."""
    return [(float(median(s.served for s in w)), _floor(w)) for _, w in _windows(samples, start, end, windows, True)]


def _limit_words(limit: float, verdict: str) -> str:
    """The limit in the reason: a pass says what it rules out, in KiB a request."""
    kib = f"{limit * 1024 / 1000:,.0f} KiB a request"
    return f"no leak above {kib}" if verdict == "pass" else f"a leak above {limit:,.0f}, {kib}"


def plateau(samples: list[RssSample], limit: float = LEAK_MIB_PER_1000) -> MemoryVerdict | None:
    """The second-half rule; None when the run is too short or too thin for it."""
    rate_between = _plateau_rate(samples)
    if rate_between is None:
        return None
    rate, between = rate_between
    end = samples[-1].t_s
    # The resolution: the noise of a difference of two floors, per 1,000 requests between them.
    # A quarter's floor pools NOISE_WINDOWS / 2 windows: its noise is a window's over the root of that.
    pooled = (NOISE_WINDOWS / 2) ** 0.5
    noise = floor_noise_kib(samples, end / 2, end)
    resolution = NOISE_SIGMAS * (2 * (noise / 1024 / pooled) ** 2) ** 0.5 / between * 1000
    verdict = _verdict(rate, limit, resolution)
    return MemoryVerdict(
        verdict, "plateau",
        f"RSS floor moved {rate:.1f} MiB per 1,000 requests over the second half ({between} requests between "
        f"its quarters; {_limit_words(limit, verdict)}; this run resolves {resolution:.0f}"
        + (", too coarse: a longer or busier run" if verdict == "inconclusive" else "") + ")",
        mib_per_1000_requests=round(rate, 2), requests_between=between, resolution=round(resolution, 1), limit=limit)


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
    points = [(t, _floor(w)) for t, w in _windows(samples, start, end, NOISE_WINDOWS)]
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
        profile_growth_pct=round(ours, 2), stock_growth_pct=round(theirs, 2), resolution=round(resolution, 2),
        limit=CONTROL_MARGIN_PCT)


def judge(profile: list[Any], stock: list[Any], limit: float = LEAK_MIB_PER_1000) -> MemoryVerdict:
    """The verdict on the profile's RSS series, with the stock control's beside it; ``limit``: MiB
    per 1,000 requests (:func:`limit_for` a kit)."""
    ours, theirs = samples_of(profile), samples_of(stock)
    verdict = paired(ours, theirs, limit) or plateau(ours, limit) or control(ours, theirs)
    if verdict is not None:
        return verdict
    return MemoryVerdict("unjudged", None,
                         f"too short to judge: {len(ours)} RSS samples, {ours[-1].served if ours else 0} requests, "
                         f"and no stock control of {MIN_WINDOW_SAMPLES} samples or more")
