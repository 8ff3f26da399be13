"""``python -m adapter bench chat-latency [--quick] [--model mellum|dsv4]``: multi-turn chat latency
per switch and combined, measured by SGLang's own client.

Each row is one server boot of the kit (the gate's launcher settings) with one profile; against it
``python -m sglang.benchmark.serving --backend sglang-oai-chat --dataset-name generated-shared-prefix``
sends seeded multi-turn conversations (groups of prompts sharing a system prompt, several turns
each, Poisson arrivals): many short multi-chunk prompts arrive while others decode, later turns hit
the prefix cache, and a cone replay adds a chunk boundary per resumed turn. The client reads the
kit's own tokenizer (``--tokenizer`` the model folder) and nothing from the network (HF offline).

Rows (:data:`ROWS`): stock, decode yield alone (closed loop and ``model`` mode), SWA thin + cone
replay, yield beside each of them, and the release gate's profile
(:func:`devkit.gate.verdict.build_profile`). Rounds interleave the rows (A B C .. A B C ..), so the
ratios of one run are side by side on the same machine state. Per boot: mean / p99 TTFT, mean /
p99 ITL, median end-to-end latency; per row the mean over its boots and the TTFT ratio to stock
against the bound ``1 / (1 - pct)`` of the row's share (:func:`bound`). On boots with decode yield
the switch's window lines (``DSV41_DEBUG_LOG=1``) are counted: windows, steps given, how they ended.

Per request (the same seed sends the same requests to every boot): ``past bound`` counts a boot's
requests whose TTFT passed the row's bound x that request's stock TTFT (the stock boots' mean) plus
the boot's longest window, the bound each prompt is owed; ``counted`` is how many the switch
itself said it served past their bound (``dsv41_decode_yield_prompts_unbounded_total``, read from
``/metrics``: every boot runs with ``--enable-metrics``). On a stock row ``past bound`` is the noise
floor: each stock boot's requests past the run's tightest bound x the other stock boots' TTFT.

``--quick``: stock and the gate's profile, one round, fewer conversations: two boots and two client
runs, the client's imports done once while the first server boots
(:class:`devkit.engine_kit.serving_client.ServingClient`). ``--sweep``: traffic that loads the kit at
offered loads up to its stock capacity (:mod:`devkit.bench.chat_latency.sweep`). The last line printed
is one JSON object.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devkit.engine_kit import metrics_page
from devkit.engine_kit.serving_client import ServingClient, client_args, client_env
from devkit.gate.verdict import kit_profile as gate_profile

OUT = Path(__file__).resolve().parents[3] / "build" / "bench-chat-latency"
# The traffic (SGLang's generated-shared-prefix dataset, bench_serving's flags), seeded.
TRAFFIC = {"groups": 4, "per_group": 6, "system": 512, "question": 64, "output": 16, "turns": 3, "rate": 4.0}
QUICK_TRAFFIC = {**TRAFFIC, "groups": 2, "per_group": 4}
# ``bench chat-latency-varied``: lengths drawn per conversation (bench_serving's --gsp-range-ratio: each
# system prompt, question and answer length from [ratio x its length, its length]). With every answer
# the same length, a kit serving few rows at once admits in waves (DSV4_CHAT_CHUNK's comment), which
# chat traffic of varied answers does not.
VARIED = {"range_ratio": 0.5}
# Mellum kit: chunk 64 (every system prompt is a multi-chunk prefill), a pool for every conversation.
MELLUM_MAX_TOTAL_TOKENS = 32768
MELLUM_SWA_RATIO = 0.05
CLIENT_TIMEOUT_S = 900
BOOT_TIMEOUT_S = 600  # a chat boot may take 5 minutes on a 2-core machine other work loads (the launcher's 300 s lost boots there)
YIELD_PCT = "33"
CONE = {"DSV41_SWA_CONE_REPLAY": "1", "DSV41_SWA_CONE_TOKENS": "64"}
THIN = {"DSV41_SWA_THIN": "1"}
# every boot exports metrics (stock too, so rows compare): the switch's own count of the prompts it
# served past their bound, beside the client's per-request count
METRICS_ARGS = ("--enable-metrics",)
SWITCH_COUNTERS = {"unbounded": "dsv41_decode_yield_prompts_unbounded_total",
                   "bursts": "dsv41_decode_yield_bursts_total", "steps_cut": "dsv41_decode_yield_steps_cut_total"}
# SGLang's own histograms, as means: time to first token as the server's tokenizer manager sees it (no
# client, no HTTP), and the scheduler's waiting-queue time; beside the client's TTFT they say where
# a boot's time went
SERVER_TIMES = {"server_ttft_ms": "sglang:time_to_first_token_seconds", "queue_ms": "sglang:queue_time_seconds"}


def rows(kit_name: str, quick: bool, varied: bool = False) -> list[tuple[str, dict[str, str]]]:
    """(label, profile) per row; the first is stock. ``varied``: stock, decode yield alone and the
    profile."""
    y = {"DSV41_DECODE_YIELD": YIELD_PCT}
    cone = {**CONE, **({"DSV41_SWA_CONE_TOKENS": "768"} if kit_name == "dsv4" else {})}
    profile = gate_profile(kit_name)
    if quick:
        return [("stock", {}), ("profile", profile)]
    if varied:
        return [("stock", {}), (f"yield {YIELD_PCT}", y), ("profile", profile)]
    return [
        ("stock", {}),
        (f"yield {YIELD_PCT}", y),
        (f"yield {YIELD_PCT} mode=model", {**y, "DSV41_DECODE_YIELD_MODE": "model"}),
        ("thin+cone", {**THIN, **cone}),
        ("yield+thin", {**y, **THIN}),
        ("yield+cone", {**y, **cone}),
        ("profile", profile),
    ]


def bound(profile: dict[str, str]) -> float | None:
    """The TTFT bound of a profile against stock: ``1 / (1 - pct)`` with decode yield, else None."""
    pct = profile.get("DSV41_DECODE_YIELD")
    return None if pct is None else round(100 / (100 - int(pct)), 3)


def figures_of(result: dict[str, Any]) -> dict[str, Any]:
    """The per-boot figures from bench_serving's output file (one JSON object); ``ttfts_ms`` per
    request in the dataset's order (the same seed sends the same requests to every boot), None
    where a request failed."""
    per_request = [round(x * 1000, 1) if x else None for x in result.get("ttfts") or []]
    ttfts = [x for x in per_request if x is not None]
    return {
        "completed": result.get("completed"),
        "mean_ttft_ms": _r(result.get("mean_ttft_ms")),
        "p99_ttft_ms": _r(result.get("p99_ttft_ms")),
        "mean_itl_ms": _r(result.get("mean_itl_ms")),
        "p99_itl_ms": _r(result.get("p99_itl_ms")),
        "median_itl_ms": _r(result.get("median_itl_ms")),
        "request_throughput": None if result.get("request_throughput") is None else round(result["request_throughput"], 3),
        "median_e2e_ms": _r(result.get("median_e2e_latency_ms")),
        "max_ttft_ms": _r(max(ttfts)) if ttfts else None,
        "ttfts_ms": per_request,
    }


def _r(x: Any) -> float | None:
    return None if x is None else round(float(x), 1)


WINDOW_RE = re.compile(r"\[dsv41\] decode_yield window .*?\bn=(\d+).*?\bgiven=(\d+) ended=(\w+)")
STEP_RE = re.compile(r"\bstep_us=([\d.]+)")
BURST_RE = re.compile(r"\[dsv41\] decode_yield (?:burst|over_share)\b")


def window_counts(lines: Sequence[str]) -> dict[str, Any]:
    """The switch's window lines of one boot: windows, steps given, how they ended."""
    windows = [WINDOW_RE.search(line) for line in lines]
    found = [m for m in windows if m]
    ended: dict[str, int] = {}
    for m in found:
        ended[m.group(3)] = ended.get(m.group(3), 0) + 1
    given = [int(m.group(2)) for m in found]
    return {"windows": len(found), "steps_given": sum(given),
            "max_given": max(given) if given else 0, "ended": ended,
            "burst_lines": sum(1 for line in lines if BURST_RE.search(line)),
            "longest_ms": longest_window_ms(lines)}


def longest_window_ms(lines: Sequence[str]) -> float:
    """The longest window a boot's decode-yield lines report, in ms: its steps given at its step
    (measured mode's lines carry ``step_us``; model mode's do not, and count 0)."""
    longest = 0.0
    for line in lines:
        window, step = WINDOW_RE.search(line), STEP_RE.search(line)
        if window and step:
            longest = max(longest, int(window.group(2)) * float(step.group(1)) / 1000)
    return round(longest, 1)


def past_bound(ttfts: Sequence[float | None], stock: Sequence[float | None], bound: float,
               slack_ms: float) -> int | None:
    """How many requests' TTFT passed ``bound`` x their stock TTFT (per request, the same request in
    the stock boots) plus ``slack_ms`` (the boot's longest window: the bound's "plus one window");
    None when the boots' requests do not line up."""
    if not ttfts or len(ttfts) != len(stock):
        return None
    return sum(1 for mine, theirs in zip(ttfts, stock)
               if mine is not None and theirs is not None and mine > bound * theirs + slack_ms)


def per_request_mean(boots: Sequence[Sequence[float | None]]) -> list[float | None]:
    """The mean TTFT of each request over ``boots`` (its present values)."""
    if not boots or len({len(b) for b in boots}) != 1:
        return []
    return [_mean(values) for values in zip(*boots)]


@dataclass
class BootResult:
    label: str
    profile: dict[str, str]
    round: int
    figures: dict[str, Any] = field(default_factory=dict)
    windows: dict[str, Any] = field(default_factory=dict)
    counted: dict[str, int] = field(default_factory=dict)  # the switch's counters (SWITCH_COUNTERS)
    wall_s: float = 0.0
    error: str | None = None


def run_client(client: Any, argv: list[str], out_file: Path, client_log: Path) -> tuple[dict[str, Any], str | None]:
    """One bench_serving run: its last record's figures, or the error with the log's last lines."""
    rc = client.run(argv, client_log, CLIENT_TIMEOUT_S)
    if rc != 0 or not out_file.is_file():
        tail = client_log.read_text(errors="replace").strip().splitlines()[-3:]
        return {}, f"client exit {rc}: {' | '.join(tail)}"
    records = [json.loads(x) for x in out_file.read_text().splitlines() if x.strip()]
    return figures_of(records[-1]), None


def run_boot(kit: Any, model: Path, label: str, profile: dict[str, str], round_: int, out: Path,
             traffic: dict[str, Any], say: Callable[[str], None], client: ServingClient,
             extra: Sequence[str] = ()) -> BootResult:
    """One server boot with ``profile`` and one client run against it."""
    result = BootResult(label, profile, round_)
    safe = re.sub(r"[^A-Za-z0-9]+", "-", label).strip("-")
    log = out / f"r{round_}-{safe}.log"
    boot_profile = {**profile, "DSV41_DEBUG_LOG": "1"} if profile else {}  # window lines; stock stays stock
    server = kit.server(model, log, boot_profile, [*METRICS_ARGS, *extra])
    t0 = time.monotonic()
    try:
        server.start()
        out_file = out / f"r{round_}-{safe}.json"
        out_file.unlink(missing_ok=True)
        client_log = out / f"r{round_}-{safe}.client.txt"
        result.figures, result.error = run_client(client, client_args(server.base_url, model, out_file, traffic),
                                                  out_file, client_log)
        if result.error is None:
            counters = metrics_page.read_counters(server.base_url, [
                *SWITCH_COUNTERS.values(), *(f"{name}_{part}" for name in SERVER_TIMES.values() for part in ("sum", "count"))])
            result.counted = {key: int(counters[name]) for key, name in SWITCH_COUNTERS.items()}
            for key, name in SERVER_TIMES.items():
                count = counters[f"{name}_count"]
                result.figures[key] = round(1000 * counters[f"{name}_sum"] / count, 1) if count else None
    except Exception as exc:  # a failed boot is a row that says so, the other rows still run
        result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        leftover = server.stop()
        if leftover:
            say(f"  {label}: had to kill {len(leftover)} late processes")
    result.windows = window_counts(server.log_lines())
    result.wall_s = round(time.monotonic() - t0, 1)
    f = result.figures
    say(f"  round {round_} {label}: " + (result.error or (
        f"TTFT {f['mean_ttft_ms']} / p99 {f['p99_ttft_ms']} ms, ITL {f['mean_itl_ms']} / p99 {f['p99_itl_ms']} ms, "
        f"e2e {f['median_e2e_ms']} ms; windows {result.windows['windows']} ({result.wall_s:.0f} s)")))
    return result


COLUMNS = ("mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms", "median_e2e_ms", "server_ttft_ms", "queue_ms")


def summarize(boots: list[BootResult], turns: int = 1) -> list[dict[str, Any]]:
    """Per row: each column per boot and their mean, the TTFT ratio to stock's mean and the bound;
    per boot, ``past_bound``: the requests served past ``bound`` x their own stock TTFT (the stock
    boots' mean for that request) plus the boot's longest window, and ``counted``: those the switch
    counted itself (``dsv41_decode_yield_prompts_unbounded_total``). A stock boot's ``past_bound`` is
    the noise floor: its requests past the tightest bound of the run x the other stock boots' TTFT.

    With ``turns`` > 1 (conversations of that many turns, listed turn by turn as ``bench_serving``
    reports them), ``past_bound_turn1`` is the same over each conversation's first turn alone: it is
    sent on the client's seeded schedule, the same moment in every boot, while a later turn is sent
    when the previous answer completes, so it arrives into another backlog in each boot and its
    comparison with stock's TTFT is not like for like."""
    labels = list(dict.fromkeys(b.label for b in boots))
    stock = [b for b in boots if not b.profile and not b.error]
    stock_ttft = _mean([b.figures["mean_ttft_ms"] for b in stock])
    stock_p99 = _mean([b.figures["p99_ttft_ms"] for b in stock])
    per_request = per_request_mean([b.figures.get("ttfts_ms") or [] for b in stock])
    tightest = min((x for x in (bound(b.profile) for b in boots) if x is not None), default=None)
    table = []
    for label in labels:
        mine = [b for b in boots if b.label == label]
        ok = [b for b in mine if not b.error]
        row: dict[str, Any] = {"row": label, "boots": len(ok), "errors": [b.error for b in mine if b.error],
                               "bound": bound(mine[0].profile)}
        for col in COLUMNS:
            values = [b.figures.get(col) for b in ok]
            row[col] = values
            row[col + "_mean"] = _mean(values)
        row["ttft_ratio"] = _ratio(row["mean_ttft_ms_mean"], stock_ttft)
        row["p99_ttft_ratio"] = _ratio(row["p99_ttft_ms_mean"], stock_p99)
        row["windows"] = [b.windows.get("windows", 0) for b in ok]
        row["burst_lines"] = [b.windows.get("burst_lines", 0) for b in ok]
        row["past_bound"] = [_past_bound(b, stock, per_request, row["bound"] or tightest) for b in ok]
        if turns > 1:
            row["past_bound_turn1"] = [_past_bound(b, stock, per_request, row["bound"] or tightest, turns) for b in ok]
        row["counted"] = [b.counted.get("unbounded") if row["bound"] else None for b in ok]
        table.append(row)
    return table


def _past_bound(boot: BootResult, stock: list[BootResult], per_request: list[float | None],
                limit: float | None, every: int = 1) -> int | None:
    """:func:`past_bound` of one boot: against the stock boots' per-request mean, or for a stock
    boot against the other stock boots (None with one stock boot or no bound in the run); with
    ``every`` > 1, over every ``every``-th request from the first (each conversation's first turn)."""
    if limit is None:
        return None
    if any(b is boot for b in stock):
        others = [b for b in stock if b is not boot]
        if not others:
            return None
        per_request = per_request_mean([b.figures.get("ttfts_ms") or [] for b in others])
    ttfts = boot.figures.get("ttfts_ms") or []
    return past_bound(ttfts[::every], per_request[::every], limit, boot.windows.get("longest_ms", 0.0))


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.fmean(present), 1) if present else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 2)


def print_table(table: list[dict[str, Any]], say: Callable[[str], None] = print) -> None:
    turn1 = any("past_bound_turn1" in r for r in table)
    header = ["row", "mean TTFT ms", "p99 TTFT", "mean ITL", "p99 ITL", "median e2e", "server TTFT", "queue",
              "TTFT / stock", "bound", "past bound", *(["past (turn 1)"] if turn1 else []), "counted", "windows"]

    def cell(row: dict[str, Any], col: str) -> str:
        per = "/".join(f"{v:.0f}" for v in row[col] if v is not None)
        return per or "-"

    def per_boot(values: Sequence[Any]) -> str:
        return "/".join("-" if v is None else str(v) for v in values) or "-"

    lines = [[r["row"], *(cell(r, c) for c in COLUMNS), f"{r['ttft_ratio'] or '-'}", f"{r['bound'] or '-'}",
              per_boot(r["past_bound"]), *([per_boot(r.get("past_bound_turn1", []))] if turn1 else []),
              per_boot(r["counted"]), per_boot(r["windows"])] for r in table]
    from adapter.ops.table import render

    say(render(header, lines, align="left"))
    for r in table:
        for e in r["errors"]:
            say(f"{r['row']}: {e}")


class MellumChat:
    """The Mellum kit with the gate's launcher settings (chunk 64) and a pool for every conversation."""

    name = "mellum"

    def model(self, out: Path) -> Path:
        from devkit.engine_kit import model_kits

        return model_kits.kit("mellum").build(out).resolve()

    def server(self, model: Path, log: Path, profile: dict[str, str], extra: list[str]) -> Any:
        from devkit.engine_kit import launcher

        args = launcher.server_args(model, launcher.free_port(), max_total_tokens=MELLUM_MAX_TOTAL_TOKENS, chunk=64,
                                    swa_ratio=MELLUM_SWA_RATIO, extra=extra)
        server = launcher.Server(args, log, profile)
        server.ready_timeout_s = BOOT_TIMEOUT_S
        return server


# DSV4 kit: one page a chunk, so every chat prompt (500-970 tokens) is a multi-chunk prefill, as on the
# Mellum kit. At the gate's 1024-token chunk each prompt is one pass, decode yield has no chunk
# boundary to act on (one window a run), and stock's ITL rests on admission waves: with 3 running
# rows and equal answer lengths, stock admits three prompts once all three rows finish, so no prompt
# prefills while a row decodes; any window (a row a few tokens ahead) breaks the wave for good.
DSV4_CHAT_CHUNK = 256


class Dsv4Chat:
    """The DeepSeek-V4 kit with the gate's launcher settings (its pool and running rows), chunk
    :data:`DSV4_CHAT_CHUNK`."""

    name = "dsv4"

    def model(self, out: Path) -> Path:
        from devkit.engine_kit import model_kits

        return model_kits.kit("dsv4").build(out).resolve()

    def server(self, model: Path, log: Path, profile: dict[str, str], extra: list[str]) -> Any:
        from devkit.engine_kit import model_kits

        server = model_kits.kit("dsv4").server(model, log, profile, extra, chunk=DSV4_CHAT_CHUNK)
        server.ready_timeout_s = BOOT_TIMEOUT_S
        return server


CHAT_KITS = {"mellum": MellumChat(), "dsv4": Dsv4Chat()}


def measure(kit_name: str, labelled: list[tuple[str, dict[str, str]]], rounds: int, traffic: dict[str, Any],
            out: Path, say: Callable[[str], None] = print) -> list[BootResult]:
    """Every row once per round, rows interleaved within a round (A B .. A B ..)."""
    if kit_name not in CHAT_KITS:
        raise ValueError(f"--model {kit_name!r} is invalid: expected one of {', '.join(CHAT_KITS)}")
    kit = CHAT_KITS[kit_name]
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = kit.model(out)
    boots = []
    with ServingClient(client_env(), out) as client:  # imports while the first server boots
        for round_ in range(1, rounds + 1):
            for label, profile in labelled:
                boots.append(run_boot(kit, model, label, profile, round_, out, traffic, say, client))
    return boots


def run(quick: bool = False, model: str = "mellum", rounds: int | None = None, varied: bool = False) -> dict[str, Any]:
    t0 = time.monotonic()
    traffic = {**(QUICK_TRAFFIC if quick else TRAFFIC), **(VARIED if varied else {})}
    labelled = rows(model, quick, varied)
    rounds = rounds or (1 if quick else 2)
    out = OUT / (f"{model}-varied" if varied else model)
    conversations = traffic["groups"] * traffic["per_group"]
    print(f"chat-latency: {model} kit, {len(labelled)} rows x {rounds} rounds; {conversations} conversations of "
          f"{traffic['turns']} turns ({conversations * traffic['turns']} requests) at {traffic['rate']}/s; "
          f"logs in {out}")
    boots = measure(model, labelled, rounds, traffic, out)
    table = summarize(boots, traffic["turns"])
    print_table(table)
    wall = round(time.monotonic() - t0, 1)
    print(f"chat-latency: {wall:.0f} s")
    return {"model": model, "rounds": rounds, "traffic": traffic,
            "rows": [{k: v for k, v in r.items()} for r in table],
            "boots": [{"row": b.label, "round": b.round, **{c: b.figures.get(c) for c in COLUMNS},
                       "windows": b.windows, "counted": b.counted, "error": b.error} for b in boots],
            "wall_s": wall}


def run_varied(quick: bool = False, model: str = "mellum", rounds: int | None = None) -> dict[str, Any]:
    """``python -m adapter bench chat-latency-varied [--quick] [--model mellum|dsv4]``: the same
    traffic with lengths drawn per conversation (:data:`VARIED`); rows stock, decode yield alone
    and the profile."""
    return run(quick, model, rounds, varied=True)
