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

Neither applies (a soak of a minute, no control): ``unjudged``, said as such.
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


@dataclass(frozen=True)
class RssSample:
    """One reading of the scheduler's RSS: seconds since the traffic began, requests served so far."""

    t_s: float
    served: int
    kib: int


@dataclass(frozen=True)
class MemoryVerdict:
    verdict: str  # "pass", "leak" or "unjudged"
    rule: str | None  # "plateau", "control" or None
    reason: str
    mib_per_1000_requests: float | None = None  # plateau: floor growth over the second half
    requests_between: int | None = None  # plateau: requests between the two quarters' middles
    stock_mib_per_1000_requests: float | None = None  # plateau: the stock control's own, when long enough
    profile_growth_pct: float | None = None  # control: over the stock's minutes
    stock_growth_pct: float | None = None

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
    leak = excess > LEAK_MIB_PER_1000
    control_note = f", stock control {theirs[0]:.1f}" if theirs else ""
    return MemoryVerdict(
        "leak" if leak else "pass", "plateau",
        f"RSS floor moved {rate:.1f} MiB per 1,000 requests over the second half ({between} requests between "
        f"its quarters{control_note}; a leak above {LEAK_MIB_PER_1000:g})",
        mib_per_1000_requests=round(rate, 2), requests_between=between,
        stock_mib_per_1000_requests=round(theirs[0], 2) if theirs else None)


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
    leak = ours - theirs > CONTROL_MARGIN_PCT
    return MemoryVerdict(
        "leak" if leak else "pass", "control",
        f"RSS grew {ours:.1f} % over the stock control's {span / 60:.1f} minutes, stock {theirs:.1f} % "
        f"(a leak more than {CONTROL_MARGIN_PCT:g} points above)",
        profile_growth_pct=round(ours, 2), stock_growth_pct=round(theirs, 2))


def judge(profile: list[Any], stock: list[Any]) -> MemoryVerdict:
    """The verdict on the profile's RSS series, with the stock control's beside it."""
    ours, theirs = samples_of(profile), samples_of(stock)
    verdict = plateau(ours, theirs) or control(ours, theirs)
    if verdict is not None:
        return verdict
    return MemoryVerdict("unjudged", None,
                         f"too short to judge: {len(ours)} RSS samples, {ours[-1].served if ours else 0} requests, "
                         f"and no stock control of {MIN_WINDOW_SAMPLES} samples or more")
