"""The decode-yield cost model: integer-only, clock-free, validated keys, and the fit command."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import random
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapter import cost_model
from adapter.core import env, registry
from adapter.ops import cli, fit_cost_model
from devkit.testkit.hypothesis_budget import examples

KNOWN = cost_model.Coefficients(
    chunk_us=31_000, token_ns=52_000, pair_fs=41_300, topk_pair_ps=2_600,
    step_us=27_000, row_ns=730_000, kv_ps=3_100, topk_kv_ps=17_000, topk=2048,
)


def test_the_module_reads_no_clock_and_no_environment():
    """Every rank must decide the same N: no clock, no env, no randomness in the formula's module."""
    tree = ast.parse(inspect.getsource(cost_model))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)
                for alias in node.names} | {node.module.split(".")[0] for node in ast.walk(tree)
                                             if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & {"time", "datetime", "os", "random", "torch", "numpy"}
    names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not names & {"time", "perf_counter", "monotonic", "time_ns", "environ", "getenv"}


def test_the_formula_runs_with_every_clock_made_to_fail(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the cost model read a clock")

    for name in ("time", "perf_counter", "monotonic", "time_ns", "perf_counter_ns", "monotonic_ns"):
        monkeypatch.setattr(time, name, boom)
    chunk = cost_model.chunk_cost([(8192, 100_000), (1, 4000)])
    step = cost_model.step_cost([4000] * 16)
    assert cost_model.yield_steps(33, chunk, step) >= 1


@given(c=st.integers(0, 20_000), p=st.integers(0, 300_000), k=st.integers(0, 5000))
@settings(max_examples=examples(300), deadline=None)
def test_top_k_pairs_closed_form_equals_the_sum_it_describes(c, p, k):
    if c <= 2000:
        # brute force: the query at position j (1-based) attends to keys 1..j, top-k to min(j, k) of them
        assert cost_model.topk_pairs(c, p, k) == sum(min(j, k) for j in range(p + 1, p + c + 1))
        assert cost_model.pairs(c, p) == sum(range(p + 1, p + c + 1))
    assert cost_model.topk_pairs(c, p, k) <= cost_model.pairs(c, p)


@pytest.mark.parametrize(("c", "p", "k", "pairs", "topk"), [
    # counted by hand: queries at positions p+1..p+c, each sees its position's keys, at most k
    (1, 0, 0, 1, 0), (3, 0, 2, 1 + 2 + 3, 1 + 2 + 2), (2, 5, 4, 6 + 7, 4 + 4), (4, 1, 3, 2 + 3 + 4 + 5, 2 + 3 + 3 + 3),
    (0, 9, 4, 0, 0),
])
def test_pairs_match_hand_counted_cases(c, p, k, pairs, topk):
    assert cost_model.pairs(c, p) == pairs and cost_model.topk_pairs(c, p, k) == topk


def _simulated_window(pct, chunk, step, floor, cap):
    """The window rule by simulation: add decode steps one at a time until the decode time is at
    least ``pct`` % of the window (chunk + decode steps), then apply the floor and the cap."""
    n, decoded = 0, 0
    while n < cap and 100 * decoded < pct * (chunk + decoded):
        n += 1
        decoded += step
    return max(floor, n)


@given(
    rows=st.lists(st.tuples(st.integers(0, 16384), st.integers(0, 2_000_000)), min_size=1, max_size=4),
    lens=st.lists(st.integers(1, 1_000_000), min_size=1, max_size=64),
    pct=st.integers(1, 99),
    floor=st.integers(0, 200),
)
@settings(max_examples=examples(300), deadline=None)
def test_every_cost_and_every_n_is_an_exact_integer(rows, lens, pct, floor):
    chunk, step = cost_model.chunk_cost(rows), cost_model.step_cost(lens)
    assert type(chunk) is int and type(step) is int and step > 0
    n = cost_model.yield_steps(pct, chunk, step, floor)
    assert type(n) is int
    assert n == _simulated_window(pct, chunk, step, floor, cost_model.MAX_YIELD_STEPS)


@pytest.mark.parametrize(("pct", "chunk", "step", "floor", "n"), [
    # worked by hand: n steps of `step` give n*step/(chunk + n*step) of the window
    (50, 100, 100, 0, 1),  # 1 step: 100/200 = 50 %
    (50, 101, 100, 0, 2),  # 1 step: 100/201 < 50 %; 2 steps: 200/301
    (33, 1000, 100, 0, 5),  # 4 steps: 400/1400 = 28.6 %; 5 steps: 500/1500 = 33.3 %
    (20, 1000, 300, 0, 1),  # 1 step: 300/1300 = 23 %
    (20, 1000, 300, 3, 3),  # the floor
    (99, 10**6, 1, 0, 128),  # the cap
    (70, 0, 100, 0, 0),  # nothing to yield to
])
def test_the_window_matches_hand_worked_cases(pct, chunk, step, floor, n):
    assert cost_model.yield_steps(pct, chunk, step, floor) == n


@pytest.mark.parametrize(("pct", "chunk", "step", "n"), [
    # worked by hand: the rows got 1 token in the chunk, so 1 + n tokens in chunk + n*step
    (50, 200, 100, 0),  # 1 token in 200: 100/200 = 50 % already (without the credit: 2 steps, 300/400)
    (50, 201, 100, 1),  # 1/201 < 50 %; 2 tokens in 301: 66 %
    (33, 1000, 100, 4),  # 3 steps: 400/1300 = 30.8 %; 4 steps: 500/1400 = 35.7 %
    (20, 1000, 300, 0),  # 300/1000 = 30 % from the chunk alone: nothing to add
])
def test_a_mixed_chunk_window_credits_the_token_each_row_got_inside_the_chunk(pct, chunk, step, n):
    assert cost_model.yield_window(pct, chunk, step, rode_along=1)[0] == n


@given(pct=st.integers(1, 99), chunk=st.integers(10**6, 10**12), step=st.integers(10**6, 10**11))
@settings(max_examples=examples(300), deadline=None)
def test_a_mixed_chunk_window_is_the_fewest_steps_that_give_the_rows_their_token_rate_share(pct, chunk, step):
    n, _ = cost_model.yield_window(pct, chunk, step, rode_along=1)
    assert n <= cost_model.MAX_YIELD_STEPS
    if n < cost_model.MAX_YIELD_STEPS:
        assert 100 * (1 + n) * step >= pct * (chunk + n * step)  # rate during / rate alone >= pct
    if n > 0:
        assert 100 * n * step < pct * (chunk + (n - 1) * step)  # one step fewer falls short


@given(
    pct=st.integers(1, 99),
    step=st.integers(10**6, 10**11),
    chunks=st.lists(st.integers(10**6, 10**12), min_size=1, max_size=40),
    steps=st.lists(st.integers(10**6, 10**11), min_size=40, max_size=40),
)
@settings(max_examples=examples(300), deadline=None)
def test_carrying_the_rounding_surplus_keeps_a_prompt_at_its_share_never_below(pct, step, chunks, steps):
    """N is the ceil of the need less the carry: over a prompt the decode time never falls below
    the share, and with a steady step it stays within one step above it (unless the cap binds)."""
    for varying in (False, True):
        carry = given = want = 0
        for chunk, this_step in zip(chunks, steps if varying else [step] * len(chunks)):
            n, new_carry = cost_model.yield_window(pct, chunk, this_step, 0, carry)
            if carry == 0:
                assert n == cost_model.yield_steps(pct, chunk, this_step)  # first window: the plain formula
            assert 0 <= new_carry < (100 - pct) * this_step
            if n == cost_model.MAX_YIELD_STEPS:
                break  # the cap bound: the share is not reachable
            given += (100 - pct) * n * this_step
            want += pct * chunk
            carry = new_carry
        else:
            assert given >= want
            if not varying:
                assert given < want + (100 - pct) * step


def test_coefficient_keys_are_the_registry_options_and_are_validated():
    switch = registry.by_name("decode_yield")
    assert [k.name for k in switch.options] == ["DSV41_DECODE_YIELD_MODE", "DSV41_DECODE_YIELD_LOAD_GUARD"] + [
        cost_model.key_name(n) for n, _ in cost_model.DEFAULTS.items()]
    config = registry.resolve({"DSV41_DECODE_YIELD": "33", "DSV41_DECODE_YIELD_STEP_US": "12000",
                               "DSV41_DECODE_YIELD_TOPK": "0"})
    assert not config.errors
    coef = cost_model.from_config(config.values)
    assert (coef.step_us, coef.topk, coef.token_ns) == (12_000, 0, cost_model.DEFAULTS.token_ns)
    assert coef.source == "env:step_us,topk"
    assert cost_model.from_config(registry.resolve({"DSV41_DECODE_YIELD": "33"}).values).source == "default"
    for bad in ("-5", "1.5", "lots"):
        errors = registry.resolve({"DSV41_DECODE_YIELD": "33", "DSV41_DECODE_YIELD_KV_PS": bad}).errors
        assert len(errors) == 1 and "DSV41_DECODE_YIELD_KV_PS" in errors[0] and repr(bad) in errors[0]
        assert "an integer 0.." in errors[0]


def test_a_decode_step_that_costs_nothing_is_refused_with_the_key_named():
    values = {"DSV41_DECODE_YIELD_STEP_US": 0, "DSV41_DECODE_YIELD_ROW_NS": 0}
    with pytest.raises(env.ConfigError, match="DSV41_DECODE_YIELD_STEP_US"):
        cost_model.from_config(values)


@pytest.mark.parametrize("raw", ["0", "100", "33.5", "half", ""])
def test_the_share_accepts_whole_percent_1_to_99_only(raw):
    errors = registry.resolve({"DSV41_DECODE_YIELD": raw}).errors
    assert len(errors) == 1 and "DSV41_DECODE_YIELD" in errors[0] and "1..99" in errors[0]


def test_the_profile_line_round_trips_through_the_registry():
    line = cost_model.profile_line(KNOWN)
    values = dict(word.split("=") for word in line.split())
    config = registry.resolve({"DSV41_DECODE_YIELD": "33", **values})
    assert not config.errors
    assert cost_model.from_config(config.values).items() == KNOWN.items()


# -- fit-cost-model ----------------------------------------------------------------------------


def _metrics_line(wall: float, **scheduled: float) -> bytes:
    import msgspec
    from sglang.srt.observability.forward_pass_metrics import ForwardPassMetrics, ScheduledRequestMetrics

    return msgspec.json.encode(ForwardPassMetrics(wall_time=wall, scheduled_requests=ScheduledRequestMetrics(**scheduled)))


def _synthetic_log(path: Path, coef: cost_model.Coefficients, noise: float = 0.0) -> Path:
    """A forward-pass-metrics log whose timings come from ``coef`` (plus relative noise)."""
    rng = random.Random(7)
    lines = []
    for _ in range(300):  # prefill-only chunks: prefixes from cold to 1M, some starting below K
        c = rng.choice([64, 512, 1024, 4096, 8192])
        p = rng.choice([0, 0, 1000, rng.randrange(0, 1 << 20, 64)])
        fs = cost_model.chunk_cost([(c, p)], coef)
        lines.append(_metrics_line(fs / 1e15 * (1 + rng.uniform(-noise, noise)), num_prefill_requests=1,
                                   sum_prefill_tokens=c, sum_prefill_kv_tokens=p))
    for _ in range(300):  # decode-only steps: 1..64 rows of equal context, some below K
        b = rng.randint(1, 64)
        length = rng.choice([300, 1500, rng.randint(100, 200_000)])
        fs = cost_model.step_cost([length] * b, coef)
        lines.append(_metrics_line(fs / 1e15 * (1 + rng.uniform(-noise, noise)), num_decode_requests=b,
                                   sum_decode_kv_tokens=b * length))
    lines.append(_metrics_line(0.0))  # idle heartbeat
    lines.append(_metrics_line(0.05, num_prefill_requests=1, sum_prefill_tokens=8192, num_decode_requests=4,
                               sum_decode_kv_tokens=16_000))  # mixed: skipped
    rng.shuffle(lines)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize("noise", [0.0, 0.002])
def test_fit_recovers_known_coefficients_within_one_percent(tmp_path, noise):
    samples = fit_cost_model.read_log(str(_synthetic_log(tmp_path / "fpm.jsonl", KNOWN, noise)))
    assert samples.skipped["idle"] == 1 and samples.skipped["mixed"] == 1
    coef, notes = fit_cost_model.fit(samples, topk=KNOWN.topk)
    assert len(notes) == 1 and "no recv_time" in notes[0]  # forward-only log: the iteration terms stay 0
    for (name, got), (_, want) in zip(coef.items(), KNOWN.items()):
        assert abs(got - want) <= 0.01 * want, (name, got, want)


WALL = dataclasses.replace(KNOWN, chunk_sched_us=3_000, token_sched_ns=20_000, step_sched_us=2_500,
                           row_sched_ns=150_000, switch_us=1_800)


def _timeline_log(path: Path, coef: cost_model.Coefficients, noise: float = 0.0) -> Path:
    """A stamped log as the recorder writes it, from a simulated scheduler timeline: runs of
    back-to-back chunks and of decode steps, windows that alternate them (the alternation costs
    ``coef.switch_us``: 2/3 on the decode step after a chunk, 1/3 on the chunk after a decode), and
    idle pauses between runs (a gap that holds idle time). Each message: forward ``wall_time`` from
    the forward terms, ``recv_time`` = the end of its iteration (forward + iteration terms)."""
    rng = random.Random(11)
    forward = fit_cost_model.forward_only(coef)
    clock, counter, lines = 1000.0, 0, []

    def emit(forward_fs: int, iteration_fs: int, **scheduled: int) -> None:
        import msgspec
        from sglang.srt.observability.forward_pass_metrics import ForwardPassMetrics, ScheduledRequestMetrics

        nonlocal clock, counter
        clock += iteration_fs / 1e15 * (1 + rng.uniform(-noise, noise))
        line = msgspec.json.encode(ForwardPassMetrics(
            counter_id=counter, wall_time=forward_fs / 1e15 * (1 + rng.uniform(-noise, noise)),
            scheduled_requests=ScheduledRequestMetrics(**scheduled)))
        lines.append(line[:-1] + b',"recv_time":%r}' % clock)  # as devkit.engine_kit.fpm writes it
        counter += 1

    def chunk(extra_fs: int = 0) -> None:
        c, p = rng.choice([64, 512, 1024, 4096, 8192]), rng.choice([64, 1000, rng.randrange(64, 1 << 20, 64)])
        emit(cost_model.chunk_cost([(c, p)], forward), cost_model.chunk_cost([(c, p)], coef) + extra_fs,
             num_prefill_requests=1, sum_prefill_tokens=c, sum_prefill_kv_tokens=p)

    def decode(b: int, extra_fs: int = 0) -> None:
        length = rng.choice([300, 1500, rng.randint(100, 200_000)])
        emit(cost_model.step_cost([length] * b, forward), cost_model.step_cost([length] * b, coef) + extra_fs,
             num_decode_requests=b, sum_decode_kv_tokens=b * length)

    switch_fs = coef.switch_us * 10**9
    for run in range(120):
        clock += rng.choice([0.0, 0.0, 2.0])  # an idle pause: the next gap holds it
        b = rng.randint(1, 64)
        if run % 3 == 0:
            for _ in range(5):
                chunk()
        elif run % 3 == 1:
            for _ in range(5):
                decode(b)
        else:  # a window: decode, chunk, decode, chunk ... with the same rows
            decode(b)
            for _ in range(3):
                chunk(switch_fs // 3)
                decode(b, switch_fs - switch_fs // 3)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize("noise", [0.0, 0.002])
def test_fit_recovers_the_iteration_terms_from_arrival_times_with_idle_gaps_in_the_log(tmp_path, noise):
    """The iteration terms come from gaps between consecutive messages; gaps holding idle time are
    left out, so they do not inflate what a step costs."""
    samples = fit_cost_model.read_log(str(_timeline_log(tmp_path / "fpm.jsonl", WALL, noise)))
    assert samples.stamped == len(samples.prefill) + len(samples.decode)
    assert samples.switch_decode_gaps and samples.switch_chunk_gaps
    coef, notes = fit_cost_model.fit(samples, topk=WALL.topk)
    assert notes == []
    for name in cost_model.FORWARD_TERMS + cost_model.WALL_TERMS:
        got, want = getattr(coef, name), getattr(WALL, name)
        assert abs(got - want) <= 0.02 * want, (name, got, want)
    whole, forward_only = fit_cost_model.iteration_errors(samples, coef)["decode"]
    assert abs(whole) < 0.01 and forward_only < -0.01  # the forward alone under-charges a step


def test_the_recorder_stamps_each_message_with_its_arrival_and_fit_reads_it(tmp_path):
    """devkit.engine_kit.fpm on a real ZMQ PUB socket with the upstream encoder: one line per
    message, the upstream fields intact, ``recv_time`` appended and increasing."""
    import json

    import zmq
    from sglang.srt.observability.forward_pass_metrics import ForwardPassMetrics, ScheduledRequestMetrics, encode

    from devkit.engine_kit import fpm

    ipc = f"ipc://{tmp_path}/fpm"
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"{ipc}.0")
    recorder = fpm.Recorder(ipc, tmp_path / "fpm.jsonl").start()
    try:
        time.sleep(0.5)  # the subscription reaches the publisher
        for i in range(3):
            m = ForwardPassMetrics(counter_id=i, wall_time=0.01 * (i + 1),
                                   scheduled_requests=ScheduledRequestMetrics(num_decode_requests=4, sum_decode_kv_tokens=400))
            pub.send_multipart((b"", i.to_bytes(8, "big"), encode(m)))
            time.sleep(0.05)
        deadline = time.monotonic() + 5
        while recorder.messages < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        recorder.stop()
        pub.close(linger=0)
    rows = [json.loads(line) for line in (tmp_path / "fpm.jsonl").read_text().splitlines()]
    assert [r["counter_id"] for r in rows] == [0, 1, 2] and [r["wall_time"] for r in rows] == [0.01, 0.02, 0.03]
    assert rows[0]["recv_time"] < rows[1]["recv_time"] < rows[2]["recv_time"]
    samples = fit_cost_model.read_log(str(tmp_path / "fpm.jsonl"))
    assert samples.stamped == 3 and len(samples.decode_gaps) == 2
    assert all(g[3] >= 0.04 for g in samples.decode_gaps)  # the gap: the 50 ms between sends


def test_a_stock_log_with_no_alternation_fits_no_switch_cost_and_says_so(tmp_path):
    samples = fit_cost_model.read_log(str(_timeline_log(tmp_path / "fpm.jsonl", WALL)))
    samples.switch_decode_gaps, samples.switch_chunk_gaps = [], []  # what a stock boot records
    coef, notes = fit_cost_model.fit(samples, topk=WALL.topk)
    assert coef.switch_us == 0 and sum("SWITCH_US" in n for n in notes) == 1
    assert abs(coef.step_sched_us - WALL.step_sched_us) <= 0.02 * WALL.step_sched_us


def test_the_iteration_terms_raise_the_window_by_what_a_step_really_costs():
    """With the iteration terms, N is the window rule on iteration wall time: a step that costs more
    than its forward needs fewer steps for the same share; the alternation is charged once."""
    rows, lens = [(64, 3000)], [500] * 4
    forward = fit_cost_model.forward_only(WALL)
    assert cost_model.step_cost(lens, WALL) - cost_model.step_cost(lens, forward) == (2_500 * 10**9 + 4 * 150_000 * 10**6)
    assert cost_model.chunk_cost(rows, WALL) - cost_model.chunk_cost(rows, forward) == 3_000 * 10**9 + 64 * 20_000 * 10**6
    assert cost_model.window_cost(rows, WALL) - cost_model.chunk_cost(rows, WALL) == 1_800 * 10**9
    assert cost_model.window_cost(rows, forward) == cost_model.chunk_cost(rows, forward)


def test_fit_command_prints_the_profile_line(tmp_path, capsys):
    log = _synthetic_log(tmp_path / "fpm.jsonl", KNOWN)
    assert cli.main(["fit-cost-model", str(log)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2] == "profile line:"
    fitted = dict(word.split("=") for word in out[-1].split())
    assert set(fitted) == {cost_model.key_name(n) for n, _ in KNOWN.items()}
    assert not registry.resolve({"DSV41_DECODE_YIELD": "33", **fitted}).errors
    assert abs(int(fitted["DSV41_DECODE_YIELD_STEP_US"]) - KNOWN.step_us) <= 0.01 * KNOWN.step_us


def test_a_term_the_log_cannot_separate_is_fitted_as_zero_and_said_so(tmp_path):
    dense = cost_model.Coefficients(**{**dict(KNOWN.items()), "topk_pair_ps": 0, "topk_kv_ps": 0, "topk": 0})
    samples = fit_cost_model.read_log(str(_synthetic_log(tmp_path / "fpm.jsonl", dense)))
    samples.decode = [(b, kv, t) for b, kv, t in samples.decode if kv >= b * 2048]  # no short contexts
    coef, notes = fit_cost_model.fit(samples, topk=2048)
    assert coef.topk_kv_ps == 0 and any("TOPK_KV_PS" in n for n in notes)
    assert abs(coef.row_ns - dense.row_ns) <= 0.01 * dense.row_ns


@pytest.mark.parametrize(
    ("bad_line", "expected"),
    [
        (b"not json at all", "not a ForwardPassMetrics JSON object"),
        (b'{"wall_time": "fast"}', "wall_time"),
        (b'{"wall_time": 0.1, "scheduled_requests": {"num_decode_requests": "two"}}', "num_decode_requests"),
        (b'{"wall_time": -1.0, "scheduled_requests": {"num_decode_requests": 2}}', "wall_time=-1.0"),
        (b'{"wall_time": 0.1, "scheduled_requests": {"num_decode_requests": -2}}', "is negative"),
    ],
)
def test_malformed_input_is_an_error_with_the_line_number(tmp_path, capsys, bad_line, expected):
    good = _metrics_line(0.05, num_decode_requests=2, sum_decode_kv_tokens=100)
    log = tmp_path / "fpm.jsonl"
    log.write_bytes(b"\n".join([good, b"", good, bad_line, good]) + b"\n")
    with pytest.raises(fit_cost_model.FitError, match=rf"fpm.jsonl:4: .*{expected}"):
        fit_cost_model.read_log(str(log))
    assert cli.main(["fit-cost-model", str(log)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "fpm.jsonl:4:" in err


def test_a_log_too_short_to_fit_or_missing_is_a_clear_error(tmp_path, capsys):
    log = tmp_path / "short.jsonl"
    log.write_bytes(_metrics_line(0.05, num_decode_requests=2, sum_decode_kv_tokens=100) + b"\n")
    with pytest.raises(fit_cost_model.FitError, match="only 0 prefill-only single-request iterations"):
        fit_cost_model.fit(fit_cost_model.read_log(str(log)), topk=2048)
    assert cli.main(["fit-cost-model", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl: cannot read" in capsys.readouterr().err
    assert cli.main(["fit-cost-model", str(log), "--topk", "-1"]) == 2
    assert "--topk=-1" in capsys.readouterr().err
