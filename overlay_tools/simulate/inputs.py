"""What ``simulate`` and its fleet replay (:mod:`.gateway`) both read before a replay: the ``--quick``
sample, the ``--time-scale`` check and the profile's cost coefficients."""

from __future__ import annotations

from typing import Any

QUICK_REQUESTS = 200  # --quick: whole sessions in order of their first request, up to this many requests


def check_time_scale(requests: list[Any], time_scale: float) -> None:
    """The last arrival, scaled, within the clock's range (:data:`.trace.MAX_TIMESTAMP_MS`): else a
    ``ConfigError`` naming ``--time-scale``, its value and the largest factor this trace allows."""
    from adapter.core import env
    from overlay_tools.simulate.trace import MAX_TIMESTAMP_MS, TIMESTAMP_LIMIT

    last = max(r.arrival_ms for r in requests)
    if last * time_scale > MAX_TIMESTAMP_MS:
        raise env.ConfigError("--time-scale", str(time_scale), f"a factor of at most {MAX_TIMESTAMP_MS / last:.6g} "
                              f"for this trace (its last timestamp {last:,} ms, scaled, within 2**53: "
                              f"{TIMESTAMP_LIMIT})")


def first_sessions(requests: list[Any], limit: int) -> list[Any]:
    """Whole sessions in trace order until ``limit`` requests."""
    sessions: dict[int, int] = {}
    for r in requests:
        sessions[r.session] = sessions.get(r.session, 0) + 1
    keep, n = set(), 0
    for s, count in sessions.items():
        if n + count > limit and keep:
            continue
        keep.add(s)
        n += count
    return [r for r in requests if r.session in keep]


def coefficients(profile: str) -> Any:
    """The decode-yield cost model's coefficients the profile sets (``DSV41_DECODE_YIELD_*``, e.g.
    the line ``fit-cost-model`` printed), the defaults for the rest."""
    from adapter import cost_model
    from adapter.ops import check
    from overlay_tools.simulate.fleet import profile_switches

    names = {cost_model.key_name(name) for name, _ in cost_model.DEFAULTS.items()}
    parsed = profile_switches(check.profile_environ(profile)).values  # the registry's parsers
    return cost_model.from_config({key: value for key, value in parsed.items() if key in names})


def describe_coefficients(coef: Any) -> str:
    from adapter import cost_model

    return f"{coef.source} coefficients: " + cost_model.profile_line(coef)
