"""Decode yield's closed loop (adapter.switches.decode_yield.controller) on its own: samples,
estimates, the first windows of a boot, the balance and its bounds."""

from __future__ import annotations

from adapter.switches.decode_yield import controller, cost_model

MS = 1_000_000
PROMPT = object()


def _stepped(ctl: controller.Controller, step_ns: int, steps: int = 6, t: int = 0) -> int:
    """``steps`` decode passes of ``step_ns`` each in the normal loop; returns the time after them."""
    for _ in range(steps):
        ctl.on_pass(t, 2)
        ctl.ran(True)
        t += step_ns
    ctl.on_pass(t, 2)
    return t


def _window(ctl: controller.Controller, t: int, chunk_ms: int, steps_ms: list[int],
            need_run: int = 2) -> tuple[int, controller.Cycle | None]:
    """A chunk of ``chunk_ms`` then decode steps of ``steps_ms`` each, served; the time after them
    and the cycle."""
    ctl.ran(False)
    t += chunk_ms * MS
    for ms in steps_ms:
        ctl.on_pass(t, need_run)
        ctl.ran(True)
        t += ms * MS
    ctl.on_pass(t, need_run)
    ctl.ran(False)
    return t, ctl.served(t, len(steps_ms))


def _cycle(ctl: controller.Controller, t: int, n: int, chunk_ms: int, first_ms: int, step_ms: int,
           need_run: int = 2) -> int:
    """A chunk of ``chunk_ms`` then ``n`` decode steps (the first ``first_ms``, the rest ``step_ms``),
    served; returns the time after them."""
    return _window(ctl, t, chunk_ms, [first_ms, *[step_ms] * (n - 1)][:n], need_run)[0]


def test_only_a_decode_pass_after_a_decode_pass_is_a_step_alone():
    ctl = controller.Controller(50, 128)
    ctl.on_pass(0, 2)
    ctl.ran(False)  # a chunk: 10 ms
    ctl.on_pass(10 * MS, 2)
    ctl.ran(True)  # the first step after it: 5 ms (the alternation) - not a step alone
    ctl.on_pass(15 * MS, 2)
    assert ctl.alone.value() is None and ctl.step_ns() == 5 * MS  # nothing better yet
    ctl.ran(True)  # the second: 2 ms
    ctl.on_pass(17 * MS, 2)
    assert ctl.step_ns() == 2 * MS
    ctl.ran(True)
    ctl.on_pass(19 * MS, 3)  # overlap loop: three in a row needed, and there are three
    assert list(ctl.alone.samples) == [2 * MS, 2 * MS]


def test_the_step_is_the_median_of_the_last_five_so_one_descheduled_step_does_not_move_it():
    ctl = controller.Controller(50, 128)
    t = _stepped(ctl, 2 * MS, 4)
    ctl.ran(True)
    _stepped(ctl, 40 * MS, 1, t)  # one step the OS descheduled
    assert ctl.step_ns() == 2 * MS


def test_a_stale_step_alone_gives_way_to_the_recent_first_steps_after_chunks():
    """Windows of one step give no step alone; the machine slowed 5x meanwhile: once the step alone
    is older than FRESH_CYCLES cycles, the recent decode steps (each the first after its chunk) are
    the reference."""
    ctl = controller.Controller(20, 128)
    t = _stepped(ctl, 2 * MS)
    for cycle in range(controller.FRESH_CYCLES + 2):
        ctl.plan(t, PROMPT, 64, 0, 0, (10, 10))
        ctl.ran(False)  # the chunk
        t += 50 * MS
        ctl.on_pass(t, 2)
        ctl.ran(True)  # its one step, now 10 ms
        t += 10 * MS
        ctl.on_pass(t, 2)
        ctl.ran(False)
        assert ctl.step_ns() == (2 * MS if cycle < controller.FRESH_CYCLES else 10 * MS), cycle
        ctl.served(t, 1)


def test_a_one_step_window_with_no_fresh_step_alone_becomes_a_two_step_probe():
    """Windows of one step (pct 20, a chunk of 2.5 steps) give no step alone, and the streams' step
    went from 8 ms before the prompt to 10 ms (the first after a chunk 13 ms): once the step alone is
    stale the loop plans two steps instead of one, and the second is the new reference at once."""
    ctl = controller.Controller(20, 128)
    t = _stepped(ctl, 8 * MS)
    planned = []
    for _ in range(2 * controller.FRESH_CYCLES):
        n = ctl.plan(t, PROMPT, 64, 0, 0, (25, 10)).n
        planned.append(n)
        t = _cycle(ctl, t, n, 25, 13, 10)  # the first step after the chunk pays the alternation
    assert set(planned[:controller.FRESH_CYCLES]) == {1} and 2 in planned[controller.FRESH_CYCLES:]
    assert ctl.step_ns() == 10 * MS  # not 8 (before the prompt), not 13 (the first step after a chunk)


def test_with_nothing_measured_the_first_window_is_the_cost_models():
    ctl = controller.Controller(33, 128)
    chunk, step = 30 * 10**9, 4 * 10**9
    plan = ctl.plan(0, PROMPT, 512, 0, 0, (chunk, step))
    assert plan.source == "model" and plan.n == cost_model.yield_steps(33, chunk, step)


def test_with_a_step_measured_and_no_cycle_the_models_ratio_scales_the_measured_step():
    ctl = controller.Controller(50, 128)
    t = _stepped(ctl, 2 * MS)
    plan = ctl.plan(t, PROMPT, 512, 0, 0, (30, 10))  # the model says a chunk is 3 steps: 6 ms
    assert plan.source == "model_ratio" and plan.overhead_ns == 6 * MS and plan.n == 3


def test_a_measured_cycle_gives_the_share_and_the_next_window_closes_the_balance():
    ctl = controller.Controller(50, 128)
    t = _stepped(ctl, 2 * MS)
    assert ctl.plan(t, PROMPT, 512, 0, 0, (10, 10)).n == 1  # model ratio 1: 2 ms
    # the chunk took 10 ms and its one step 2 ms: the streams got 2 of 12 ms
    cycle = ctl.served(t + 12 * MS, 1)
    assert cycle is not None and cycle.share == round(2 / 12, 4) and cycle.overhead_ns == 10 * MS
    # owed: 0.5 * 10 ms of the next chunk, plus the 0.5 * 10 - 0.5 * 2 ms the first cycle fell short
    plan = ctl.plan(t + 12 * MS, PROMPT, 512, 0, 0, (10, 10))
    assert plan.source == "measured" and plan.overhead_ns == 10 * MS and plan.n == 5 + 4


def test_the_balance_is_bounded_by_one_cycles_overhead_and_a_probe_so_a_cap_runs_up_no_debt():
    ctl = controller.Controller(90, 4)  # pct 90 with a cap of 4 steps: every window short
    t = _stepped(ctl, 1 * MS)
    for _ in range(10):
        n = ctl.plan(t, PROMPT, 512, 0, 0, (10, 1)).n
        assert n == 4
        t += 10 * MS + n * MS
        ctl.served(t, n)
    assert -ctl.balance <= 90 * 10 * MS + 10 * 1 * MS * 2  # one cycle's overhead and a probe of two steps


def test_a_window_that_was_not_served_resets_the_prompts_balance():
    ctl = controller.Controller(50, 128)
    t = _stepped(ctl, 2 * MS)
    ctl.plan(t, PROMPT, 512, 0, 0, (10, 10))
    ctl.served(t + 30 * MS, 1)
    assert ctl.balance < 0
    ctl.abandoned()
    assert ctl.balance == 0 and ctl.served(t + 40 * MS, 1) is None  # no cycle open


def test_a_new_prompt_starts_its_own_balance_and_keeps_the_boots_estimates():
    ctl = controller.Controller(50, 128)
    t = _stepped(ctl, 2 * MS)
    ctl.plan(t, PROMPT, 512, 0, 0, (10, 10))
    ctl.served(t + 30 * MS, 1)
    plan = ctl.plan(t + 30 * MS, object(), 512, 0, 0, (10, 10))
    assert ctl.balance == 0 and plan.source == "measured" and plan.n == 14  # 0.5 * 28 ms / (0.5 * 2 ms)


def test_the_floor_and_the_cap_bound_the_window():
    ctl = controller.Controller(50, 6)
    t = _stepped(ctl, 2 * MS)
    assert ctl.plan(t, PROMPT, 512, 0, 9, (1, 10)).n == 9  # the configured interval is a floor
    assert ctl.plan(t, PROMPT, 512, 0, 0, (100, 1)).n == 6  # the cap


def test_in_the_overlap_loop_three_step_probes_are_repaid_and_the_low_share_holds():
    """The overlap loop (a step alone needs three decode passes in a row) at pct 20, a chunk of 1.5
    steps and an alternation of half a step: windows are 0 or 1 step, every stale reference is
    refreshed by a probe of three, and the balance carries each probe's extra steps in full, so the
    share at the streams' rate alone holds over 300 cycles."""
    ctl = controller.Controller(20, 128)
    t = 0
    for _ in range(6):  # the streams alone before the prompt
        ctl.on_pass(t, 3)
        ctl.ran(True)
        t += 10 * MS
    ctl.on_pass(t, 3)
    streams = wall = 0
    windows = []
    for _ in range(300):
        start = t
        n = ctl.plan(t, PROMPT, 64, 0, 0, (15, 10)).n
        windows.append(n)
        t = _cycle(ctl, t, n, 15, 15, 10, need_run=3)
        streams, wall = streams + n * 10 * MS, wall + t - start
    assert 3 in windows and set(windows) <= {0, 1, 2, 3}
    assert abs(streams / wall - 0.20) <= 0.02, streams / wall


def test_a_descheduled_probe_step_joins_the_median_instead_of_replacing_it():
    """A probe's step alone that took longer than the first steps after chunks (the OS took the core
    away: 380 ms against 15 ms) does not become the reference on its own."""
    ctl = controller.Controller(20, 128)
    t = _stepped(ctl, 10 * MS)
    for _ in range(controller.FRESH_CYCLES + 1):  # one-step windows: the step alone goes stale
        ctl.plan(t, PROMPT, 64, 0, 0, (15, 10))
        t = _cycle(ctl, t, 1, 15, 15, 15)
    assert not ctl.fresh()
    ctl.ran(True)  # two decode passes in a row, the second descheduled
    ctl.on_pass(t + 15 * MS, 2)
    ctl.ran(True)
    ctl.on_pass(t + 395 * MS, 2)
    assert ctl.step_ns() == 10 * MS and len(ctl.alone.samples) == 5


def test_the_final_chunks_share_is_paid_in_equal_parts_by_the_windows_of_the_last_quarter():
    """A prompt of 16 chunks (15 windows of 500 tokens, 10 ms each; the final chunk 300 tokens, 6 ms):
    the windows before the last quarter owe their own chunk only; the last three each owe a third of
    the final chunk as well, at the measured overhead per token, and their balance charges it (not a
    credit the next window takes back)."""
    assert controller.final_span(15) == 3 and controller.final_span(93) == 22 and controller.final_span(2) == 1
    ctl = controller.Controller(50, 128)
    t = _stepped(ctl, 1 * MS)
    overheads, windows = [], []
    for left in range(15, 0, -1):
        plan = ctl.plan(t, PROMPT, 500, 0, 0, (10, 10), final_tokens=300, windows_left=left)
        overheads.append(plan.overhead_ns)
        windows.append(plan.n)
        t = _cycle(ctl, t, plan.n, 10, 1, 1)
    assert set(overheads[2:12]) == {10 * MS}  # after the model's first window and its repayment
    assert overheads[12:] == [12 * MS] * 3 and ctl._final_paid == 300 * 1000  # 2 ms of the final chunk each
    # 10 steps of 1 ms a window for its own chunk, 12 for the last three
    assert set(windows[2:12]) == {10} and windows[12:] == [12] * 3, windows


def test_a_window_whose_steps_slow_down_midway_counts_what_its_steps_took():
    """The machine's speed moved inside a window (the DSV4 kit: 60 ms, then 95 ms a step, for a
    second each): 10 steps, the first five 2 ms, the rest 4 ms. The streams' part is their steps
    alone as they ran (4 x 2 + 5 x 4 ms) and the first step after the chunk at the step alone (4
    ms): 32 ms, not ten steps at the median after the window (40 ms, a share the cycle never gave)."""
    ctl = controller.Controller(50, 128)
    t = _stepped(ctl, 2 * MS)
    ctl.plan(t, PROMPT, 512, 0, 0, (10, 10))
    t, cycle = _window(ctl, t, 10, [2] * 5 + [4] * 5)
    assert cycle is not None
    assert cycle.elapsed_ns == 40 * MS and cycle.streams_ns == 32 * MS and cycle.overhead_ns == 8 * MS
    assert cycle.share == round(32 / 40, 4)


def test_a_descheduled_step_in_a_window_counts_for_the_streams_at_most_a_few_steps_alone():
    """One step of a window took 100 ms (the OS took the core) against 2 ms steps: the streams did
    not decode for those 100 ms, so it counts as SPIKE steps alone; the rest is the cycle's overhead."""
    ctl = controller.Controller(50, 128)
    t = _stepped(ctl, 2 * MS)
    ctl.plan(t, PROMPT, 512, 0, 0, (10, 10))
    t, cycle = _window(ctl, t, 10, [2, 2, 100, 2, 2])
    assert cycle is not None
    assert cycle.streams_ns == 2 * MS * (4 + controller.SPIKE)
    assert cycle.overhead_ns == 10 * MS + (100 - 2 * controller.SPIKE) * MS


def test_a_window_plans_its_rest_again_after_half_its_steps_once_they_hold_a_step_alone():
    ctl = controller.Controller(50, 128)
    _stepped(ctl, 2 * MS)  # the normal loop: the second step after the chunk is a step alone
    assert ctl.replan_at(4) == 2 and ctl.replan_at(9) == 4 and ctl.replan_at(3) is None
    ctl.on_pass(20 * MS, 3)  # the overlap loop: the third
    assert ctl.replan_at(6) == 3 and ctl.replan_at(5) is None


def test_the_rest_of_a_window_is_planned_on_its_chunks_measured_cost():
    """The estimates say a 10 ms chunk and 2 ms steps (5 steps at pct 50); this chunk took 20 ms.
    After two steps of 2 ms the overhead so far is 24 - 4 = 20 ms, so the streams are owed 16 ms
    more at the 2 ms their steps take: 8 steps, and the cycle closes the balance at once."""
    ctl = controller.Controller(50, 128)
    t = _stepped(ctl, 2 * MS)
    ctl.plan(t, PROMPT, 512, 0, 0, (10, 10))
    t = _cycle(ctl, t, 5, 10, 2, 2)  # a cycle as estimated: 10 ms of chunk, 5 steps of 2 ms
    assert ctl.balance == 0 and ctl.plan(t, PROMPT, 512, 0, 0, (10, 10)).n == 5
    assert ctl.replan(t, 0) is None  # no step of the window timed yet
    ctl.ran(False)
    t += 20 * MS  # the chunk
    for _ in range(2):
        ctl.on_pass(t, 2)
        ctl.ran(True)
        t += 2 * MS
    ctl.on_pass(t, 2)
    assert ctl.replan(t, 2) == 8
    for _ in range(8):
        ctl.ran(True)
        t += 2 * MS
        ctl.on_pass(t, 2)
    ctl.ran(False)
    cycle = ctl.served(t, 10)
    assert cycle is not None and cycle.elapsed_ns == 40 * MS and cycle.streams_ns == 20 * MS
    assert ctl.balance == 0 and cycle.share == 0.5
