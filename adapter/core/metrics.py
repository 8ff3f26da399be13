"""Prometheus metrics of the switches, fed by the same ``[dsv41]`` events their log lines report.

Every switch already logs one ``[dsv41] <switch> <event> key=value`` line per action through
:func:`adapter.core.receipts.event`. That function hands the same ``(switch, event, params)`` to
:func:`observe`, and :data:`METRICS` (the table below) turns an event into counter increments and
gauge values, so a counter equals what the switch's log lines report by construction. Switches that
log only the first of many actions (native decode's ``serving`` / ``fallback``) feed the count of
the others through :func:`tally` (no log line), under the same event name.

When metrics exist (invariants, checked by ``tests/unit/test_metrics.py``):

* only in a process whose engine exports metrics (SGLang's ``--enable-metrics``: the runtime
  context's ``get_observability().enable_metrics``), through SGLang's own prometheus_client
  multiprocess setup (``PROMETHEUS_MULTIPROC_DIR``, set by the engine before it spawns the
  schedulers; the ``/metrics`` route of the HTTP server collects every process's files);
* only for a switch that emitted an event (so installed), registered on its first event, with
  SGLang's scheduler label names (``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``,
  ``moe_ep_rank``, ``dp_rank`` when set) so the series join the engine's own;
* with metrics off, nothing is registered and prometheus_client is never imported: the decision is
  one attribute (:data:`STATE` ``.on``) that an event site reads before formatting a line it would
  otherwise skip (``if debug or api.metrics_on()``).

Events seen before the engine has published its configuration (model load, e.g. autotune keep)
are held (at most :data:`PENDING_MAX`) while ``PROMETHEUS_MULTIPROC_DIR`` is set, and counted or
dropped once the decision is known.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["METRICS", "PREFIX", "STATE", "WITHOUT_METRICS", "Metric", "metrics_on", "observe", "reset_for_tests", "tally"]

PREFIX = "dsv41_"
PENDING_MAX = 4096
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def _num(key: str) -> Callable[[Mapping[str, object]], float]:
    def read(params: Mapping[str, object]) -> float:
        return float(params.get(key, 0) or 0)

    read.__doc__ = f"the event's ``{key}=``"
    return read


def _present(key: str) -> Callable[[Mapping[str, object]], float]:
    def read(params: Mapping[str, object]) -> float:
        return 1.0 if key in params else 0.0

    read.__doc__ = f"1 when the event has ``{key}=``"
    return read


def _us_to_s(key: str) -> Callable[[Mapping[str, object]], float]:
    def read(params: Mapping[str, object]) -> float:
        return float(params.get(key, 0) or 0) / 1e6

    read.__doc__ = f"the event's ``{key}=`` (µs) in seconds"
    return read


def _one(params: Mapping[str, object]) -> float:
    """one per event"""
    return 1.0


@dataclass(frozen=True)
class Metric:
    """One series family: ``name`` (under :data:`PREFIX`), fed by ``switch``'s ``event`` lines.

    ``kind``: ``counter`` (``amount`` added per event), ``cumulative`` (a counter the event reports
    as a running total in ``amount``: the counter is raised to it) or ``gauge`` (set to ``amount``).
    ``labels`` are taken from the event's fields of the same name.
    """

    name: str
    switch: str
    event: str
    doc: str
    kind: str = "counter"
    amount: Callable[[Mapping[str, object]], float] = _one
    labels: tuple[str, ...] = ()


_CONE = "DSV41_SWA_CONE "
METRICS: tuple[Metric, ...] = (
    # decode yield: one `window` line per decode-yield window that ended
    Metric("dsv41_decode_yield_windows_total", "decode_yield", "window",
           "Decode-yield windows that ended, by how they ended (served, min_bs, prompt_gone, streams_gone).",
           labels=("ended",)),
    Metric("dsv41_decode_yield_steps_planned_total", "decode_yield", "window",
           "Decode steps the ended windows planned before the next prefill chunk (n).", amount=_num("n")),
    Metric("dsv41_decode_yield_steps_given_total", "decode_yield", "window",
           "Decode steps the ended windows gave before the next prefill chunk (given).", amount=_num("given")),
    Metric("dsv41_decode_yield_cycle_seconds_total", "decode_yield", "window",
           "Measured mode: wall time of the measured chunk-and-window cycles (cycle_us).",
           amount=_us_to_s("cycle_us")),
    Metric("dsv41_decode_yield_streams_seconds_total", "decode_yield", "window",
           "Measured mode: the windows' part of those cycles, whole: the streams' steps and the alternation "
           "(streams_us); over the cycle seconds it is the share given.", amount=_us_to_s("streams_us")),
    Metric("dsv41_decode_yield_windows_cut_total", "decode_yield", "window",
           "Windows the prompts' bound cut below what the share asked for (cut): a waiting prompt would "
           "otherwise have been held beyond 1 / (1 - pct) of its stock TTFT.", amount=_present("cut")),
    Metric("dsv41_decode_yield_steps_cut_total", "decode_yield", "window",
           "Decode steps the share asked for that the prompts' bound cut (cut): the streams' shortfall.",
           amount=_num("cut")),
    Metric("dsv41_decode_yield_load", "decode_yield", "window",
           "The load guard's measurement at the last ended window (load): prefill arriving into a backlog "
           "over the prefill rate; the share given is pct x (1 - load).", "gauge", _num("load")),
    # decode yield: one `guard` line per window the load guard gave less than pct (a line at most every 10 s)
    Metric("dsv41_decode_yield_windows_guarded_total", "decode_yield", "guard",
           "Windows the load guard armed below pct: prefill arriving into the backlog neared the prefill rate, "
           "so the share given shrank to pct x (1 - load) (each `guard` event, logged or not)."),
    # decode yield: one `burst` line per prefill backlog whose windows the bound cut
    Metric("dsv41_decode_yield_bursts_total", "decode_yield", "burst",
           "Prefill backlogs in which the share could not be given without holding a prompt beyond its "
           "bound (a burst beyond what the share allows): the streams got less than pct."),
    # decode yield: one `unbounded` line per prompt served beyond its bound (a lag it found on arrival)
    Metric("dsv41_decode_yield_prompts_unbounded_total", "decode_yield", "unbounded",
           "Prompts whose first token came beyond 1 / (1 - pct) of their stock TTFT plus one window: they "
           "arrived into a backlog the windows had already lengthened, and inherited that lag."),
    # SWA thin: the `demoted` line reports running totals
    Metric("dsv41_swa_thin_hooked_inserts_total", "swa_thin", "demoted",
           "Checkpoint inserts of a UnifiedTreeCore cache that SWA thin saw (hooked).", "cumulative", _num("hooked")),
    Metric("dsv41_swa_thin_demoting_inserts_total", "swa_thin", "demoted",
           "Hooked inserts that demoted at least one node (demoting_inserts).", "cumulative",
           _num("demoting_inserts")),
    Metric("dsv41_swa_thin_demoted_nodes_total", "swa_thin", "demoted",
           "SWA-bearing nodes moved to the evict-first end of the SWA LRU (demoted_nodes).", "cumulative",
           _num("demoted_nodes")),
    Metric("dsv41_swa_thin_inactive_caches_total", "swa_thin", "inactive",
           "Caches built with the Rust tree core, where SWA thin does nothing."),
    # cone replay
    Metric("dsv41_cone_replay_plans_total", "cone_replay", _CONE + "plan", "Cone replay plans made."),
    Metric("dsv41_cone_replay_planned_tokens_total", "cone_replay", _CONE + "plan",
           "Tokens the plans would recompute (N = F - s).", amount=_num("N")),
    Metric("dsv41_cone_replay_copies_total", "cone_replay", _CONE + "copy", "Admitted plans whose Full pages were copied."),
    Metric("dsv41_cone_replay_copied_bytes_total", "cone_replay", _CONE + "copy",
           "Bytes of Full-side KV copied for the replays.", amount=_num("bytes")),
    Metric("dsv41_cone_replay_tokens_recomputed_total", "cone_replay", _CONE + "forward",
           "Replay rows recomputed in forward passes (tokens).", amount=_num("rows")),
    Metric("dsv41_cone_replay_loads_total", "cone_replay", _CONE + "load",
           "Beside HiCache: plans whose Full KV below F was loaded back from host."),
    Metric("dsv41_cone_replay_loaded_tokens_total", "cone_replay", _CONE + "load",
           "Beside HiCache: Full tokens the cone loaded back from host.", amount=_num("tokens")),
    Metric("dsv41_cone_replay_waits_total", "cone_replay", _CONE + "wait",
           "Plans whose first chunk, cut short by the pass's earlier requests, waited a pass (once a request)."),
    Metric("dsv41_cone_replay_fallbacks_total", "cone_replay", _CONE + "fallback",
           "Requests that fell back to the stock resume point, by reason.", labels=("reason",)),
    # KV park
    Metric("dsv41_kv_park_parks_total", "kv_park", "parked",
           "Park attempts of a finished request's pages, by outcome (queued, saved, refused).", labels=("outcome",)),
    Metric("dsv41_kv_park_parked_bytes_total", "kv_park", "parked", "Bytes offered to the park store.",
           amount=_num("bytes")),
    Metric("dsv41_kv_park_restores_total", "kv_park", "restored", "Parked prefixes restored into the tree."),
    Metric("dsv41_kv_park_restored_tokens_total", "kv_park", "restored", "Tokens restored from the park store.",
           amount=_num("tokens")),
    Metric("dsv41_kv_park_declined_total", "kv_park", "declined", "Entries the park store would not take."),
    Metric("dsv41_kv_park_evictions_total", "kv_park", "evicted", "Parked entries evicted (LRU) to make room."),
    Metric("dsv41_kv_park_evicted_bytes_total", "kv_park", "evicted", "Bytes of the evicted entries.",
           amount=_num("bytes")),
    Metric("dsv41_kv_park_failures_total", "kv_park", "disabled",
           "Failures that disabled parking in a process (a failed copy)."),
    Metric("dsv41_kv_park_held_bytes", "kv_park", "parked", "Bytes the park store holds (entries and copies in flight).",
           "gauge", _num("held")),
    Metric("dsv41_kv_park_held_bytes", "kv_park", "restored", "", "gauge", _num("held")),
    # native SWA decode
    Metric("dsv41_native_decode_served_total", "swa_native_decode", "served",
           "Decode attention calls served in place by the native module."),
    Metric("dsv41_native_decode_fallbacks_total", "swa_native_decode", "fallback",
           "Decode attention calls that took the stock path, by reason.", labels=("reason",)),
    # autotune keep
    Metric("dsv41_autotune_keep_caches_total", "autotune_keep", "reused",
           "Autotune caches of this launch, by outcome (reused, tuned).", labels=("outcome",)),
    Metric("dsv41_autotune_keep_caches_total", "autotune_keep", "tuned and saved", "", labels=("outcome",)),
    Metric("dsv41_autotune_keep_dropped_total", "autotune_keep", "dropped",
           "Autotune caches dropped before load, by reason.", labels=("reason",)),
)

# Switches with no series of their own, and why: with METRICS, one entry per registry switch
# (tests/unit/test_one_place_per_switch.py fails on a switch in neither or in both).
WITHOUT_METRICS: dict[str, str] = {
    "fast_tree_core": "results identical to stock by design; its cost is the tree core's (bench tree-core)",
    "page_rounded_admission": "changes how admission charges KV, not an event; SGLang's own queue and usage "
                              "gauges show its effect",
}

# the label an event gives implicitly (the event itself names the outcome)
_IMPLIED = {("autotune_keep", "reused"): {"outcome": "reused"}, ("autotune_keep", "tuned and saved"): {"outcome": "tuned"}}
_BY_EVENT: dict[tuple[str, str], list[Metric]] = {}
for _m in METRICS:
    _BY_EVENT.setdefault((_m.switch, _m.event), []).append(_m)


def families() -> dict[str, Metric]:
    """One record per series family (the first record that names it: its doc, kind and labels)."""
    out: dict[str, Metric] = {}
    for metric in METRICS:
        out.setdefault(metric.name, metric)
    return out


@dataclass
class _State:
    on: bool = False  # read at event sites: metrics are exported by this process
    decided: bool = False
    pending: list[tuple[str, str, dict[str, object]]] = field(default_factory=list)
    base: dict[str, str] = field(default_factory=dict)  # SGLang's scheduler labels
    objects: dict[str, Any] = field(default_factory=dict)  # family name -> prometheus_client metric
    totals: dict[tuple[str, tuple[str, ...]], float] = field(default_factory=dict)  # cumulative: last seen


STATE = _State()


def _engine_decision() -> tuple[bool, dict[str, str]] | None:
    """(metrics on, base labels) once the engine has published its configuration; None before."""
    context = sys.modules.get("sglang.srt.runtime_context")
    if context is None:
        return None
    try:
        if not context.get_context().is_config_namespace_published("observability"):
            return None  # not published yet: no exception raised per call (benches, unit tests)
        on = bool(context.get_observability().enable_metrics)
        if not on:
            return False, {}
        parallel = context.get_parallel()
        labels = {"model_name": str(context.get_serving().served_model_name), "engine_type": _engine_type(context),
                  "tp_rank": str(parallel.tp_rank), "pp_rank": str(parallel.pp_rank),
                  "moe_ep_rank": str(parallel.moe_ep_rank)}
        if parallel.dp_rank is not None:
            labels["dp_rank"] = str(parallel.dp_rank)
        extra = getattr(context.get_observability(), "extra_metric_labels", None) or {}
        labels.update({str(k): str(v) for k, v in dict(extra).items()})
        return True, labels
    except Exception:  # not published yet in this process
        return None


def _engine_type(context: Any) -> str:
    try:
        disagg = context.get_disagg()
        if disagg.enable_pd_role_switch:
            return "dynamic"
        from sglang.srt.disaggregation.utils import DisaggregationMode

        return str(DisaggregationMode.to_engine_type(disagg.disaggregation_mode))
    except Exception:  # an engine without disaggregation state: SGLang's default label
        return "unified"


def _decide() -> bool:
    decision = _engine_decision()
    if decision is None:
        return False
    STATE.decided = True
    STATE.on, STATE.base = decision[0], decision[1]
    pending, STATE.pending = STATE.pending, []
    if STATE.on:
        for item in pending:
            _count(*item)
    return True


def metrics_on() -> bool:
    """This process exports the switches' metrics (cheap: an attribute once decided)."""
    return STATE.on if STATE.decided else _decide() and STATE.on


def observe(switch: str, what: str, params: Mapping[str, object]) -> None:
    """An event a switch logged (``receipts.event`` calls this for every line)."""
    if STATE.decided:
        if STATE.on and (switch, what) in _BY_EVENT:
            _count(switch, what, dict(params))
        return
    if (switch, what) not in _BY_EVENT:
        return
    if _decide():
        if STATE.on:
            _count(switch, what, dict(params))
    elif MULTIPROC_ENV in os.environ and len(STATE.pending) < PENDING_MAX:
        STATE.pending.append((switch, what, dict(params)))


def tally(switch: str, what: str, **params: object) -> None:
    """Count an event without a log line (a switch that logs only the first of many); a no-op
    unless metrics are on."""
    if STATE.on or not STATE.decided:
        observe(switch, what, params)


def _family(metric: Metric) -> Any:
    obj = STATE.objects.get(metric.name)
    if obj is None:
        import prometheus_client  # after PROMETHEUS_MULTIPROC_DIR is set: the engine set it before spawning us

        first = families()[metric.name]
        names = [*STATE.base, *first.labels]
        if first.kind == "gauge":
            obj = prometheus_client.Gauge(first.name, first.doc, labelnames=names, multiprocess_mode="mostrecent")
        else:
            obj = prometheus_client.Counter(first.name, first.doc, labelnames=names)
        STATE.objects[metric.name] = obj
    return obj


def _count(switch: str, what: str, params: dict[str, object]) -> None:
    implied = _IMPLIED.get((switch, what), {})
    for metric in _BY_EVENT[(switch, what)]:
        values = {**STATE.base, **{k: str(implied.get(k, params.get(k, ""))) for k in metric.labels}}
        child = _family(metric).labels(**values)
        try:
            amount = metric.amount(params)
        except (TypeError, ValueError):  # a malformed field: count nothing rather than break the engine
            continue
        if metric.kind == "gauge":
            child.set(amount)
        elif metric.kind == "cumulative":
            key = (metric.name, tuple(values.values()))
            last = STATE.totals.get(key, 0.0)
            if amount > last:
                child.inc(amount - last)
            STATE.totals[key] = max(last, amount)
        elif amount > 0:
            child.inc(amount)


def reset_for_tests() -> None:
    """Forget the decision and unregister this process's families (tests that boot twice)."""
    if STATE.objects:
        import prometheus_client

        for obj in STATE.objects.values():
            try:
                prometheus_client.REGISTRY.unregister(obj)
            except KeyError:
                pass
    STATE.__init__()  # type: ignore[misc]
