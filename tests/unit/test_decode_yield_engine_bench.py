"""The engine benchmark's load-independent clock: the scheduler's CPU seconds from /proc."""

from __future__ import annotations

import os
import statistics
import time

import pytest

from devkit.bench import BENCHMARKS
from devkit.bench import decode_yield_engine as bench


def test_the_clock_counts_cpu_seconds_of_the_process_not_wall_time_it_waits():
    assert BENCHMARKS["decode-yield-engine"] == "devkit.bench.decode_yield_engine:run"
    clock = bench.SchedulerClock(os.getpid()).start()
    try:
        t0 = time.monotonic()
        time.sleep(0.3)  # waiting: wall time passes, CPU time barely
        t1 = time.monotonic()
        cpu0 = time.process_time()
        # busy until this process has had 0.15 s of CPU (however loaded the machine): CPU time passes too
        while time.process_time() - cpu0 < 0.15 and time.monotonic() - t1 < 20:
            sum(range(1000))
        t2 = time.monotonic()
        time.sleep(0.1)
    finally:
        clock.stop()
    waited, busy = clock.at(t1) - clock.at(t0), clock.at(t2) - clock.at(t1)
    assert waited < 0.1 and busy > 0.1  # the clock's 10 ms ticks see most of the 0.15 s
    assert clock.at(t0 - 10) == clock.samples[0][1] and clock.at(t2 + 10) == clock.samples[-1][1]


def test_share_and_ttft_in_cpu_seconds_take_the_load_out():
    """Streams decoding 100 tokens per CPU second before and 50 during give a CPU share of 0.5
    whatever the wall rates say (here the machine was twice as loaded during the prefill)."""
    clock = bench.SchedulerClock(0)
    clock.samples = [(0.0, 0.0), (2.0, 1.0), (6.0, 2.0)]  # (wall, CPU): 0.5 CPU/s, then 0.25 CPU/s
    phase = {"times": {"before": 0.0, "send": 2.0, "first": 6.0, "end": 6.0},
             "decode_rate_before": 50.0, "decode_rate_during": 12.5}  # wall tokens/s
    figures = bench.cpu_figures(phase, clock)
    assert figures == {"share_cpu": 0.5, "ttft_cpu_s": 1.0}


def _fpm_line(prefill_requests: int, prefill_tokens: int, decode_requests: int, forward_s: float,
              prefix: int = 0) -> str:
    import json

    return json.dumps({"wall_time": forward_s, "scheduled_requests": {
        "num_prefill_requests": prefill_requests, "sum_prefill_tokens": prefill_tokens,
        "sum_prefill_kv_tokens": prefix, "num_decode_requests": decode_requests}})


def test_a_boots_cost_ratio_is_its_stream_steps_median_forward_over_its_lone_prompts_chunks(tmp_path):
    """The lone prompt: the last of the longest back-to-back runs before the streams' first step
    (its warm-up twin of the same length runs cold just before it; the stock boot's prompt beside
    the streams, back to back too, runs after it)."""
    log = tmp_path / "fpm.jsonl"
    log.write_text("\n".join([
        _fpm_line(1, 64, 0, 0.100, 0), _fpm_line(1, 64, 0, 0.100, 64),  # a short prompt: 2 chunks
        # the warm-up twin, cold, then the lone prompt: 3 chunks back to back each, mean 30 ms
        _fpm_line(1, 64, 0, 0.090, 0), _fpm_line(1, 64, 0, 0.090, 64), _fpm_line(1, 64, 0, 0.090, 128),
        _fpm_line(1, 64, 0, 0.020, 0), _fpm_line(1, 64, 0, 0.040, 64), _fpm_line(1, 64, 0, 0.030, 128),
        _fpm_line(0, 0, 4, 0.010), _fpm_line(0, 0, 4, 0.012), _fpm_line(0, 0, 4, 0.030),  # median 12 ms
        # the stock boot's prompt while the streams wait: back to back, after their first step
        _fpm_line(1, 64, 0, 0.300, 0), _fpm_line(1, 64, 0, 0.300, 64), _fpm_line(1, 64, 0, 0.300, 128),
        # a yielding prompt: its chunks come after decode steps (never back to back), left out
        _fpm_line(1, 64, 0, 0.500, 0), _fpm_line(0, 0, 4, 0.012), _fpm_line(1, 64, 0, 0.500, 64),
        _fpm_line(0, 0, 4, 0.012), _fpm_line(1, 64, 0, 0.500, 128), _fpm_line(0, 0, 4, 0.012),
        _fpm_line(1, 64, 0, 0.500, 192),
        _fpm_line(0, 0, 3, 0.001),  # fewer rows than the streams: a stream finishing
        _fpm_line(1, 64, 4, 0.500, 256),  # a mixed batch (decode rows in the chunk)
        "not json",
    ]))
    assert bench.cost_ratio(log, streams=4) == 0.4
    log.write_text(_fpm_line(1, 64, 0, 0.02))
    assert bench.cost_ratio(log, streams=4) is None  # no decode step of the streams: no ratio


def test_the_expected_share_is_pct_at_the_calibrated_ratio_and_moves_with_the_ratio_as_odds():
    assert bench.expected_share(50, 0.5, 0.5) == 0.5
    assert bench.expected_share(20, 0.3, 0.3) == 0.2
    # the boot's steps cost 0.8 of the calibration's against its chunks: 0.8 x the odds 1:1
    assert bench.expected_share(50, 0.4, 0.5) == round(0.8 / 1.8, 4)
    # steps 1.25 x dearer relatively: odds 7/3 x 1.25
    assert bench.expected_share(70, 0.625, 0.5) == round((7 / 3 * 1.25) / (1 + 7 / 3 * 1.25), 4)
    assert bench.expected_share(50, None, 0.5) is None and bench.expected_share(50, 0.5, None) is None


def test_the_full_bench_runs_the_closed_loop_uncalibrated_and_the_open_loop_on_the_stock_boots_fit_under_load(
        monkeypatch, tmp_path):
    """Yield boots carry no coefficient (measured mode); yield on mixed chunk runs with the flag, in rows
    of its own; the under-load pair runs with a competing process, the open loop on the fit of the
    stock boot; medians over all rounds, per quarter too."""
    from devkit.engine_kit import model as mk

    order, flags, shares = [], {}, {"stock": [0.01, 0.02], "yield 50": [0.44, 0.52]}
    drifts = {"yield 50": [0.3, -0.02]}  # the first boot's streams' forward ran 30 % slower in the prefill
    steps = {"yield 50": [1.12, 1.0]}  # and its step, as the switch timed it, 12 % slower
    untimed = {"yield 70 + mixed chunk", "yield 50 open loop under load"}  # no step the bench can take there
    ratios = {"stock-0": 0.5, "stock-1": 0.4, "yield 50 open loop under load-0": 0.4}
    # (forward share, TTFT over the chunk forwards, over all forwards): on the engine's forward times
    # (prefill_forwards)
    forward = {"stock": (0.01, 1.25, 1.24), "yield 50": (0.5, 2.6, 1.3), "interval 1": (0.52, 2.6, 1.25),
               "yield 50 under load": (0.5, 2.7, 1.0)}

    def fake_boot(label, model, w, rounds, *, repeat=0, profile=None, calibrate=False, load=False, **kwargs):
        profile = profile or {}
        order.append((label, repeat, calibrate, profile.get("DSV41_DECODE_YIELD_STEP_US"),
                      profile.get("DSV41_DECODE_YIELD_MODE"), load))
        flags[label] = kwargs.get("extra")
        log = tmp_path / f"{label}-{repeat}.jsonl"
        log.write_text(f"{label}-{repeat}")
        share = shares.get(label, [0.3, 0.3])[repeat]
        return {"label": label, "fpm_log": log, "alone_s": 4.0, "leftover": [], "rounds": [
            {"share": share + d, "decode_share": share + 2 * d, "reference_drift": 0.05, "prefill_s": 5.0 + repeat,
             "ttft_in_boot": 1.2, "throughput": 900.0, "decode_rate_before": 150.0,
             "forward_drift": drifts.get(label, [0.0, 0.0])[repeat], "reference_noise": 0.1 * (repeat + 1) + d,
             "admission_s": 0.05 + d, "share_quarters": [share + 0.1, share, share, share - 0.1],
             **dict(zip(("forward_share", "ttft_forward", "span_forwards"), forward.get(label, (None,) * 3))),
             **({} if label in untimed else {"step_ratio": steps.get(label, [1.0, 1.0])[repeat],
                                            "share_at_speed": round((share + d) * steps.get(label, [1.0, 1.0])[repeat], 4),
                                            "share_quarters_at_speed": [share + d, share, share,
                                                                        None if "load" in label else share - d],
                                            "share_quarters_cycles": [share + 3 * d, share, share,
                                                                      share + (0.1 if "load" in label else 0)]})}
            for d in (-0.01, 0.01)][:rounds]}

    fits = iter(["1", "2"])
    monkeypatch.setattr(bench, "boot_rounds", fake_boot)
    monkeypatch.setattr(bench, "_fit", lambda log: ({"DSV41_DECODE_YIELD_STEP_US": next(fits)}, "profile line:\nX"))
    monkeypatch.setattr(bench, "cost_ratio", lambda log, streams, chunk: ratios.get(log.read_text(), 0.5))
    monkeypatch.setattr(bench, "chunk_growth", lambda log, streams, chunk: 2.0)
    monkeypatch.setattr(mk, "make_model", lambda out, spec: tmp_path)
    monkeypatch.setattr(bench, "OUT", tmp_path)
    monkeypatch.setitem(bench.FULL, "pcts", (50,))
    monkeypatch.setitem(bench.FULL, "boots", 2)
    monkeypatch.setitem(bench.FULL, "rounds", 2)
    monkeypatch.setitem(bench.FULL, "alternatives", (("interval 1", ["--prefill-decode-interval", "1"]),))
    monkeypatch.setitem(bench.FULL, "on_mixed_chunk", (70,))
    monkeypatch.setitem(bench.FULL, "under_load", (50,))
    result = bench.run(quick=False, say=lambda *a: None)
    assert order == [("stock", 0, True, None, None, False), ("yield 50", 0, False, None, None, False),
                     ("stock", 1, True, None, None, False), ("yield 50", 1, False, None, None, False),
                     ("interval 1", 0, False, None, None, False), ("yield 70 + mixed chunk", 0, False, None, None, False),
                     ("yield 50 under load", 0, False, None, None, True),
                     ("yield 50 open loop under load", 0, False, "2", "model", True)]
    assert flags["yield 70 + mixed chunk"] == ["--enable-mixed-chunk"]
    assert [r["label"] for r in result["rows"]] == ["yield 50", "yield 50 under load", "yield 50 open loop under load"]
    assert [r["pct"] for r in result["rows_on_mixed_chunk"]] == [70]
    row = result["rows"][0]
    assert row["boot_shares"] == [0.44, 0.52] and row["expected_share"] is None  # the closed loop has no model share
    assert row["share"] == statistics.median([0.43, 0.45, 0.51, 0.53])  # all 4 rounds
    assert row["share_quarters"] == pytest.approx([0.58, 0.48, 0.48, 0.38])  # per quarter, the median over rounds
    open_loop = result["rows"][2]  # at 0.4 against its calibration boot's 0.4
    assert open_loop["expected_share"] == 0.5 and result["boots"]["yield 50 open loop under load"]["ratio_vs_calibration"] == [1.0]
    assert result["boots"]["yield 50"]["chunk_growth"] == [2.0, 2.0]
    assert result["boots"]["stock"]["ttft_s"] == 5.5 and row["ttft_factor"] == 1.0
    assert [c["cost_ratio"] for c in result["calibrations"]] == [0.5, 0.4]
    # every boot is judged: the median 0.48 is within 0.03 of 0.50, the first boot's 0.44 is not
    assert result["targets_missed"][0].split(":")[0] == "yield 50"
    assert result["targets_missed"][0].split(": ")[1].split(",")[:2] == ["share", "quarters"]
    assert row["quarters_ok"] is False  # 0.58 / 0.38 at the ends
    # at the steps the switch timed in each quarter: the median over rounds, judged apart
    assert row["quarters_at_speed"] == pytest.approx([0.48, 0.48, 0.48, 0.48]) and row["quarters_at_speed_ok"] is True
    assert result["rows_on_mixed_chunk"][0]["quarters_at_speed"] is None
    assert result["rows_on_mixed_chunk"][0]["quarters_at_speed_ok"] is None
    # a quarter without a step (here the under-load boot's last): shown as None, the row not judged
    assert result["rows"][1]["quarters_at_speed"][3] is None and result["rows"][1]["quarters_at_speed_ok"] is None
    # over whole cycles: the median over rounds, judged apart (the under-load boot's last quarter 0.1
    # over; the yield 70 row on mixed chunk has none)
    assert row["quarters_cycles"] == pytest.approx([0.48] * 4) and row["quarters_cycles_ok"] is True
    assert result["rows"][1]["quarters_cycles"][3] == pytest.approx(0.4) and result["rows"][1]["quarters_cycles_ok"] is False
    assert result["rows_on_mixed_chunk"][0]["quarters_cycles_ok"] is None
    assert row["matching_k"] == "interval 1" and row["matching_k_share"] == 0.3
    # on the engine's forward times: the alternative of the closest forward share, judged apart
    assert row["forward_shares"] == [0.5, 0.5] and row["ttft_forward"] == 2.6 and row["spans_forwards"] == [1.3, 1.3]
    # interval 1 at yield's share 0.5: 1.25 / 0.5 = 2.5, and 2.6 is within 1.05x of it
    assert (row["forward_rival"], row["forward_rival_ttft"], row["forward_rival_ok"]) == ("interval 1", 2.5, True)
    assert (result["rows"][1]["forward_rival"], result["rows"][1]["forward_rival_ok"]) == (None, None)  # under load
    # the TTFT bound on forward times: over stock's 1.25, 2.6 gives 2.08 (bound 2.10), 2.7 gives 2.16
    assert (row["ttft_factor_forward"], row["ttft_forward_ok"]) == (2.08, True)
    assert (result["rows"][1]["ttft_factor_forward"], result["rows"][1]["ttft_forward_ok"]) == (2.16, False)
    assert result["rows"][2]["ttft_forward_ok"] is None  # the open loop's boot has no forward figures here
    assert result["rows_on_mixed_chunk"][0]["forward_rival"] is None  # no forward share on mixed chunk
    assert row["matching_k_quarters"] == pytest.approx([0.4, 0.3, 0.3, 0.2])
    # judged apart: the boots whose streams' forward held its reference speed (the second, 0.52)
    assert row["forward_drifts"] == [0.3, -0.02] and row["steady_boot_shares"] == [0.52]
    assert row["steady_share_ok"] is True
    # how far each boot's reference moved within its own spans: the median of its rounds
    assert row["reference_noises"] == pytest.approx([0.1, 0.2])
    assert row["admission_s"] == pytest.approx(0.05)  # the median of its rounds
    # at the step the switch timed: 0.44 x 1.12 = 0.493 and 0.52, both within 0.03 of 0.50
    assert row["step_ratios"] == [1.12, 1.0] and row["boot_shares_at_speed"] == pytest.approx([0.4928, 0.52])
    assert row["share_at_speed_ok"] is True
    # not judged where no step was timed: None, not a miss
    assert result["rows_on_mixed_chunk"][0]["share_at_speed_ok"] is None
    assert result["rows"][2]["boot_shares_at_speed"] == [None] and result["rows"][2]["share_at_speed_ok"] is None


def test_the_bracketed_share_divides_the_rate_during_by_the_mean_of_the_rates_before_and_after():
    from devkit.engine_kit.workload import bracketed_share

    # the machine sped up: 100 tok/s before, 140 after; 60 during is half of the mean 120
    assert bracketed_share(100.0, 60.0, 140.0) == {"decode_rate_after": 140.0, "decode_share_bracketed": 0.5,
                                                     "reference_drift": round(40 / 120, 4)}
    assert bracketed_share(100.0, 60.0, None) == {} and bracketed_share(0.0, 60.0, 100.0) == {}


def test_the_dsv4_bench_boots_the_dsv4_kit_with_one_page_chunks_its_own_logs_and_the_metrics_flags(tmp_path):
    from pathlib import Path

    assert BENCHMARKS["decode-yield-engine-dsv4"] == "devkit.bench.decode_yield_engine:run_dsv4"
    extra = ["--enable-forward-pass-metrics", "--forward-pass-metrics-ipc-name", "ipc://x"]
    server = bench.DSV4.server(Path("/model"), tmp_path / "stock.log", {"DSV41_DECODE_YIELD": "50"}, extra, 256)
    args = server.args
    assert args[args.index("--attention-backend") + 1] == "dsv4"
    assert args[args.index("--chunked-prefill-size") + 1] == "256"
    assert args[args.index("--max-running-requests") + 1] == "3"  # 2 streams and the long prompt
    assert args[-3:] == extra and server.env["DSV41_DECODE_YIELD"] == "50" and server.env["SGL_STUB_DSV4"] == "1"
    assert bench.DSV4.out != bench.MELLUM.out  # the two kits' logs never mix
    w = bench.DSV4.workload(bench.DSV4.full["long"])
    assert w.long_prompt_tokens // bench.DSV4.chunk == 16 and w.streams == 2


def test_a_boot_that_fails_while_serving_is_reported_and_stopped_not_fatal(monkeypatch, tmp_path):
    from devkit.engine_kit import fpm

    stopped = []

    class FakeServer:
        base_url, proc = "http://127.0.0.1:1", type("P", (), {"pid": 1})()

        def start(self):
            return self

        def stop(self):
            stopped.append(True)
            return []

    class FakeEngine:
        out = tmp_path

        def server(self, *args):
            return FakeServer()

    def timed_out(*args):
        raise TimeoutError("timed out after 900 s waiting for the long prompt's first token")

    monkeypatch.setattr(fpm, "Recorder", lambda ipc, log: type("R", (), {"start": lambda self: self,
                                                                         "stop": lambda self: None})())
    monkeypatch.setattr(bench.SchedulerClock, "find", staticmethod(lambda group: None))
    monkeypatch.setattr(bench, "_serve_rounds", timed_out)
    said = []
    result = bench.boot_rounds("mixed chunk", tmp_path, None, 2, say=said.append, engine=FakeEngine())
    assert result["error"] == "failed while serving: TimeoutError: timed out after 900 s waiting for the long prompt's first token"
    assert stopped == [True] and said == [f"  mixed chunk: {result['error']}"]
    assert bench.cost_ratio(result["fpm_log"], 4) is None  # no metrics were written


def test_the_context_share_times_the_streams_tokens_at_their_rate_alone_at_the_context_they_had():
    """The streams' cost per token grows linearly with the tokens they decoded: 1/400 s before
    (around token 400), 1/200 s after (around token 1400). In the prefill (tokens 800 to 1000 over
    2 s) a token costs 1/400 + (1/200 - 1/400) * 500/1000 = 3/800 s alone: 200 tokens are 0.75 s of
    their time, a share of 0.375, where the mean of the rates (300 tok/s) says 100/300 = 0.333."""
    from devkit.engine_kit.workload import context_share

    def decoded(t: float) -> float:  # 100 tok/s during the prefill, from token 800 at t = 0
        return 800 + 100 * t

    found = context_share({"before": (400.0, 400.0), "after": (200.0, 1400.0)}, [0.0, 1.0, 2.0], decoded)
    assert found["decode_share_context"] == 0.375
    assert found["reference_token_s"] == 3 / 800  # what a token is valued at: the cost at token 900
    # each span at its own middle: tokens 800-900 at 850 (0.35625 s per 100), 900-1000 at 950
    assert found["share_quarters_context"] == [round(100 * (1 / 400 + (1 / 400) * 450 / 1000), 4),
                                               round(100 * (1 / 400 + (1 / 400) * 550 / 1000), 4)]
    # and the cost each span's tokens are valued at
    assert found["reference_token_s_quarters"] == [round(1 / 400 + (1 / 400) * 450 / 1000, 7),
                                                   round(1 / 400 + (1 / 400) * 550 / 1000, 7)]
    assert context_share({"before": (400.0, 400.0), "after": (0.0, 1400.0)}, [0.0, 2.0], decoded) == {}


def test_the_reference_noise_is_how_far_a_reference_spans_halves_read_apart_at_constant_work():
    """Rates alone of 400 tok/s before and after (a flat cost: no context growth to take out). The
    span before decodes 400 tokens a second in both halves (1.0 / 1.0); the span after 440 then 360
    (1.1 / 0.9): the reference moved by 0.2 of itself within two seconds."""
    from devkit.engine_kit.workload import reference_noise

    def decoded(t: float) -> float:
        if t <= 10:
            return 400 * t
        return 4000 + 440 * min(t - 10, 1) + 360 * max(t - 11, 0)

    points = {"before": (400.0, 400.0), "after": (400.0, 4400.0)}
    assert reference_noise(points, [(0.0, 2.0)], decoded) == 0.0
    assert reference_noise(points, [(0.0, 2.0), (10.0, 12.0)], decoded) == 0.2
    assert reference_noise({"before": (400.0, 400.0), "after": (0.0, 4400.0)}, [(0.0, 2.0)], decoded) == 0.0


def test_the_lone_prompt_is_timed_after_an_untimed_warm_up_of_the_same_length_on_an_empty_cache(monkeypatch):
    """A boot's first long prompt runs cold; the warm-up has other tokens (no cache hit either way)
    and the cache is flushed before the lone prompt, which is the one timed."""
    from devkit.engine_kit import client
    from devkit.engine_kit import workload as wl

    w = wl.Workload(long_prompt_tokens=300)
    sent = []

    class Lone:
        def __init__(self, base_url, rid, ids, max_new_tokens, timeout_s):
            self.ids, self.error, self.ticks = ids, None, []

        def start(self):
            sent.append(("timed", self.ids))
            self.ticks = [(time.monotonic() + 1.5, 1)]
            return self

        def join(self, timeout_s):
            pass

    monkeypatch.setattr(client, "flush_cache", lambda url: sent.append(("flush", None)))
    monkeypatch.setattr(client, "generate", lambda url, ids, n, timeout_s: sent.append(("warm", ids)))
    monkeypatch.setattr(client, "Stream", Lone)
    monkeypatch.setattr(time, "sleep", lambda s: None)
    ttft, cpu = bench.lone_ttft("http://x", w, "t")
    assert [kind for kind, _ in sent] == ["flush", "warm", "flush", "timed"]
    warm, timed = sent[1][1], sent[3][1]
    assert timed == w.ids("long", 300) and len(warm) == 300 and warm != timed
    assert 1.4 < ttft < 1.6 and cpu is None


def test_the_loop_share_of_each_prompt_is_over_its_cycles_and_its_final_chunk(tmp_path):
    """One value per chunked prompt (a new one starts at a window of prefix 0): the streams' part of
    its served cycles' wall time, with the final chunk (no window line times it) at the median of
    its cycles' overheads; a window that served no cycle (prompt gone) adds nothing."""
    line = ("[dsv41] decode_yield window mode=measured target=50 chunk=64 prefix={} rows=4 n=2 given=2 ended=served "
            "share=0.5 prompt_share=0.5 cycle_us={} streams_us={} rank=tp0")
    log = tmp_path / "yield-50.log"
    log.write_text("\n".join([
        "server started", line.format(0, 200.0, 100.0), line.format(64, 300.0, 160.0), line.format(128, 220.0, 100.0),
        "[dsv41] decode_yield window mode=measured target=50 chunk=64 prefix=0 rows=4 n=0 ended=prompt_gone rank=tp0",
        line.format(64, 400.0, 200.0), "shutdown"]))
    # overheads 100 / 140 / 120: the final chunk at 120; the second prompt's one cycle: 200 of 400 + 200
    assert bench.loop_shares(log) == [round(360 / (720 + 120), 4), round(200 / 600, 4)]
    assert bench.loop_shares(tmp_path / "none.log") == []


WINDOW = ("[dsv41] decode_yield window mode=measured target=70 chunk=64 prefix={} rows=4 n={n} floor=0 given={n} "
          "ended=served share=0.7 prompt_share=0.7 cycle_us={} streams_us={} rank=tp0")


def test_the_switchs_step_in_each_prompt_is_the_streams_time_over_the_steps_it_gave(tmp_path):
    """Per chunked prompt: 3 steps in 75.0 ms then 2 in 52.8 ms, 25.56 ms a step; the next prompt
    (a window of prefix 0) 1 step of 30 ms; a prompt whose windows gave nothing has no step."""
    log = tmp_path / "yield-70.log"
    log.write_text("\n".join([
        WINDOW.format(0, 110000.0, 75000.0, n=3), WINDOW.format(64, 80000.0, 52800.0, n=2),
        WINDOW.format(0, 40000.0, 30000.0, n=1), WINDOW.format(0, 10000.0, 0.0, n=0)]))
    assert bench.loop_steps(log) == [0.02556, 0.03, None]
    assert bench.loop_steps(tmp_path / "none.log") == []


def test_the_share_at_speed_values_the_streams_tokens_at_the_step_the_switch_timed():
    """The Mellum kit's pct 70 boot: the client read 0.65 with a token valued at 24.5 / 4 ms (its
    reference spans), the switch timed the 4 streams' step at 26.4 ms in the prefill: the step ran
    1.078 times slower there, and the same tokens at that step are 0.70 of the prefill's time."""
    phase = {"share": 0.65, "reference_token_s": 0.0245 / 4}
    found = bench.speed_figures(phase, 0.0264, 4)
    assert found == {"step_ratio": round(26.4 / 24.5, 4), "share_at_speed": round(0.65 * 26.4 / 24.5, 4)}
    assert abs(found["share_at_speed"] - 0.70) < 0.001
    assert bench.speed_figures(phase, None, 4) == {}  # no step timed
    assert bench.speed_figures({"share": 0.65}, 0.0264, 4) == {}  # no rate after the prefill: no reference


def test_each_quarter_takes_the_steps_the_switch_timed_in_it_with_the_cycles_laid_from_the_first_chunk():
    """A 4 s prefill whose first chunk starts 0.2 s after the send. Cycles of 1 s, the window's steps
    at the end of each: 5 steps of 100 ms (0.7-1.2 s), 2 of 200 ms (1.8-2.2 s), 3 of 100 ms
    (2.9-3.2 s); the final chunk from 3.2 s to the first token has none. Quarter 1 holds 3 steps in
    0.3 s; quarter 2 2 steps in 0.2 s and 1 in 0.2 s; quarter 3 1 in 0.2 s and 1 in 0.1 s; quarter
    4 2 in 0.2 s."""
    windows = [(1e6, 5e5, 5), (1e6, 4e5, 2), (1e6, 3e5, 3)]
    assert bench.quarter_steps(windows, 0.2, 4.0) == pytest.approx([0.1, 0.4 / 3, 0.15, 0.1])
    # an 8 s span: the last two quarters hold no step
    assert bench.quarter_steps(windows, 0.2, 8.0)[2:] == [None, None]


def test_each_quarters_share_at_speed_values_its_tokens_at_the_step_the_switch_timed_in_it():
    """4 streams; the client's reference values a token at 25 / 4 ms in every quarter; the switch
    timed the step at 27.5 ms in the first two quarters (10 % slower: 0.30 reads 0.33 at speed),
    22.5 ms in the third (0.40 reads 0.36), none in the last."""
    windows = [(1e6, 0.55e6, 20), (1e6, 0.55e6, 20), (1e6, 0.45e6, 20)]
    phase = {"share_quarters": [0.30, 0.30, 0.40, 0.20], "reference_token_s_quarters": [0.025 / 4] * 4,
             "measured_s": 4.0, "admission_s": 0.0}
    found = bench.quarter_speed_figures(phase, windows, 4)
    assert found["step_ratio_quarters"] == [1.1, 1.1, 0.9, None]
    assert found["share_quarters_at_speed"] == [0.33, 0.33, 0.36, None]
    assert bench.quarter_speed_figures({**phase, "reference_token_s_quarters": None}, windows, 4) == {}


def _tokens_of(windows, admission, late=0.0, alone=(0.05, 0.15), streams=2):
    """The client's count: ``streams`` tokens at the end of each step (its windows' steps last in each
    cycle, cycles laid from ``admission``), arriving ``late`` s after it, and the steps the streams
    ran alone before the first chunk."""
    times, t = list(alone), admission
    for cycle_us, streams_us, given in windows:
        end = t + cycle_us / 1e6
        times += [end - streams_us / 1e6 + (k + 1) * streams_us / 1e6 / given + late for k in range(given)]
        t = end
    return [(round(x, 6), streams * (i + 1)) for i, x in enumerate(sorted(times))]


def test_the_quarters_over_whole_cycles_move_each_edge_to_the_nearest_chunk_start():
    """Eight 1 s cycles from 0.2 s after the send (a 0.5 s chunk, then 5 steps of 0.1 s for 2 streams),
    the final chunk to 8.7 s. The client's edges at 2.175 / 4.35 / 6.525 s move to the chunk starts
    at 2.2 / 4.2 / 6.2 s: two whole cycles a quarter, 0.5 each, the last with the final chunk (0.4);
    the first leaves out the streams' steps alone before the first chunk."""
    windows = [(1e6, 5e5, 5)] * 8
    phase = {"measured_s": 8.7, "admission_s": 0.2, "decoded_s": _tokens_of(windows, 0.2)}
    assert bench.cycle_quarters(phase, windows, 2) == {"share_quarters_cycles": [0.5, 0.5, 0.5, 0.4]}
    # tokens arriving up to half a chunk after their step (a layout off by as much) count alike
    late = {**phase, "decoded_s": _tokens_of(windows, 0.2, late=0.2)}
    assert bench.cycle_quarters(late, windows, 2) == {"share_quarters_cycles": [0.5, 0.5, 0.5, 0.4]}
    assert bench.cycle_quarters({**phase, "decoded_s": None}, windows, 2) == {}
    assert bench.cycle_quarters(phase, windows[:3], 2) == {}


def test_a_quarter_over_whole_cycles_takes_the_step_the_switch_timed_in_its_own_windows():
    """The same cycles, the second quarter's windows timed at 0.125 s a step (5 steps in 0.625 s of
    a 1 s cycle: its chunk 0.375 s): its tokens are valued at that step."""
    windows = [(1e6, 5e5, 5)] * 2 + [(1e6, 6.25e5, 5)] * 2 + [(1e6, 5e5, 5)] * 4
    phase = {"measured_s": 8.7, "admission_s": 0.2, "decoded_s": _tokens_of(windows, 0.2)}
    assert bench.cycle_quarters(phase, windows, 2)["share_quarters_cycles"] == [0.5, 0.625, 0.5, 0.4]


def test_each_round_is_judged_at_the_step_its_own_prompts_windows_timed_except_on_mixed_chunk(monkeypatch, tmp_path):
    """Round r's prompt is the r-th chunked prompt in the boot's log (the lone prompts have no
    streams beside them, so no windows); on mixed chunk the windows also credit tokens inside
    chunks, so no step is taken there."""
    from devkit.engine_kit import fpm

    class FakeServer:
        base_url, proc = "http://127.0.0.1:1", type("P", (), {"pid": 1})()

        def start(self):
            return self

        def stop(self):
            return []

    class FakeEngine:
        out = tmp_path

        def server(self, *args):
            return FakeServer()

    def serve(server, w, rounds, result, *args):
        for share in (0.6, 0.8)[:rounds]:
            result["rounds"].append({"share": share, "reference_token_s": 0.005, "times": {},
                                     "share_quarters": [share] * 4, "reference_token_s_quarters": [0.005] * 4,
                                     "measured_s": 0.1})

    monkeypatch.setattr(fpm, "Recorder", lambda ipc, log: type("R", (), {"start": lambda self: self,
                                                                         "stop": lambda self: None})())
    monkeypatch.setattr(bench.SchedulerClock, "find", staticmethod(lambda group: None))
    monkeypatch.setattr(bench, "_serve_rounds", serve)
    w = type("W", (), {"streams": 4, "long_prompt_tokens": 6000})()
    for name in ("yield-70.log", "yield-70-+-mixed-chunk.log"):  # prompts of 22 ms then 18 ms steps
        (tmp_path / name).write_text("\n".join([WINDOW.format(0, 50000.0, 44000.0, n=2),
                                                WINDOW.format(0, 30000.0, 18000.0, n=1)]))
    rounds = bench.boot_rounds("yield 70", tmp_path, w, 2, say=print, engine=FakeEngine())["rounds"]
    assert [r["step_ratio"] for r in rounds] == [1.1, 0.9]
    assert [r["share_at_speed"] for r in rounds] == [0.66, 0.72]
    # per quarter of the 0.1 s span: each prompt's one cycle (50 ms, its steps from 6 ms; 30 ms, its
    # step from 12 ms) has steps in the first two quarters only
    assert [r["share_quarters_at_speed"] for r in rounds] == [[0.66, 0.66, None, None], [0.72, 0.72, None, None]]
    # a prompt of fewer than four windows has no quarters over whole cycles
    assert [r.get("share_quarters_cycles") for r in rounds] == [None, None]
    mixed = bench.boot_rounds("yield 70 + mixed chunk", tmp_path, w, 2, say=print, engine=FakeEngine(),
                              extra=["--enable-mixed-chunk"])["rounds"]
    assert [r.get("step_ratio") for r in mixed] == [None, None]
    one = bench.boot_rounds("yield 70", tmp_path, w, 1, say=print, engine=FakeEngine())["rounds"]
    assert "step_ratio" not in one[0]  # two prompts for one round: which is whose is not known


def _timed_fpm_line(prefill_requests: int, decode_requests: int, forward_s: float, arrived: float,
                    prefix: int = 0) -> str:
    import json

    line = json.loads(_fpm_line(prefill_requests, 64 * prefill_requests, decode_requests, forward_s, prefix))
    return json.dumps({**line, "recv_time": arrived})


def test_the_prefill_on_forward_times_takes_the_streams_steps_and_the_prompts_chunks_from_send_to_its_final_chunk(
        tmp_path):
    """A 192-token prompt sent at 2.0, its first token at 3.0: chunks of 40 ms at prefixes 0, 64 and
    128, the last one's record arriving at 3.05, after the first token (the overlap loop), and
    counted; the streams' steps (4 rows) of 20 ms twice, a 3-row step left out; a chunk before the
    send and a step after the final chunk left out. A mixed batch (decode rows in a chunk), or no
    final chunk after the send, gives no figure."""
    log = tmp_path / "fpm.jsonl"
    before = [_timed_fpm_line(1, 0, 0.500, 1.9, prefix=128)]  # the lone prompt's final chunk, before the send
    prompt = [
        _timed_fpm_line(1, 0, 0.040, 2.1), _timed_fpm_line(0, 4, 0.020, 2.2), _timed_fpm_line(0, 3, 0.100, 2.3),
        _timed_fpm_line(1, 0, 0.040, 2.5, prefix=64), _timed_fpm_line(0, 4, 0.020, 2.6),
    ]
    final = [_timed_fpm_line(1, 0, 0.040, 3.05, prefix=128), _timed_fpm_line(0, 4, 0.500, 3.2)]
    log.write_text("\n".join(before + prompt + final))
    times = {"before": 1.0, "send": 2.0, "first": 3.0, "end": 3.0}
    # the span of 1 s over 120 ms of chunks, and over their 160 ms with the steps': 1 / (1 - rest)
    assert bench.prefill_forwards(log, times, streams=4, prompt_tokens=192) == {
        "forward_share": 0.25, "ttft_forward": 8.333, "span_forwards": 6.25}
    none = {"forward_share": None, "ttft_forward": None, "span_forwards": None}
    log.write_text("\n".join(before + prompt))
    assert bench.prefill_forwards(log, times, streams=4, prompt_tokens=192) == none
    log.write_text("\n".join(before + prompt + [_timed_fpm_line(1, 4, 0.040, 2.7)] + final))
    assert bench.prefill_forwards(log, times, streams=4, prompt_tokens=192) == none


def test_the_forward_rival_is_the_alternative_of_the_closest_forward_share_set_beside_the_row_at_the_rows_share():
    """Yield at forward share 0.72 against interval 4 at 0.67: interval 4's span over its forwards,
    1.25, gives 1.25 / (1 - 0.72) = 4.46 over chunk forwards at 0.72, not its own 3.79 at 0.67."""
    row = {"forward_shares": [0.71, 0.72, 0.73, None], "ttft_forward": 4.3}
    alternatives = {"interval 1": {"forward_shares": [0.36], "spans_forwards": [1.2]},
                    "interval 4": {"forward_shares": [0.67], "spans_forwards": [1.25]},
                    "mixed chunk": {"forward_shares": [None], "spans_forwards": [None]}}
    rival = bench._forward_rival(row, alternatives, loaded=False)
    assert rival == {"forward_rival": "interval 4", "forward_rival_share": 0.67,
                     "forward_rival_ttft": pytest.approx(4.464, abs=1e-3), "forward_rival_ok": True}
    assert bench._forward_rival({**row, "ttft_forward": 4.7}, alternatives, loaded=False)["forward_rival_ok"] is False
    none = {"forward_rival": None, "forward_rival_share": None, "forward_rival_ttft": None, "forward_rival_ok": None}
    assert bench._forward_rival({**row, "forward_shares": [0.9]}, alternatives, loaded=False) == none  # 0.23 away
    assert bench._forward_rival(row, alternatives, loaded=True) == none


def test_the_streams_forward_is_timed_in_the_reference_spans_and_in_the_prefill_on_the_clients_clock(tmp_path):
    """The median forward of the streams' decode-only batches (4 rows) in each span, by arrival
    time: 20 ms before, 30 ms during, 20 ms after, a drift of +0.5; chunks, mixed batches, other
    row counts and records outside the spans are not the streams' step alone. The prompt's first
    chunk (prefix 0) arrives at 2.1 after a 40 ms forward: it started 60 ms after the send."""
    log = tmp_path / "fpm.jsonl"
    log.write_text("\n".join([
        _timed_fpm_line(0, 4, 0.500, 0.5),  # before the reference span
        _timed_fpm_line(1, 0, 0.040, 1.2),  # a prompt before the send: not the one the client timed
        _timed_fpm_line(0, 4, 0.020, 1.1), _timed_fpm_line(0, 4, 0.019, 1.5), _timed_fpm_line(0, 4, 0.021, 1.9),
        _timed_fpm_line(1, 0, 0.040, 2.1), _timed_fpm_line(0, 4, 0.030, 2.2), _timed_fpm_line(1, 4, 0.090, 2.4),
        _timed_fpm_line(0, 3, 0.001, 2.5), _timed_fpm_line(0, 4, 0.029, 2.6), _timed_fpm_line(0, 4, 0.031, 2.9),
        _timed_fpm_line(0, 4, 0.200, 3.5),  # between the first token and the span after: neither
        _timed_fpm_line(0, 4, 0.020, 4.2), _timed_fpm_line(0, 4, 0.020, 4.4),
    ]))
    times = {"before": 1.0, "send": 2.0, "first": 3.0, "end": 3.0, "after": 4.0, "after_end": 5.0}
    found = bench.stream_forwards(log, times, streams=4)
    assert found == {"forward_ms": [20.0, 30.0, 20.0], "forward_drift": 0.5, "first_step_cost": 0.0,
                     "admission_s": 0.06}
    no_after = {k: v for k, v in times.items() if not k.startswith("after")}
    assert bench.stream_forwards(log, no_after, streams=4) == {"forward_ms": [20.0, 30.0, None], "forward_drift": None,
                                                                "first_step_cost": 0.0, "admission_s": 0.06}


def test_the_first_step_cost_is_the_streams_first_forward_after_a_chunk_over_their_later_ones_in_the_prefill(tmp_path):
    """In the prefill, the streams' steps right after a chunk (30 and 36 ms, median 33) against
    their other steps (20, 20, 22 ms, median 20): +0.65. An empty batch between a chunk and a step
    leaves the step after the chunk; steps before the send are not the prefill's. With no step
    after a chunk there is nothing to compare: None."""
    log = tmp_path / "fpm.jsonl"
    lines = [
        _timed_fpm_line(1, 0, 0.040, 1.5), _timed_fpm_line(0, 4, 0.090, 1.6),  # before the send
        _timed_fpm_line(1, 0, 0.040, 2.1), _timed_fpm_line(0, 4, 0.030, 2.2), _timed_fpm_line(0, 4, 0.020, 2.3),
        _timed_fpm_line(0, 4, 0.020, 2.4), _timed_fpm_line(1, 0, 0.040, 2.5), _timed_fpm_line(0, 0, 0.0, 2.55),
        _timed_fpm_line(0, 4, 0.036, 2.6), _timed_fpm_line(0, 4, 0.022, 2.7), _timed_fpm_line(1, 0, 0.040, 2.9),
    ]
    log.write_text("\n".join(lines))
    times = {"before": 1.0, "send": 2.0, "first": 3.0, "end": 3.0}
    assert bench.stream_forwards(log, times, streams=4)["first_step_cost"] == 0.65
    log.write_text("\n".join(line for line in lines if '"num_prefill_requests": 1' not in line))
    assert bench.stream_forwards(log, times, streams=4)["first_step_cost"] is None
