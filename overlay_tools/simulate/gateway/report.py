"""Per profile x router figures of a fleet run, their table, and the sizing search.

Figures (one row per profile x router): prompt tokens recomputed, and beyond the whole trace's ideal
(one infinite cache holding every earlier request: what no placement can beat); router-predicted
hit tokens (the tree's match on the chosen worker) beside engine-realized ones (the prefix each
request ran from) and the requests the router over-promised; requests and prefilled tokens per
instance with the spread (max / mean of prefilled tokens); modelled TTFT mean / p90 / p99; and
per instance whether its modelled prefill alone outlasts the trace's arrivals (overloaded: its
queue and TTFT grow for as long as the trace lasts); later turns placed on another instance than
their parent turn (moved); per instance the load polls at which smg's worker overload veto took it
out of routing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from overlay_tools.simulate.gateway.replay import FleetRun
from overlay_tools.simulate.report import percentile  # numpy's linear interpolation, as bench_serving


def summarize(run: FleetRun, ideal: dict[int, int]) -> dict[str, Any]:
    ran = [o for o in run.outcomes if o.ttft_s is not None]
    recomputed = sum(o.prompt_tokens - o.cached_tokens for o in ran)
    ideal_recomputed = sum(o.prompt_tokens - ideal[o.index] for o in ran)
    per_requests = [0] * run.instances
    per_prefill = [0] * run.instances
    for o in ran:
        per_requests[o.instance] += 1
        per_prefill[o.instance] += o.prompt_tokens - o.cached_tokens
    mean_prefill = sum(per_prefill) / run.instances
    predicted = sum(o.predicted_tokens for o in ran)
    realized = sum(o.cached_tokens for o in ran)
    ttft = [o.ttft_s for o in ran if o.ttft_s is not None]

    def rounded(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    overloaded = [k for k in range(run.instances) if run.prefill_busy_s[k] > run.span_s]
    return {
        "requests": len(run.outcomes),
        "skipped": len(run.outcomes) - len(ran),
        "prompt_tokens": sum(o.prompt_tokens for o in ran),
        "recomputed_tokens": recomputed,
        "recomputed_beyond_ideal": recomputed - ideal_recomputed,
        "predicted_hit_tokens": predicted,
        "realized_hit_tokens": realized,
        "realized_over_predicted": round(realized / predicted, 4) if predicted else None,
        "overpromised_requests": sum(o.cached_tokens < o.predicted_tokens for o in ran),
        "requests_per_instance": per_requests,
        "prefill_tokens_per_instance": per_prefill,
        "prefill_spread": round(max(per_prefill) / mean_prefill, 3) if mean_prefill else None,
        "prefill_busy_s_per_instance": [round(x, 1) for x in run.prefill_busy_s],
        "span_s": round(run.span_s, 1),
        "overloaded_instances": overloaded,
        "ttft_s_mean": rounded(sum(ttft) / len(ttft)) if ttft else None,
        "ttft_s_p90": rounded(percentile(ttft, 90)) if ttft else None,
        "ttft_s_p99": rounded(percentile(ttft, 99)) if ttft else None,
        "moved_turns": sum(o.moved for o in ran),
        "veto_polls_per_instance": run.veto_polls,
        "router_branches": run.branches,
        "tree_evicted_pages": run.tree_evicted_pages,
        "leak": sum(run.leaks),
    }


COLUMNS = ("profile", "router", "recomputed", "beyond ideal", "predicted hit", "realized hit", "real./pred.",
           "over-promised", "requests / instance", "prefill spread", "moved turns", "vetoed polls / instance",
           "TTFT mean / p90 / p99 s (model)", "overloaded")


def table(rows: dict[tuple[str, str], dict[str, Any]]) -> str:
    body = []
    for (profile, router), row in rows.items():
        over = row["overloaded_instances"]
        body.append([profile, router, f"{row['recomputed_tokens']:,}", f"{row['recomputed_beyond_ideal']:,}",
                     f"{row['predicted_hit_tokens']:,}", f"{row['realized_hit_tokens']:,}",
                     f"{row['realized_over_predicted']}", f"{row['overpromised_requests']:,}",
                     "/".join(map(str, row["requests_per_instance"])), f"{row['prefill_spread']}",
                     f"{row['moved_turns']:,}", "/".join(map(str, row["veto_polls_per_instance"])) or "-",
                     f"{row['ttft_s_mean']} / {row['ttft_s_p90']} / {row['ttft_s_p99']}",
                     ("instances " + ",".join(map(str, over))) if over else "none"])
    widths = [max(len(str(x)) for x in col) for col in zip(COLUMNS, *body)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(COLUMNS, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def overload_lines(rows: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    out = []
    for (profile, router), row in rows.items():
        for k in row["overloaded_instances"]:
            out.append(f"OVERLOADED ({profile}, {router}, instance {k}): it prefills for "
                       f"{row['prefill_busy_s_per_instance'][k]:,} s (modelled) over {row['span_s']:,} s of arrivals; "
                       "its queue grows for as long as the trace lasts, so TTFT there is a queueing artefact")
    return out


def meets(row: dict[str, Any], p90_ms: float | None, p99_ms: float | None) -> bool:
    if row["skipped"] or row["overloaded_instances"]:
        return False
    ok = p90_ms is None or (row["ttft_s_p90"] is not None and row["ttft_s_p90"] * 1000 <= p90_ms)
    return ok and (p99_ms is None or (row["ttft_s_p99"] is not None and row["ttft_s_p99"] * 1000 <= p99_ms))


def smallest_meeting(evaluate: Callable[[int], dict[str, Any]], p90_ms: float | None, p99_ms: float | None,
                     max_n: int) -> int | None:
    """The smallest N whose row meets the targets, assuming more instances never hurt: doubling from 1,
    then bisection between the last N that failed and the first that met. None: not met by ``max_n``."""
    lo, n = 0, 1
    while not meets(evaluate(n), p90_ms, p99_ms):
        if n >= max_n:
            return None
        lo, n = n, min(2 * n, max_n)
    hi = n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(evaluate(mid), p90_ms, p99_ms):
            hi = mid
        else:
            lo = mid
    return hi


def cache_aware_edge(ca: dict[int, dict[str, Any]], rr: dict[int, dict[str, Any]], metric: str = "ttft_s_p90",
                     tolerance: float = 0.01) -> dict[str, Any]:
    """Over the N both were run at: where cache_aware stops beating round_robin on ``metric`` (lower
    by more than ``tolerance``). ``beyond``: the smallest N from which it never beats it again (None:
    it beats it at the largest N run)."""
    ns = sorted(set(ca) & set(rr))
    beats = {n: ca[n][metric] is not None and rr[n][metric] is not None
             and ca[n][metric] < rr[n][metric] * (1 - tolerance) for n in ns}
    beyond = None
    for n in reversed(ns):
        if beats[n]:
            break
        beyond = n
    return {"metric": metric, "tolerance": tolerance, "beats": {str(n): beats[n] for n in ns}, "beyond": beyond,
            "cache_aware": {str(n): ca[n][metric] for n in ns}, "round_robin": {str(n): rr[n][metric] for n in ns}}
