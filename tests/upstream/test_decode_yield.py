"""Decode yield on the real SGLang scheduler (devkit.testkit.scheduler): real ``Scheduler`` methods,
pools, ``UnifiedRadixCache``, ``PrefillAdder``, ``Req``, ``ScheduleBatch`` and result processor;
only the model forward is simulated. Its wall time is scripted (``ScriptedClock``): by default each
batch costs what the integer cost model's defaults say, so the closed loop (measured mode, the
default) sees the modelled costs and the modelled share is the one it measures."""

from __future__ import annotations

import importlib
import re

import pytest

from adapter import cost_model
from adapter.core import boot, receipts
from adapter.switches.decode_yield import clock as yield_clock
from devkit.bench.decode_yield import modelled_ns, prompt_times
from devkit.testkit.scheduler import ScriptedClock, build_scheduler

SCHED = "sglang.srt.managers.scheduler"
NAME = "decode_yield"
CHUNK = 8192
WRAPPED = ("get_next_batch_to_run", "_should_defer_prefill")


def _scheduler_cls():
    return importlib.import_module(SCHED).Scheduler


def _install(pct: int | None, **extra: str) -> boot.State:
    """Through the real boot path (the scheduler module is imported, so it installs at once)."""
    _scheduler_cls()
    environ = {"DSV41_DECODE_YIELD": str(pct), **extra} if pct is not None else {}
    return boot.install(environ)


@pytest.fixture(autouse=True)
def _clock_restored(monkeypatch):
    """Every test leaves the controller's clock as it found it (harnesses replace it)."""
    monkeypatch.setattr(yield_clock, "now", yield_clock.now)


def _harness(clock: ScriptedClock | None = None, **kwargs):
    """A harness whose forwards move ``clock`` (default: a new one at the cost model's costs), the
    clock the controller reads."""
    kwargs = {"page_size": 64, "pool_tokens": 1 << 19, "chunked_prefill_size": CHUNK, "max_reqs": 40, **kwargs}
    h = build_scheduler(**kwargs)
    clock = clock or ScriptedClock(modelled_ns)
    h.on_forward = clock.forward
    yield_clock.now = clock.now
    return h


def _scenario(h, *, streams=16, prompt=65536, stream_tokens=100_000, warm=2, ready=None):
    rows = [h.add_request(4000, max_new_tokens=stream_tokens) for _ in range(streams)]
    h.drain()
    h.run(warm)
    if ready is not None:
        ready()
    long = h.add_request(prompt, max_new_tokens=2)
    start = len(h.trace)
    h.run_until(long.finished, max_passes=20_000)
    return rows, long, h.trace[start:]


def _gaps(steps, rid):
    """Decode passes between consecutive chunks of request ``rid``."""
    gaps, gap = [], None
    for step in steps:
        if step.kind == "prefill" and rid in step.rids:
            if gap is not None:
                gaps.append(gap)
            gap = 0
        elif step.kind == "decode" and gap is not None:
            gap += 1
    return gaps


def _decisions(steps):
    return [(s.kind, s.rids, s.extend_lens, s.prefix_lens, s.decode_rows, s.remaining) for s in steps]


def _chunks(steps, rid):
    return [(s.chunk_of(rid), s.prefix_lens[s.rids.index(rid)]) for s in steps if s.kind == "prefill" and rid in s.rids]


def _share(steps, rid):
    return prompt_times(steps, rid).share



def _stock_trace(**kwargs):
    _, _, steps = _scenario(_harness(**kwargs.pop("build", {})), **kwargs)
    return steps


def test_stock_trace_is_unchanged_when_the_switch_is_off():
    """No key, or the key set and then rolled back: every scheduler decision is stock."""
    cls = _scheduler_cls()
    originals = {n: cls.__dict__[n] for n in WRAPPED}
    never = _stock_trace()
    assert _gaps(never, "r17") == [0] * 7  # stock 0.5.23: no decode step between chunks
    state = _install(None)
    assert NAME not in state.outcomes
    assert _decisions(_stock_trace()) == _decisions(never)
    boot.uninstall()
    assert _install(33).outcomes[NAME].status == "installed"
    assert all(cls.__dict__[n] is not originals[n] for n in WRAPPED)
    boot.uninstall()
    assert all(cls.__dict__[n] is originals[n] for n in WRAPPED)
    assert _decisions(_stock_trace()) == _decisions(never)


def _forward_with_distinct_tokens(batch):
    """The simulated forward, but as a model's: each row's token comes from the row's own tensors
    (its KV slot ``req_pool_indices`` and length ``seq_lens``), so it names the request and the
    position, and a result handed to another row shows (``SIM_TOKEN`` is the same for every row,
    so comparing outputs with it shows nothing)."""
    import torch
    from sglang.srt.managers.utils import GenerationBatchResult

    rows = zip(batch.req_pool_indices.tolist(), batch.seq_lens.tolist())
    tokens = [1000 + int(slot) * 97 + int(length) % 89 for slot, length in rows]
    return GenerationBatchResult(logits_output=None, next_token_ids=torch.tensor(tokens, dtype=torch.int64),
                                 can_run_cuda_graph=False)


def test_with_the_switch_on_chunks_and_outputs_are_the_engines_own(monkeypatch):
    """Only when the next chunk runs changes: boundaries, prefixes and outputs are stock's (each
    request's tokens are its own, so a row given another row's result shows)."""
    from devkit.testkit import scheduler as harness

    monkeypatch.setattr(harness, "simulated_forward", _forward_with_distinct_tokens)

    def run():
        h = _harness()
        rows = [h.add_request(4000, max_new_tokens=100_000) for _ in range(16)]
        h.drain()
        before = [len(r.output_ids) for r in rows]
        long = h.add_request(65536, max_new_tokens=2)
        start = len(h.trace)
        h.run_until(long.finished)
        gained = [len(r.output_ids) - b for r, b in zip(rows, before)]
        return rows, long, h.trace[start:], gained

    stock_rows, stock_long, stock, stock_gained = run()
    _install(33)
    rows, long, steps, gained = run()
    assert _chunks(steps, long.rid) == _chunks(stock, stock_long.rid)
    assert len(_chunks(steps, long.rid)) == 8
    assert list(long.output_ids) == list(stock_long.output_ids) and len(set(long.output_ids)) == 2
    assert all(s.kind != "idle" for s in steps)
    decode_steps = sum(s.kind == "decode" for s in steps)
    assert decode_steps > 7 * 4  # streams got steps between every pair of chunks
    # one token per decode pass per stream, the same tokens as stock
    assert stock_gained == [sum(s.kind == "decode" for s in stock)] * 16
    assert gained == [decode_steps] * 16
    # the streams decoded more steps than stock: stock's outputs are a prefix of theirs
    assert all(list(r.output_ids[: len(s.output_ids)]) == list(s.output_ids) for r, s in zip(rows, stock_rows))
    assert len({tuple(r.output_ids[:8]) for r in [*rows, long]}) == 17  # every request its own tokens


@pytest.mark.parametrize("mode", ["measured", "model"])
@pytest.mark.parametrize("pct", [33, 50])
def test_running_streams_keep_their_share_of_modelled_time(pct, mode):
    _install(pct, DSV41_DECODE_YIELD_MODE=mode)
    _, long, steps = _scenario(_harness(pool_tokens=3 << 18), prompt=1 << 17)
    gaps = _gaps(steps, long.rid)
    assert len(gaps) == 15 and max(gaps) < cost_model.MAX_YIELD_STEPS
    assert abs(_share(steps, long.rid) - pct / 100) <= 0.03


def test_an_eight_chunk_prompts_share_holds_over_its_whole_prefill_as_its_last_window_pays_the_final_chunk():
    _install(50)
    _, long, steps = _scenario(_harness(), streams=4)  # 64K: 8 chunks, 7 windows
    times = prompt_times(steps, long.rid)
    assert len(times.gaps) == 7
    assert abs(times.share - 0.50) <= 0.01  # first chunk to the end of the final chunk, as a client times it
    # the cycles alone (to the final chunk's start) also hold the final chunk's part, so they read above
    cycles = times.cycle_decode_fs / (times.cycle_chunk_fs + times.cycle_decode_fs)
    assert 0.52 < cycles < 0.55


def test_a_lone_prompt_prefills_exactly_as_stock_with_no_idle_pass():
    stock = _stock_trace(streams=0, warm=0)
    _install(50)
    steps = _stock_trace(streams=0, warm=0)
    assert _decisions(steps) == _decisions(stock)
    assert [s.kind for s in steps] == ["prefill"] * 8 + ["decode"]
    assert all(s.remaining == 0 for s in steps)


@pytest.mark.parametrize("interval", [0, 3])
def test_the_final_chunk_arms_nothing_beyond_the_configured_interval(interval):
    _install(50)
    h = _harness(prefill_decode_interval=interval)
    _, long, steps = _scenario(h, prompt=3 * CHUNK)
    chunk_steps = [s for s in steps if s.kind == "prefill" and long.rid in s.rids]
    assert [s.chunk_of(long.rid) for s in chunk_steps] == [CHUNK] * 3
    assert all(s.remaining > interval for s in chunk_steps[:-1])  # non-final chunks arm a window
    assert chunk_steps[-1].remaining == interval  # the final chunk: the engine's own arm only
    after = steps[steps.index(chunk_steps[-1]) + 1 :]
    assert [s.kind for s in after] == ["decode"] * len(after)
    assert h.scheduler.__dict__["_dsv41_decode_yield"].open is None


@pytest.mark.parametrize("overlap", [False, True])
def test_the_window_ends_when_the_streams_finish_with_no_idle_pass(overlap, debug_lines):
    _install(50)
    h = _harness(overlap=overlap)
    rows = [h.add_request(4000, max_new_tokens=6) for _ in range(16)]
    h.drain()
    debug_lines.clear()
    long = h.add_request(65536, max_new_tokens=2)
    start = len(h.trace)
    h.run_until(long.finished)
    steps = h.trace[start:]
    assert all(r.finished() for r in rows)
    gaps = _gaps(steps, long.rid)
    armed = steps[0].remaining
    assert steps[0].kind == "prefill" and armed > gaps[0] > 0  # cut short of the armed N
    assert all(g == 0 for g in gaps[1:])  # no streams left: stock cadence
    last_chunk = max(i for i, s in enumerate(steps) if long.rid in s.rids)
    assert [s.kind for s in steps[:last_chunk]].count("idle") == 0
    ended = [receipts.parse_line(line) for line in debug_lines if " window " in line]
    assert len(ended) == 1 and ended[0].params["ended"] == "streams_gone"
    assert ended[0].params["n"] == str(armed) and ended[0].params["given"] == str(gaps[0])


def test_aborting_the_chunked_prompt_mid_window_ends_the_window_at_once():
    _install(50)
    h = _harness()
    for _ in range(16):
        h.add_request(4000, max_new_tokens=100_000)
    h.drain()
    long = h.add_request(65536, max_new_tokens=2)
    first = h.step()
    assert first.kind == "prefill" and long.rid in first.rids and first.remaining > 4
    h.run(2)
    waiting = h.add_request(3000, max_new_tokens=4)
    h.abort_chunked()
    nxt = h.step()
    assert nxt.kind == "prefill" and nxt.rids == (waiting.rid,)  # admitted on the very next pass
    assert h.scheduler.chunked_req is None
    assert h.scheduler.__dict__["_dsv41_decode_yield"].open is None
    assert [s.kind for s in h.run(3)] == ["decode"] * 3


def test_retracting_the_chunked_prompt_ends_the_window_and_it_resumes_cleanly(debug_lines):
    _install(50)
    h = _harness()
    rows = [h.add_request(4000, max_new_tokens=100_000) for _ in range(16)]
    h.drain()
    long = h.add_request(65536, max_new_tokens=2)
    assert h.step().remaining > 4
    h.run(2)
    free_before = h.scheduler.token_to_kv_pool_allocator.available_size()
    retracted = h.retract_all()  # the real pause_generation(mode="retract")
    assert long in retracted and all(r in retracted for r in rows)
    assert h.scheduler.token_to_kv_pool_allocator.available_size() > free_before
    nxt = h.step()
    assert nxt.kind == "prefill"  # no idle pass: the window ended with the prompt gone
    assert "ended=prompt_gone" in [line for line in debug_lines if " window " in line][-1]
    h.run_until(long.finished)
    assert all(not r.finished() for r in rows) and all(s.kind != "idle" for s in h.trace)


def test_decode_retraction_inside_a_window_keeps_the_window_for_the_rows_left(monkeypatch, debug_lines):
    """SGLang's own retraction test hook (SGLANG_TEST_RETRACT): every 7th pass update_running_batch
    retracts a stream through the real retract_decode; the window goes on for the rows left."""
    sched = importlib.import_module(SCHED)
    monkeypatch.setattr(sched, "TEST_RETRACT", True)
    monkeypatch.setattr(sched, "TEST_RETRACT_INTERVAL", 7)
    _install(33)
    h = _harness()
    rows = [h.add_request(4000, max_new_tokens=60) for _ in range(4)]
    h.drain()
    debug_lines.clear()
    long = h.add_request(65536, max_new_tokens=2)
    start = len(h.trace)
    h.run_until(lambda: long.finished() and all(r.finished() for r in rows))
    steps = h.trace[start:]
    assert sum(r.retraction_count for r in rows) >= 3
    assert [len(r.output_ids) for r in rows] == [60] * 4
    assert all(s.kind != "idle" for s in steps)
    gaps = _gaps(steps, long.rid)
    assert len(gaps) == 7 and min(gaps) >= 4  # windows kept giving the rows left their steps
    windows = [receipts.parse_line(line) for line in debug_lines if " window " in line]
    assert [w.params["ended"] for w in windows] == ["served"] * 7
    assert [int(w.params["given"]) for w in windows] == gaps


def test_a_burst_queued_behind_a_chunked_prompt_reads_as_load_until_the_queue_drains(debug_lines):
    """Prompts that arrive together, before any is chunked, count as no arrival behind a chunked
    prompt; their queue is the load: the first prompts' windows give less, the last one's (nothing
    queued behind it) the whole share."""
    _install(50)
    h = _harness(pool_tokens=3 << 18)
    rows = [h.add_request(4000, max_new_tokens=100_000) for _ in range(4)]
    h.drain()
    h.run(2)
    debug_lines.clear()
    burst = [h.add_request(4 * CHUNK, max_new_tokens=2) for _ in range(6)]
    h.run_until(lambda: all(r.finished() for r in burst), max_passes=20_000)
    assert not any(r.finished() for r in rows)
    windows = [receipts.parse_line(line).params for line in debug_lines if " window " in line]
    first = [int(w.get("guard", 50)) for w in windows[:3]]  # the first prompt's three windows, five queued behind
    last = [int(w.get("guard", 50)) for w in windows[-3:]]  # the last prompt's, nothing queued
    assert len(windows) == 6 * 3
    assert max(first) < 25, first  # five prompts of 4 chunks queued: seconds of prefill at the model's costs
    assert last == [50, 50, 50], last


def test_mixed_chunk_keeps_the_chunks_and_yields_between_them():
    _, stock_long, stock = _scenario(_harness(mixed_chunk=True))
    _install(33)
    _, long, steps = _scenario(_harness(mixed_chunk=True))
    assert _chunks(steps, long.rid) == _chunks(stock, stock_long.rid)
    chunk_steps = [s for s in steps if s.kind == "prefill" and long.rid in s.rids]
    assert all(s.decode_rows == 16 for s in chunk_steps)  # the rows ride along in each chunk
    assert min(_gaps(steps, long.rid)) >= 2 and max(_gaps(stock, stock_long.rid)) == 0
    # the share is on the rows' token rate: the token each row got inside a chunk counts
    times = prompt_times(steps, long.rid)
    assert abs(times.rate_share(rode_along=1) - 0.33) <= 0.03
    assert times.share < 0.30  # on forward time alone the windows give less than pct


@pytest.mark.parametrize("overlap", [False, True])
def test_the_real_event_loops_give_streams_steps_between_chunks(overlap):
    def run():
        h = _harness(overlap=overlap)
        streams = [h.make_request(4000, 100_000) for _ in range(8)]
        long = h.make_request(65536, 2)

        def word(batch):
            if batch.forward_mode.is_extend():
                return "C" if long in batch.reqs else "p"
            return "d"

        log = h.run_event_loop({0: streams, 80: [long]}, until=long.finished, word=word)
        text = "".join(log)
        assert text.count("C") == 8 and "p" not in text[text.index("C") :]
        return [len(g) for g in text[text.index("C") : text.rindex("C")].split("C")[1:]]

    assert run() == [0] * 7  # stock: no decode step between chunks
    _install(33)
    assert min(run()) >= 4  # every pair of chunks has decode steps between them


def test_the_overlap_step_order_yields_like_the_normal_order():
    _install(33)
    _, long, normal = _scenario(_harness())
    _, long_o, overlap = _scenario(_harness(overlap=True))
    assert _chunks(overlap, long_o.rid) == _chunks(normal, long.rid)
    assert sum(abs(a - b) for a, b in zip(_gaps(overlap, long_o.rid), _gaps(normal, long.rid))) <= 7


def test_the_configured_interval_is_a_floor():
    stock = _stock_trace(build={"prefill_decode_interval": 4})
    _install(1)  # N = 1 < interval: the engine's own cadence, decision for decision
    steps = _stock_trace(build={"prefill_decode_interval": 4})
    assert _decisions(steps) == _decisions(stock)
    assert set(_gaps(steps, "r17")) == {4}
    boot.uninstall()
    _install(33)
    gaps = _gaps(_stock_trace(build={"prefill_decode_interval": 4}), "r17")
    assert min(gaps) >= 4 and sum(gaps) > 4 * len(gaps)


def test_a_window_ended_early_still_gives_the_configured_interval():
    def run():
        h = _harness(prefill_decode_interval=8)
        for _ in range(4):
            h.add_request(4000, max_new_tokens=4)
        h.drain()
        long = h.add_request(65536, max_new_tokens=2)
        start = len(h.trace)
        h.run_until(long.finished)
        return h.trace[start:]

    stock = run()
    _install(50)
    assert _decisions(run()) == _decisions(stock)  # streams gone after 3 steps: the interval's 8 rule


def test_windows_are_capped_at_128_steps():
    _install(99)
    _, long, steps = _scenario(_harness(), streams=1, prompt=3 * CHUNK)
    assert _gaps(steps, long.rid) == [cost_model.MAX_YIELD_STEPS] * 2


def test_two_independent_schedulers_make_every_decision_equal():
    """The rank-invariance check: same trace, separately built schedulers, equal decisions."""
    _install(33)
    # a clock each, moved by its own scheduler's forwards at the same scripted costs: each pass reads
    # the same intervals on both (one shared clock would time b's last step with a's next chunk)
    clock_a, clock_b = ScriptedClock(modelled_ns), ScriptedClock(modelled_ns)
    a, b = _harness(clock_a), _harness(clock_b)
    for h in (a, b):
        for n in range(12):
            h.add_request(3000 + 100 * n, max_new_tokens=40 + 7 * n)
    for k in range(260):
        if k in (3, 90):
            for h in (a, b):
                h.add_request(40_000 + k, max_new_tokens=3)
        yield_clock.now = clock_a.now
        sa = a.step()
        yield_clock.now = clock_b.now
        sb = b.step()
        assert _decisions([sa]) == _decisions([sb]), k
    assert sum(s.kind == "decode" for s in a.trace) > 100 and max(s.remaining for s in a.trace) > 1


def _server_args(**kwargs):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path="dummy", **kwargs)


REFUSALS = [
    ({"enable_dp_attention": True, "dp_size": 2, "tp_size": 2}, "DP attention"),
    ({"pp_size": 2}, "pipeline parallelism"),
    ({"disaggregation_mode": "prefill"}, "PD disaggregation"),
    ({"disaggregation_mode": "decode"}, "PD disaggregation"),
    ({"dllm_algorithm": "LowConfidence"}, "dLLM"),
]


@pytest.mark.parametrize(("mode", "reason"), REFUSALS, ids=[r[1] + str(i) for i, r in enumerate(REFUSALS)])
def test_unsupported_modes_are_refused_and_stay_stock(mode, reason, debug_lines):
    from sglang.srt.server_args import set_global_server_args_for_scheduler

    cls = _scheduler_cls()
    originals = {n: cls.__dict__[n] for n in WRAPPED}
    set_global_server_args_for_scheduler(_server_args(**mode))  # known at install: refused there
    outcome = _install(33).outcomes[NAME]
    assert outcome.status == "refused" and reason in outcome.reason
    assert all(cls.__dict__[n] is originals[n] for n in WRAPPED)
    refusals = [line for line in debug_lines if "decode_yield refused:" in line]
    assert len(refusals) == 1 and reason in refusals[0] and re.search(r"rank=\S+$", refusals[0])


@pytest.mark.parametrize(("mode", "reason"), REFUSALS[1:3], ids=["pp", "disagg"])
def test_a_scheduler_found_in_an_unsupported_mode_after_install_reverts_to_stock(mode, reason):
    stock = _stock_trace()
    state = _install(33)
    assert state.outcomes[NAME].status == "installed"
    h = _harness()
    h.scheduler.server_args = _server_args(**mode)  # what a real Scheduler in that mode holds
    _, _, steps = _scenario(h)
    assert _decisions(steps) == _decisions(stock)
    assert state.outcomes[NAME].status == "refused" and reason in state.outcomes[NAME].reason
    assert NAME not in state.patches


def test_the_receipt_names_the_share_and_the_coefficients_source(debug_lines):
    outcome = _install(33, DSV41_DECODE_YIELD_STEP_US="30000").outcomes[NAME]
    assert outcome.params["share"] == 33 and outcome.params["cost"] == "env:step_us"
    line = next(line for line in debug_lines if "decode_yield installed" in line)
    assert "share=33" in line and "cost=env:step_us" in line and "cap=128" in line


def test_a_decode_step_with_no_cost_is_refused_naming_the_key():
    outcome = _install(33, DSV41_DECODE_YIELD_STEP_US="0", DSV41_DECODE_YIELD_ROW_NS="0").outcomes[NAME]
    assert outcome.status == "refused" and "DSV41_DECODE_YIELD_STEP_US='0' is not valid" in outcome.reason


def test_one_debug_line_per_window_with_chunk_n_and_why_it_ended(debug_lines):
    _install(33)
    _, long, steps = _scenario(_harness(), ready=debug_lines.clear)
    windows = [receipts.parse_line(line) for line in debug_lines if " window " in line]
    assert len(windows) == 7  # one per non-final chunk
    gaps = _gaps(steps, long.rid)
    for w, gap in zip(windows, gaps):
        assert w.switch == NAME and w.params["chunk"] == str(CHUNK) and w.params["ended"] == "served"
        assert int(w.params["n"]) == int(w.params["given"]) == gap


def test_the_window_line_names_the_mode_target_measured_share_and_n(debug_lines):
    """Measured mode against scripted costs (chunk 10 ms, step 2 ms): the line's share is the cycle's."""
    from devkit.testkit.decode_yield_scripted import MS, Script
    from devkit.testkit.decode_yield_scripted import run as scripted_run

    found = scripted_run(33, Script(lambda k: 10 * MS, lambda k: 2 * MS), on_ready=debug_lines.clear)
    windows = [receipts.parse_line(line).params for line in debug_lines if " window " in line]
    assert len(windows) == len(found)
    assert all(w["mode"] == "measured" and w["target"] == "33" for w in windows)
    assert {w["source"] for w in windows[1:]} == {"measured"}
    assert [int(w["n"]) for w in windows] == [c[1] for c in found]
    for w, c in zip(windows, found):  # the share the line reports is the cycle's, from the same costs
        assert float(w["share"]) == pytest.approx(c[3] / c[2], abs=0.001)
        assert float(w["step_us"]) == 2000.0
    assert abs(float(windows[-1]["prompt_share"]) - 0.33) <= 0.02


def test_in_model_mode_the_window_line_ends_at_how_the_window_ended(debug_lines):
    _install(33, DSV41_DECODE_YIELD_MODE="model")
    _scenario(_harness(), ready=debug_lines.clear)
    windows = [receipts.parse_line(line).params for line in debug_lines if " window " in line]
    assert len(windows) == 7 and all(w["mode"] == "model" and "share" not in w and "source" not in w for w in windows)
