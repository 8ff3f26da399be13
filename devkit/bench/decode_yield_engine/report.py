"""Judging the boots: per label, the medians over its boots and rounds; per decode-yield label, its
targets (share, quarters, TTFT, beside the alternative of the closest share) and the table."""

from __future__ import annotations

import statistics
from typing import Any

from adapter.ops import table

SHARE_TOL, TTFT_SLACK, SAME_SHARE = 0.03, 0.10, 0.05
LOAD_SHARE_TOL = 0.05  # under a competing process
STEADY = 0.10  # a boot whose streams' forward in the prefill is within this of its reference's (stream_forwards)
UNDER_LOAD, OPEN_LOOP = "under load", "open loop"  # label words of the load rows
ON_MIXED = "+ mixed chunk"  # the label's tail of a decode-yield boot with --enable-mixed-chunk
# how far from a row's forward share an alternative is set beside it (_forward_rival): on the Mellum
# kit the span over all forwards held 1.19-1.32 in every boot of a run, stock's at share 0 included;
# on the DSV4 kit it grows with the share (1.01 to 1.07: 2-4 ms a pass, steps of 22-26 ms), which
# favours an alternative of a lower share set at the row's
RIVAL_SHARE = 0.15


def expected_share(pct: int, ratio: float | None, calibration_ratio: float | None) -> float | None:
    """The share the cost model gives on a boot whose cost ratio is ``ratio`` when its coefficients
    were fitted where it was ``calibration_ratio``: the model grants steps for odds pct/(100-pct) at
    the calibrated ratio, and the odds scale with the ratio (N steps of cost r against a chunk)."""
    if not ratio or not calibration_ratio:
        return None
    odds = pct / (100 - pct) * ratio / calibration_ratio
    return round(odds / (1 + odds), 4)


def _median(rounds: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rounds if r.get(key) is not None]
    return statistics.median(values) if values else None


def _forward_rival(row: dict[str, Any], alternatives: dict[str, dict[str, Any]],
                   loaded: bool) -> dict[str, Any]:
    """The alternative whose forward share (the median over its boots) is closest to the row's,
    within :data:`RIVAL_SHARE`, set beside the row at the row's own share: its TTFT over chunk
    forwards there is its ``span_forwards`` / (1 - the row's share) (:func:`prefill_forwards`; no K
    lands on yield's share, and near pct 70 a 0.04 lower share is 14 % less TTFT by that alone).
    ``forward_rival_ok``: the row's ``ttft_forward`` no worse than 1.05x that. None under load (the
    alternatives ran without the competing process), on mixed chunk, or where no alternative comes
    that close."""
    def median_of(summary: dict[str, Any], key: str) -> float | None:
        values = [v for v in summary[key] if v is not None]
        return statistics.median(values) if values else None

    none = {"forward_rival": None, "forward_rival_share": None, "forward_rival_ttft": None, "forward_rival_ok": None}
    share = median_of(row, "forward_shares")
    if loaded or share is None or row["ttft_forward"] is None:
        return none
    timed = {name: (median_of(v, "forward_shares"), median_of(v, "spans_forwards")) for name, v in alternatives.items()}
    timed = {name: v for name, v in timed.items() if v[0] is not None and v[1] is not None}
    if not timed:
        return none
    name, (rival_share, rival_span) = min(timed.items(), key=lambda kv: abs(kv[1][0] - share))
    if abs(rival_share - share) > RIVAL_SHARE:
        return none
    at_share = round(rival_span / (1 - share), 3)
    return {"forward_rival": name, "forward_rival_share": rival_share, "forward_rival_ttft": at_share,
            "forward_rival_ok": row["ttft_forward"] <= at_share * 1.05}


def _quarter_medians(rounds: list[dict[str, Any]], key: str) -> list[float | None] | None:
    """Per quarter, the median over the rounds that have ``key`` (a quarter none of them has: None)."""
    have = [r[key] for r in rounds if r.get(key)]
    if not have:
        return None
    found = [[q[i] for q in have if q[i] is not None] for i in range(4)]
    return [statistics.median(v) if v else None for v in found]


def _all_within(values: list[float | None] | None, target: float, tol: float) -> bool | None:
    """Every value within ``tol`` of ``target``; None (not judged) where there is none or one is missing."""
    if not values or None in values:
        return None
    return all(abs(v - target) <= tol for v in values)


def summarize(runs: dict[str, list[dict[str, Any]]], first_ratio: float | None) -> dict[str, dict[str, Any]]:
    """Per boot label, the medians over its boots' rounds and the per-boot figures (each boot carries
    its ``cost_ratio`` and ``chunk_growth``); ``first_ratio``: the first calibration boot's cost ratio,
    the reference of the boots that carry none of their own."""
    stock_rounds = [r for b in runs["stock"] for r in b["rounds"]]
    stock_ttft = _median(stock_rounds, "prefill_s")
    stock_cpu = _median(stock_rounds, "ttft_cpu_s")
    # stock's TTFT over its chunk forwards: the lone prompt's span on forward times, the streams beside it
    stock_forward = _median(stock_rounds, "ttft_forward")
    summary: dict[str, dict[str, Any]] = {}
    for label, label_boots in runs.items():
        ran = [b for b in label_boots if "error" not in b]
        if not ran:
            summary[label] = {"error": label_boots[0]["error"]}
            continue
        rounds = [r for b in ran for r in b["rounds"]]
        ttft = _median(rounds, "prefill_s")
        ratios = [b["cost_ratio"] for b in ran]
        summary[label] = {
            "share": _median(rounds, "share"), "share_before_only": _median(rounds, "decode_share"),
            "reference_drift": _median(rounds, "reference_drift"), "ttft_s": ttft,
            "ttft_factor": round(ttft / stock_ttft, 3) if ttft and stock_ttft else None,
            "ttft_factor_in_boot": _median(rounds, "ttft_in_boot"),
            "alone_s": round(statistics.median(b["alone_s"] for b in ran), 3),
            "share_cpu": _median(rounds, "share_cpu"),
            "ttft_cpu_s": _median(rounds, "ttft_cpu_s"),
            "ttft_cpu_in_boot": _median(rounds, "ttft_cpu_in_boot"),
            "ttft_cpu_factor": (round(_median(rounds, "ttft_cpu_s") / stock_cpu, 3)
                                if stock_cpu and _median(rounds, "ttft_cpu_s") else None),
            "throughput": _median(rounds, "throughput"),
            "rate_before": _median(rounds, "decode_rate_before"),
            "boots": len(ran),
            "boot_shares": [_median(b["rounds"], "share") for b in ran],
            "forward_drifts": [_median(b["rounds"], "forward_drift") for b in ran],
            "first_step_costs": [_median(b["rounds"], "first_step_cost") for b in ran],
            "reference_noises": [_median(b["rounds"], "reference_noise") for b in ran],
            "step_ratios": [_median(b["rounds"], "step_ratio") for b in ran],
            "boot_shares_at_speed": [_median(b["rounds"], "share_at_speed") for b in ran],
            "admission_s": _median(rounds, "admission_s"),
            # the prefill on the engine's forward times (prefill_forwards): a same-share comparison free
            # of the boots' speeds
            "forward_shares": [_median(b["rounds"], "forward_share") for b in ran],
            "spans_forwards": [_median(b["rounds"], "span_forwards") for b in ran],
            "ttft_forward": _median(rounds, "ttft_forward"),
            "ttft_factor_forward": (round(_median(rounds, "ttft_forward") / stock_forward, 3)
                                    if stock_forward and _median(rounds, "ttft_forward") else None),
            # the loop's own measure of each prompt (the switch's window lines), all boots
            "share_loop": (statistics.median(v for b in ran for v in b.get("loop_shares") or [])
                           if any(b.get("loop_shares") for b in ran) else None),
            "share_quarters": _quarter_medians(rounds, "share_quarters"),
            "share_quarters_at_speed": _quarter_medians(rounds, "share_quarters_at_speed"),
            "share_quarters_cycles": _quarter_medians(rounds, "share_quarters_cycles"),
            "chunk_growth": [b["chunk_growth"] for b in ran],
            "cost_ratio": ratios,
            # each boot's ratio over its calibration boot's (the first one's for stock and the alternatives)
            "ratio_vs_calibration": [round(r / b.get("calibration_ratio", first_ratio), 3)
                                     if r and b.get("calibration_ratio", first_ratio) else None
                                     for r, b in zip(ratios, ran)],
        }
        if OPEN_LOOP in label:  # the model's share is for plain chunks, at its calibration boot's ratio
            pct = int(label.split()[1])
            expected = [expected_share(pct, r, b.get("calibration_ratio")) for r, b in zip(ratios, ran)]
            summary[label]["expected_shares"] = expected
            summary[label]["expected_share"] = (statistics.median(e for e in expected if e is not None)
                                                if any(e is not None for e in expected) else None)
    return summary


def judge(summary: dict[str, dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str], str]:
    """Each decode-yield label against its targets, beside the alternatives: (rows, rows on mixed
    chunk, the targets missed, the table)."""
    alternatives = {k: v for k, v in summary.items() if not k.startswith("yield") and "error" not in v}
    header = ["boot", "drift", "share", "before_only", "per boot", "fwd_drift", "fwd_1st", "ref_noise", "step_ratio", "at_speed",
              "loop", "expected", "share_cpu", "ttft_s", "alone_s", "ttft_x", "ttft_x_in_boot",
              "ttft_cpu_x", "ratio/cal", "rate_before", "tok/s", "quarters", "q_at_speed", "q_cycles", "chunk_growth",
              "fwd_share", "ttft/fwd", "ttft_x_fwd", "span/fwd", "rival at share", "target"]
    rows, rows_on_mixed, cells, misses = [], [], [], []
    for label, s in summary.items():
        if "error" in s:
            cells.append([label, *["-"] * (len(header) - 2), f"did not run: {s['error'][:80]}"])
            continue
        verdict, rival_at_share = "", "-"
        if label.startswith("yield"):
            pct = int(label.split()[1])
            share, factor = s["share"], s["ttft_factor"]
            loaded = UNDER_LOAD in label  # the alternatives ran without the competing process: no rival
            tol = LOAD_SHARE_TOL if loaded else SHARE_TOL
            # every boot's share, not only the median: each repetition is a run of its own
            share_ok = share is not None and all(v is not None and abs(v - pct / 100) <= tol for v in s["boot_shares"])
            # the boots whose streams' forward ran at its reference speed during the prefill: there the
            # client's reference is the streams' rate alone (stream_forwards), elsewhere the machine moved
            steady = [v for v, d in zip(s["boot_shares"], s["forward_drifts"]) if d is not None and abs(d) <= STEADY]
            steady_ok = bool(steady) and all(v is not None and abs(v - pct / 100) <= tol for v in steady)
            # every boot with its tokens valued at the step the switch timed in the prefill (speed_figures);
            # not judged (None) where a boot has no step timed (mixed chunk, no window lines)
            at_speed = s["boot_shares_at_speed"]
            at_speed_ok = _all_within(at_speed, pct / 100, tol)
            # the interval K whose share is closest to this row's: what a fixed K does per quarter
            intervals = {k: v for k, v in alternatives.items() if k.startswith("interval")}
            matching_k = (min(intervals.items(), key=lambda kv: abs((kv[1]["share"] or 0) - (share or 0)))
                          if intervals and not loaded else None)
            quarters_ok = bool(s["share_quarters"]) and all(abs(q - pct / 100) <= tol for q in s["share_quarters"])
            # each quarter at the step the switch timed in it; not judged (None) where one has no step
            quarters_at_speed = s["share_quarters_at_speed"]
            quarters_at_speed_ok = _all_within(quarters_at_speed, pct / 100, tol)
            # each quarter over whole cycles (cycle_quarters); not judged where one has no step
            quarters_cycles = s["share_quarters_cycles"]
            quarters_cycles_ok = _all_within(quarters_cycles, pct / 100, tol)
            # the bound on the factor over stock's TTFT, and over the same boot's lone prompt (the load
            # on a shared machine drifts between boots; the in-boot factor does not see that drift)
            bound = 100 / (100 - pct) + TTFT_SLACK
            ttft_ok = factor is not None and factor <= bound
            ttft_in_boot_ok = s["ttft_factor_in_boot"] is not None and s["ttft_factor_in_boot"] <= bound
            # the same bound on forward times (over stock's TTFT over its chunk forwards), free of a
            # chunk's speed moving between the lone prompt and the prompt beside the streams; judged apart
            ttft_forward_ok = None if s["ttft_factor_forward"] is None else s["ttft_factor_forward"] <= bound
            rival = min(alternatives.items(), key=lambda kv: abs((kv[1]["share"] or 0) - (share or 0)))
            near = not loaded and abs((rival[1]["share"] or 0) - (share or 0)) <= SAME_SHARE
            rival_ok = not near or s["ttft_factor_in_boot"] <= rival[1]["ttft_factor_in_boot"] * 1.05
            forward_rival = _forward_rival(s, alternatives, loaded)
            if forward_rival["forward_rival"]:
                rival_at_share = (f"{forward_rival['forward_rival']} {forward_rival['forward_rival_ttft']:.2f} "
                                  + ("ok" if forward_rival["forward_rival_ok"] else "worse"))
            failed = [name for name, ok in (("share", share_ok), ("quarters", quarters_ok), ("ttft", ttft_ok),
                                            ("ttft_in_boot", ttft_in_boot_ok), ("vs " + rival[0], rival_ok)) if not ok]
            verdict = "ok" if not failed else "MISS " + ",".join(failed)
            verdict += f" (same share: {rival[0]})" if near else ""
            if failed:
                misses.append(f"{label}: {','.join(failed)}")
            cpu_ok = (s["share_cpu"] is not None and abs(s["share_cpu"] - pct / 100) <= SHARE_TOL
                      and s["ttft_cpu_factor"] is not None and s["ttft_cpu_factor"] <= bound)
            (rows_on_mixed if label.endswith(ON_MIXED) else rows).append({"pct": pct, "share": share, "ttft_factor": factor,
                         "share_before_only": s["share_before_only"], "reference_drift": s["reference_drift"],
                         "ttft_factor_in_boot": s["ttft_factor_in_boot"], "share_cpu": s["share_cpu"],
                         "ttft_cpu_factor": s["ttft_cpu_factor"], "cpu_targets_met": cpu_ok,
                         "boot_shares": s["boot_shares"], "share_loop": s["share_loop"],
                         "forward_drifts": s["forward_drifts"], "first_step_costs": s["first_step_costs"],
                         "reference_noises": s["reference_noises"],
                         "admission_s": s["admission_s"],
                         "steady_boot_shares": steady,
                         "steady_share_ok": steady_ok,
                         "step_ratios": s["step_ratios"], "boot_shares_at_speed": at_speed,
                         "share_at_speed_ok": at_speed_ok,
                         "expected_share": s.get("expected_share"),
                         "share_quarters": s["share_quarters"], "quarters_ok": quarters_ok,
                         "quarters_at_speed": quarters_at_speed, "quarters_at_speed_ok": quarters_at_speed_ok,
                         "quarters_cycles": quarters_cycles, "quarters_cycles_ok": quarters_cycles_ok,
                         "chunk_growth": s["chunk_growth"],
                         "forward_shares": s["forward_shares"], "ttft_forward": s["ttft_forward"],
                         "spans_forwards": s["spans_forwards"], **forward_rival,
                         "ttft_factor_forward": s["ttft_factor_forward"], "ttft_forward_ok": ttft_forward_ok,
                         "matching_k": matching_k[0] if matching_k else None,
                         "matching_k_share": matching_k[1]["share"] if matching_k else None,
                         "matching_k_quarters": matching_k[1]["share_quarters"] if matching_k else None,
                         "label": label})
        def f(v: Any, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)

        cells.append([label, f(s["reference_drift"], ".2f"), f(s["share"], ".3f"), f(s["share_before_only"], ".3f"),
                      "/".join(f(v, ".2f") for v in s["boot_shares"]),
                      "/".join(f(v, "+.2f") for v in s["forward_drifts"]),
                      "/".join(f(v, "+.2f") for v in s["first_step_costs"]),
                      "/".join(f(v, ".2f") for v in s["reference_noises"]),
                      "/".join(f(v, ".2f") for v in s["step_ratios"]),
                      "/".join(f(v, ".2f") for v in s["boot_shares_at_speed"]), f(s["share_loop"], ".3f"),
                      f(s.get("expected_share"), ".3f"), f(s["share_cpu"], ".3f"), f(s["ttft_s"], ".2f"),
                      f(s["alone_s"], ".2f"), f(s["ttft_factor"], ".2f"), f(s["ttft_factor_in_boot"], ".2f"),
                      f(s["ttft_cpu_factor"], ".2f"),
                      "/".join(f(r, ".2f") for r in s["ratio_vs_calibration"]),
                      f(s["rate_before"], ".1f"), f(s["throughput"], ".0f"),
                      "/".join(f(q, ".2f") for q in s["share_quarters"] or []) or "-",
                      "/".join(f(q, ".2f") for q in s["share_quarters_at_speed"] or []) or "-",
                      "/".join(f(q, ".2f") for q in s["share_quarters_cycles"] or []) or "-",
                      "/".join(f(g, ".2f") for g in s["chunk_growth"]),
                      "/".join(f(v, ".2f") for v in s["forward_shares"]), f(s["ttft_forward"], ".2f"),
                      f(s["ttft_factor_forward"], ".2f"),
                      "/".join(f(v, ".2f") for v in s["spans_forwards"]), rival_at_share, verdict])
    return rows, rows_on_mixed, misses, table.render(header, cells)
