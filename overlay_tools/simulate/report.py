"""Per-policy figures of a replay, the table, and the optional plot."""

from __future__ import annotations

import math
import sys
import textwrap
import time
from typing import Any

from overlay_tools.simulate.engine import Turn

FS_PER_S = 10**15


PERCENTILE_METHOD = "numpy.percentile's default, linear interpolation (as SGLang's bench_serving)"


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` by :data:`PERCENTILE_METHOD`: between the two nearest
    ranks, so of two values the p90 is 90 % of the way from the smaller to the larger."""
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))


def summarize(turns: list[Turn], wall_s: float, fallbacks: dict[str, int] | None = None,
              hicache: bool = False) -> dict[str, Any]:
    """One policy's figures. "Resume hit": a continuation's match (before any cone; with HiCache,
    device plus what the admission loaded back from host) reached its parent's resume point (of the
    continuations with one: a keyed child that kept less than a page of its parent's history has none).
    "Whole re-prefill": a continuation ran from below half its parent's history. "Full lost" /
    "window lost": at admission, the resume point's Full KV was off the device / only its SWA
    window was (the case cone replay acts on); with HiCache it may still be on host. ``hicache``:
    the cache has a host tier (``host_loaded_tokens`` and ``host_load_backs`` are None without)."""
    ran = [t for t in turns if not t.skipped]
    cont = [t for t in ran if t.continuation]
    resumable = [t for t in cont if t.resume_at > 0]  # a turn that carries no page of its parent's history has none
    hits = sum(t.stock_prefix + t.loaded >= t.resume_at for t in resumable)
    ttft = sorted((t.first_token_fs - t.ready_fs) / FS_PER_S for t in ran)
    return {
        "requests": len(turns),
        "skipped": len(turns) - len(ran),
        "continuation_turns": len(cont),
        "prompt_tokens": sum(t.prompt for t in ran),
        "recomputed_tokens": sum(t.recomputed for t in ran),
        "recomputed_tokens_continuation": sum(t.recomputed for t in cont),
        "history_recomputed_tokens": sum(t.history_recomputed for t in cont),
        "whole_reprefills": sum(t.prefix < t.history // 2 for t in cont),
        "resume_hits": hits,
        "resume_points": len(resumable),
        "resume_hit_rate": round(hits / len(resumable), 4) if resumable else None,
        "resume_full_lost": sum(t.full_lost for t in cont),
        "resume_window_only_lost": sum(t.window_lost for t in cont),
        "retractions": sum(t.retractions for t in turns),
        "retracted_tokens": sum(t.retracted_tokens for t in turns),
        "parked_tokens": sum(t.parked_tokens for t in turns),
        "cone_plans": sum(t.cone for t in ran),
        "cone_fallbacks": dict(fallbacks or {}),
        "host_loaded_tokens": sum(t.loaded for t in ran) if hicache else None,  # None: no host tier
        "host_load_backs": sum(t.loaded > 0 for t in ran) if hicache else None,
        "prefill_s_modelled": round(sum(t.prefill_fs for t in ran) / FS_PER_S, 1),
        "ttft_s_modelled_mean": round(sum(ttft) / len(ttft), 2) if ttft else None,
        "ttft_s_modelled_p90": round(percentile(ttft, 90), 2) if ttft else None,
        "wall_s": round(wall_s, 1),
        "req_per_s": round(len(turns) / wall_s, 1) if wall_s > 0 else None,
    }


def left_out(kv_park: bool = False, dsv4: Any = None) -> list[str]:
    """Every simplification the replay still makes, said in the output (and the JSON). ``dsv4``: the
    fleet's :class:`.dsv4_pool.Dsv4Pool` (the model is DeepSeek-V4), else None."""
    items = [
        "token ids: built from the trace's hash_ids (equal blocks, equal ids); a continuation's prompt is its "
        "parent's prompt + output + fresh ids; every output token is one id; prompts rounded up to whole pages "
        "(at most a page a request)",
        "sessions: the linking rule above (or --session-key); a turn is ready when it has arrived and its "
        "parent has finished",
        "clock: the decode-yield cost model, no forward runs; prefill first, no decode yield, no mixed chunk, "
        "no overlap scheduler; decode steps between two events priced at their middle context length",
        "admission: a real PrefillAdder per request with the running batch reserved at new_token_ratio and the "
        "pass's --max-prefill-tokens left as its rem_input_tokens, but "
        "FCFS in arrival order (no LPM / priority reordering), one chunked request at a time, and the chunked "
        "request reserved like a running one (not through add_chunked_req)",
        "eviction: before each allocation, by as much as SGLang over-estimates it (a prefill pass's extend plus a "
        "page per request, a page per decoding request each step, release_req's retract steps), but a prefill "
        "pass evicts request by request as it admits them (the engine admits the whole pass, then evicts once)",
        "outputs run to the trace's output_length (no early stop; clipped only as the scheduler clips "
        "max_new_tokens to the context length and the pool: clipped_outputs): new_token_ratio's early-EOS estimate "
        "only under-reserves, never over",
        "retraction: the retracted request comes back as its prompt + whole pages of its output (the "
        "rest of its output is decoded again)" + ("; DSV41_KV_PARK (in the profile): a parked request's KV comes back with no prefill and no "
                  "cost (the host restore time is not modelled; pages are re-allocated at re-admission)"
                  if kv_park else "; DSV41_KV_PARK is off in the profile: retracted requests are recomputed"),
        "SWA: running requests' out-of-window SWA is released at page events (maybe_evict_swa per step in the "
        "engine); release_swa_prefix_lock (SGLANG_OPT_RELEASE_PREFILL_SWA) is not modelled",
        *(_dsv4_pool_items(dsv4) if dsv4 is not None else [
            "pools: SGLang's SWAKVPool with one SWA and one Full layer stands for the model's pool, the SWA side "
            "sized by SGLang's DSV4 configurator formula for --swa-prefix-tails",
            "+hicache: HiCache's generic host stack for FULL + SWA; the host->device load-back time is not "
            "modelled (a host hit costs no prefill); backups land by the next pass; no L3"]),
        "one instance: no router, no data parallelism; --share stands for one instance's share of a cluster",
    ]
    return items


def _dsv4_pool_items(dsv4: Any) -> list[str]:
    names = ", ".join(("SWA-only" if r == 0 else f"C{r}") for r in dsv4.layers)
    return [
        f"pools: SGLang's DeepSeekV4TokenToKVPool (SWA, C4 + indexer, C4 compress states, C128 + states) and its "
        f"SWATokenToKVPoolAllocator, every pool at the size SGLang's DSV4PoolConfigurator gives; {len(dsv4.layers)} "
        f"layers ({names}) stand in for the model's {len(dsv4.ratios)} (the allocators count Full and SWA slots, "
        "the compressed pools follow their indices: the accounting does not depend on the layer count); no KV "
        "is written (no forward)",
        "+hicache: SGLang's DeepSeek-V4 host stack (LogicalHostPool anchor; DeepSeekV4PagedHostPool for SWA, C4, "
        "C4 indexer, C128; DeepSeekV4StateHostPool for the C4 states), except what needs CUDA: the copy kernels "
        "(sgl_kernel.kvcacheio) run as pure-torch copies (overlay_tools.simulate.host_copies), host memory is "
        "not cudaHostRegister'ed nor pinned (host_route); the host->device load-back time is not modelled (a host "
        "hit costs no prefill); backups land by the next pass; no L3",
    ]


def load_figures(turns: list[Turn], prefill_fs: int, busy_fs: int, span_fs: int, share: float) -> dict[str, Any]:
    """Whether one modelled instance keeps up with the offered load. Overloaded: its prefill passes
    alone (modelled) take longer than the trace's arrivals span. Prefill work does not batch away
    (a pass costs about its tokens; decode steps serve every running request at once), so the
    waiting queue, and TTFT with it, grows for as long as the trace lasts: TTFT figures are then
    queueing artefacts of the trace's length, not the instance's latency. ``keeps_up_share``: the
    work scales with the share of sessions, so at most ``share * span / prefill`` of the trace is
    what one instance serves (decode steps take some of the span too). ``busy_s_modelled``: prefill
    and decode together."""
    ran = sorted((t for t in turns if not t.skipped), key=lambda t: t.ready_fs)
    quarter = max(1, len(ran) // 4)

    def mean_ttft(ts: list[Turn]) -> float | None:
        return round(sum(t.first_token_fs - t.ready_fs for t in ts) / len(ts) / FS_PER_S, 2) if ts else None

    overloaded = prefill_fs > span_fs
    keeps_up = share * span_fs / prefill_fs if overloaded and span_fs else None
    return {"prefill_busy_s_modelled": round(prefill_fs / FS_PER_S, 1), "busy_s_modelled": round(busy_fs / FS_PER_S, 1),
            "span_s": round(span_fs / FS_PER_S, 1), "overloaded": overloaded,
            "keeps_up_share": float(f"{keeps_up:.4g}") if keeps_up is not None else None,
            "ttft_s_modelled_first_quarter": mean_ttft(ran[:quarter]),
            "ttft_s_modelled_last_quarter": mean_ttft(ran[-quarter:])}


def overload_lines(rows: dict[str, dict[str, Any]]) -> list[str]:
    """One line per overloaded policy: the prefill work beside the span, TTFT's growth and the share
    at which one instance keeps up (as ``--share 1/k``)."""
    out = []
    for policy, row in rows.items():
        if not row.get("overloaded"):
            continue
        share = row["keeps_up_share"]
        keeps = (f"one instance keeps up at about --share 1/{math.ceil(1 / share)} or less" if share else
                 "every arrival is at one instant: no share keeps up (stretch it with --time-scale)")
        out.append(f"OVERLOADED ({policy}): one instance prefills for {row['prefill_busy_s_modelled']:,} s (modelled) "
                   f"over {row['span_s']:,} s of arrivals; its queue grows (TTFT mean "
                   f"{row['ttft_s_modelled_first_quarter']} s in the first quarter, "
                   f"{row['ttft_s_modelled_last_quarter']} s in the last), so its TTFT figures are queueing "
                   f"artefacts; {keeps}")
    return out


def ideal_summary(turns: list[Turn], ideal: dict[int, int]) -> dict[str, Any]:
    ran = [t for t in turns if not t.skipped]
    cont = [t for t in ran if t.continuation]
    return {"recomputed_tokens": sum(t.prompt - ideal[t.index] for t in ran),
            "recomputed_tokens_continuation": sum(t.prompt - ideal[t.index] for t in cont)}


COLUMNS = [
    ("policy", None), ("recomputed", "recomputed_tokens"), ("recomp. cont.", "recomputed_tokens_continuation"),
    ("history recomp.", "history_recomputed_tokens"), ("whole re-prefills", "whole_reprefills"),
    ("resume hit", "resume_hit_rate"), ("Full lost", "resume_full_lost"), ("window lost", "resume_window_only_lost"),
    ("retractions", "retractions"), ("retracted tok.", "retracted_tokens"), ("parked tok.", "parked_tokens"),
    ("cone plans", "cone_plans"), ("cone loads / tok.", "cone_loads"), ("fallbacks", "cone_fallbacks"),
    ("host loaded", "host_loaded_tokens"), ("prefill s (model)", "prefill_s_modelled"),
    ("TTFT mean / p90 s (model)", None), ("req/s", "req_per_s"), ("leak", "leak"),
]


def _cell(key: str | None, row: dict[str, Any]) -> str:
    value = row.get(key) if key else None
    if key == "cone_fallbacks":  # by reason: 3 (first_chunk_short 2, load_back_budget 1)
        return f"{sum(value.values())} ({', '.join(f'{k} {v}' for k, v in sorted(value.items()))})" if value else "0"
    if key == "cone_loads" and value is not None:
        return f"{value:,} / {row['cone_loaded_tokens']:,}"
    if value is None:
        return "-"
    if isinstance(value, float) and key == "resume_hit_rate":
        return f"{value:.3f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(rows: dict[str, dict[str, Any]], ideal: dict[str, Any]) -> str:
    header = [c for c, _ in COLUMNS]
    body = []
    for policy, row in rows.items():
        cells = [policy] + [_cell(k, row) for _, k in COLUMNS[1:]]
        cells[header.index("TTFT mean / p90 s (model)")] = (
            "overloaded" if row.get("overloaded") else f"{row['ttft_s_modelled_mean']} / {row['ttft_s_modelled_p90']}")
        body.append(cells)
    body.append(["ideal (infinite cache)", f"{ideal['recomputed_tokens']:,}",
                 f"{ideal['recomputed_tokens_continuation']:,}"] + ["-"] * (len(header) - 3))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


class Progress:
    """A one-line progress bar on stderr, shown once a run has lasted ``after`` seconds."""

    def __init__(self, label: str, total: int, after: float = 2.0, stream: Any = None):
        self.label, self.total, self.after = label, max(1, total), after
        self.stream = stream or sys.stderr
        self.start = self.last = time.perf_counter()
        self.shown = False

    def __call__(self, done: int) -> None:
        now = time.perf_counter()
        tty = getattr(self.stream, "isatty", lambda: False)()
        every = 0.5 if tty else 15.0  # a log file gets a line every 15 s, a terminal one redrawn line
        if now - self.start < self.after or (now - self.last < every and done < self.total):
            return
        self.last, self.shown = now, True
        filled = int(30 * done / self.total)
        rate = done / (now - self.start)
        head, tail = ("\r", " ") if tty else ("", "\n")
        self.stream.write(f"{head}{self.label:<10} [{'#' * filled}{'.' * (30 - filled)}] "
                          f"{done}/{self.total} {now - self.start:.0f}s {rate:.0f} req/s{tail}")
        self.stream.flush()

    def close(self) -> None:
        if self.shown and getattr(self.stream, "isatty", lambda: False)():
            self.stream.write("\n")
            self.stream.flush()


def plot(path: str, turns: dict[str, list[Turn]], title: str) -> None:
    """PNG: recomputed tokens per continuation turn as a CDF per policy, and the resume hit rate
    over trace time (continuation turns in 20 equal time bins)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for policy, ts in turns.items():
        cont = [t for t in ts if t.continuation and not t.skipped]
        if not cont:
            continue
        xs = sorted(t.recomputed for t in cont)
        ax1.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=policy)
        end = max(t.ready_fs for t in cont) or 1
        bins: list[list[int]] = [[0, 0] for _ in range(20)]
        for t in cont:
            b = bins[min(19, int(20 * t.ready_fs / (end + 1)))]
            b[0] += t.stock_prefix + t.loaded >= t.resume_at
            b[1] += 1
        centers = [(i + 0.5) * end / 20 / 10**15 for i in range(20)]
        ax2.plot([c for c, b in zip(centers, bins) if b[1]], [b[0] / b[1] for b in bins if b[1]], marker="o",
                 label=policy)
    ax1.set_xscale("log")  # every turn recomputes at least its new tokens (a page or more)
    ax1.set_xlabel("prompt tokens recomputed per continuation turn")
    ax1.set_ylabel("fraction of continuation turns")
    ax1.legend()
    ax2.set_xlabel("simulated time (s, modelled)")
    ax2.set_ylabel("resume-point hit rate")
    ax2.set_ylim(0, 1.05)
    ax2.legend()
    fig.suptitle("\n".join(textwrap.wrap(title, 150)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
