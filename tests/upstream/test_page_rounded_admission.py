"""Page-rounded admission on the real scheduler: PrefillAdder, pools, radix cache, decode retraction.

Invariant: after every admission pass, the page-exact KV that live requests still need to finish
fits the free plus evictable pages (``devkit.testkit.admission.overcommit_tokens`` is 0), so no
decode row is ever retracted for want of KV that admission promised.
"""

from __future__ import annotations

import importlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapter.core import boot, pins
from adapter.switches import page_rounded_admission
from devkit.testkit import admission
from devkit.testkit.hypothesis_budget import examples
from devkit.testkit.scheduler import build_scheduler

NAME = "page_rounded_admission"
ON = {"DSV41_PAGE_ROUNDED_ADMISSION": "1"}
POLICY = "sglang.srt.managers.schedule_policy"
PAGES = (16, 64, 256)


def install_switch():
    state = boot.install(ON)
    for module in (POLICY, "sglang.srt.managers.scheduler"):
        importlib.import_module(module)
    return state.outcomes[NAME]


@pytest.fixture
def switch_on():
    outcome = install_switch()
    assert outcome.status == "installed", outcome.reason
    return outcome


def assert_no_overcommit(cases: list[admission.BoundaryCase]) -> None:
    for case in cases:
        assert case.overcommit_pages == 0, f"{case.rows} rows at page {case.page}: {case.overcommit_pages} pages over"
        assert case.retractions == 0, f"{case.rows} rows at page {case.page}: {case.retractions} retractions"
        assert case.finished


# -- the overcommit reproduction: 1..8 running rows on a page boundary, pages 16 / 64 / 256 ---------


@pytest.mark.parametrize("page", PAGES)
def test_stock_admission_overcommits_one_page_per_extra_row_on_a_page_boundary(page):
    """Pins the upstream bug: the no-overcommit check below fails on stock 0.5.23."""
    cases = [admission.boundary_case(page=page, rows=rows) for rows in range(1, 9)]
    assert all(c.admitted for c in cases)
    assert [c.overcommit_pages for c in cases] == list(range(8))  # rows - 1 pages over
    assert [c.retractions > 0 for c in cases] == [False] + [True] * 7
    with pytest.raises(AssertionError, match="pages over"):
        assert_no_overcommit(cases)


@pytest.mark.parametrize("page", PAGES)
def test_page_rounded_admission_never_overcommits_for_1_to_8_rows_on_a_page_boundary(switch_on, page):
    cases = [admission.boundary_case(page=page, rows=rows) for rows in range(1, 9)]
    assert_no_overcommit(cases)
    # The raw-sized prompt still fits beside one row; beside two or more it must wait.
    assert [c.admitted for c in cases] == [True] + [False] * 7


@pytest.mark.parametrize("page", PAGES)
def test_a_request_that_fits_exactly_is_admitted_at_once_and_finishes_without_retraction(switch_on, page):
    cases = [admission.boundary_case(page=page, rows=rows, size="exact") for rows in range(0, 9)]
    assert all(c.admitted for c in cases)
    assert_no_overcommit(cases)


def test_stock_never_admits_a_request_that_needs_exactly_the_whole_empty_pool():
    case = admission.boundary_case(page=64, rows=0, size="exact")
    assert not case.admitted and not case.finished


def test_uninstalling_the_switch_restores_the_stock_overcommit(switch_on):
    assert admission.boundary_case(page=64, rows=3).overcommit_pages == 0
    boot.uninstall()
    assert admission.boundary_case(page=64, rows=3).overcommit_pages == 2


# -- each charge, on the real PrefillAdder ----------------------------------------------------


def _adder(h, num_mixed_decode_tokens=0):
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder

    s = h.scheduler
    running = ScheduleBatch(reqs=[r for r in s.last_batch.reqs], batch_is_full=False)
    return PrefillAdder(
        s.page_size, s.tree_cache, s.token_to_kv_pool_allocator, running, 1.0,
        s.max_prefill_tokens, s.chunked_prefill_size, num_mixed_decode_tokens,
    )


@pytest.mark.parametrize("page", PAGES)
def test_running_and_mixed_decode_rows_are_charged_in_whole_pages(page):
    rows, left = 5, page + 1
    h = build_scheduler(page_size=page, pool_tokens=64 * page, max_reqs=rows + 4)
    reqs = [h.add_request(page, max_new_tokens=left + 1) for _ in range(rows)]
    h.step()  # prefill: every row holds exactly one page, `left` tokens to go
    assert all(r.kv.kv_allocated_len == page for r in reqs)
    stock = _adder(h, num_mixed_decode_tokens=rows)
    assert stock.memory_budget.total_offset == rows * left + rows  # raw: tokens left + one per row
    assert install_switch().status == "installed"
    rounded = _adder(h, num_mixed_decode_tokens=rows)
    # page + 1 tokens from a page boundary open two pages; each row's next step opens one page.
    assert rounded.memory_budget.total_offset == rows * 2 * page + rows * page
    assert rounded.memory_budget.current_offset == rows * page
    plain = _adder(h)
    assert plain.memory_budget.total_offset == rows * 2 * page
    for r in reqs:
        assert page_rounded_admission.row_reservation(r, left, page) == 2 * page


def test_rows_that_may_stop_early_are_charged_the_stock_estimate_rounded_to_pages(switch_on):
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder

    page, rows, left = 64, 4, 65
    h = build_scheduler(page_size=page, pool_tokens=64 * page, max_reqs=rows + 4)
    reqs = [h.add_request(page, max_new_tokens=left + 1) for _ in range(rows)]
    h.step()
    for r in reqs:
        r.sampling_params.ignore_eos = False  # the estimate uses new_token_ratio now
    s = h.scheduler
    adder = PrefillAdder(s.page_size, s.tree_cache, s.token_to_kv_pool_allocator,
                         ScheduleBatch(reqs=reqs, batch_is_full=False), 0.5, s.max_prefill_tokens,
                         s.chunked_prefill_size)
    # 65 * 0.5 = 32.5 -> 33 tokens from a page boundary: one page per row (stock: 32.5 tokens).
    assert adder.memory_budget.total_offset == rows * page


def test_kv_reservation_counts_the_pages_an_allocator_hands_out():
    f = page_rounded_admission.kv_reservation
    assert f(64, 65, 64) == 128  # boundary: 65 tokens open two pages
    assert f(65, 63, 64) == 0  # the tail of the held page takes them
    assert f(65, 64, 64) == 64
    assert f(0, 0, 64) == 0 and f(10, -3, 64) == 0
    for held in range(0, 200, 7):
        for more in range(0, 200, 11):
            assert f(held, more, 16) <= -(-more // 16) * 16  # never more than the page-aligned worst case
            assert f(held, more, 16) % 16 == 0


def _clip_harness(page: int, pool: int):
    h = build_scheduler(page_size=page, pool_tokens=pool, max_reqs=8)
    s = h.scheduler  # what Scheduler.__init__ sets for the clip (the harness skips __init__)
    s.max_total_num_tokens, s.max_req_len, s.max_new_tokens_limit = pool, 2 * pool, None
    s.kv_shard_widening, s.sliding_window_size = 1, None
    return h


def test_the_never_fits_clip_lowers_max_new_to_what_admission_accepts_on_an_empty_pool(switch_on):
    page, pool, prompt = 64, 40 * 64, 30 * 64 + 5
    h = _clip_harness(page, pool)
    req = h.make_request(prompt, 10_000)
    h.scheduler.init_req_max_new_tokens(req)
    assert req.sampling_params.max_new_tokens == pool - prompt  # stock: pool - ceil(prompt) - page - 1
    h.add_request(req)
    assert h.step().rids == (req.rid,)  # admitted on the empty pool at once
    h.run_until(req.finished, max_passes=2 * pool)
    assert req.retraction_count == 0
    one_more = _clip_harness(page, pool)
    one_more.add_request(prompt, max_new_tokens=pool - prompt + 1)
    assert one_more.step().kind == "idle"  # one token more would never be admitted


def test_the_stock_clip_is_more_than_a_page_below_what_the_empty_pool_admits_and_that_page_finishes():
    """Measured, not restated: stock's clip, then a page more run to the end with the switch on."""
    page, pool, prompt = 64, 40 * 64, 30 * 64 + 5
    stock = _clip_harness(page, pool)
    req = stock.make_request(prompt, 10_000)
    stock.scheduler.init_req_max_new_tokens(req)
    clipped = req.sampling_params.max_new_tokens
    assert 0 < clipped < pool - prompt
    install_switch()
    h = _clip_harness(page, pool)
    longer = h.make_request(prompt, clipped + page)
    h.scheduler.init_req_max_new_tokens(longer)
    assert longer.sampling_params.max_new_tokens == clipped + page  # not clipped: it fits
    h.add_request(longer)
    assert h.step().rids == (longer.rid,)
    h.run_until(longer.finished, max_passes=2 * pool)
    assert longer.retraction_count == 0 and len(longer.output_ids) == clipped + page


def test_hybrid_swa_budget_keeps_the_stock_charges(switch_on):
    h = build_scheduler(page_size=64, pool_tokens=64 * 64, max_reqs=8, hybrid_swa=True, swa_pool_tokens=32 * 64)
    [h.add_request(64, max_new_tokens=66) for _ in range(3)]
    h.step()
    adder = _adder(h, num_mixed_decode_tokens=3)
    assert type(adder.memory_budget).__name__ == "SWAPrefillBudget"
    assert adder.memory_budget.total_offset == 3 * 65 + 3  # raw, as stock


# -- install: pins and refusal ----------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        f"{POLICY}:PrefillAdder._get_running_request_total_token_offset",  # wrapped
        "sglang.srt.mem_cache.prefill_budget:PrefillBudget.reserve",  # pinned, not wrapped
    ],
)
def test_a_drifted_pin_refuses_the_switch_and_leaves_admission_stock(monkeypatch, capfd, target):
    from sglang.srt.managers.schedule_policy import PrefillAdder

    monkeypatch.setitem(pins.PINS, target, "0" * 64)
    outcome = install_switch()
    assert outcome.status == "refused"
    assert target in outcome.reason and "drifted" in outcome.reason
    assert f"[dsv41] {NAME} refused: " in capfd.readouterr().err
    for attr in ("__init__", "_check_prefill_budget", "_update_prefill_budget"):
        assert not hasattr(PrefillAdder.__dict__[attr], "__wrapped__")
    assert admission.boundary_case(page=64, rows=2).overcommit_pages == 1  # stock behaviour


def test_install_logs_one_receipt_naming_the_charges(capfd):
    assert install_switch().status == "installed"
    err = capfd.readouterr().err
    assert f"[dsv41] {NAME} installed charges=running,mixed,check,reserve,clip scope=single-pool" in err


# -- hypothesis: random pool states -----------------------------------------------------------


@st.composite
def pool_states(draw):
    """A pool, running rows mid-decode and arriving prompts, normal or overlap loop order, mixed
    chunk or not; half the lengths sit on page boundaries (prompt = k pages, tokens left = 1 mod
    page), where raw charges fall short; chunked prefill of 4 or 8 pages, or one chunk."""
    page = draw(st.sampled_from((16, 64)))

    def request():
        if draw(st.booleans()):
            return draw(st.integers(1, 14)) * page, draw(st.integers(0, 4)) * page + 2
        return draw(st.integers(1, 900)), draw(st.integers(1, 260))

    rows = [request() for _ in range(draw(st.integers(0, 10)))]
    arrivals = [(draw(st.integers(0, 6)), request()) for _ in range(draw(st.integers(1, 6)))]
    return {
        "page": page, "pool_pages": draw(st.integers(16, 64)), "mixed": draw(st.booleans()),
        "overlap": draw(st.booleans()), "chunk_pages": draw(st.sampled_from((4, 8, 1000))),
        "rows": rows, "decode_steps": draw(st.integers(0, 40)), "arrivals": arrivals,
    }


@settings(max_examples=examples(30), deadline=None, suppress_health_check=list(HealthCheck))
@given(state=pool_states())
def test_admitted_work_always_fits_the_free_pages(state):
    boot.uninstall()
    assert install_switch().status == "installed"
    page, pool = state["page"], state["pool_pages"] * state["page"]
    h = build_scheduler(page_size=page, pool_tokens=pool, max_reqs=24, mixed_chunk=state["mixed"],
                        overlap=state["overlap"], chunked_prefill_size=min(pool, state["chunk_pages"] * page),
                        max_context_len=pool)
    everyone = [h.add_request(p, max_new_tokens=m) for p, m in state["rows"] if p + m <= pool - page]
    for _ in range(state["decode_steps"]):
        h.step()
        assert admission.overcommit_tokens(h) == 0
    schedule = sorted(state["arrivals"], key=lambda a: a[0])
    for passes in range(6000):
        while schedule and schedule[0][0] <= passes:
            p, m = schedule.pop(0)[1]
            if p + m <= pool - page:
                everyone.append(h.add_request(p, max_new_tokens=m))
        if not schedule and all(r.finished() for r in everyone):
            break
        h.step()
        assert admission.overcommit_tokens(h) == 0
    assert all(r.finished() for r in everyone)
    assert sum(r.retraction_count for r in everyone) == 0


@pytest.mark.slow
@pytest.mark.spawns
def test_a_fresh_engine_process_installs_the_switch_through_sitecustomize():
    """The real boot path: sitecustomize -> import hook -> install once the scheduler module loads."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    env.update(ON, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    code = (
        "import sglang.srt.managers.scheduler\n"
        "from sglang.srt.managers.schedule_policy import PrefillAdder\n"
        "assert hasattr(PrefillAdder.__dict__['_check_prefill_budget'], '__wrapped__')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"[dsv41] {NAME} installed charges=running,mixed,check,reserve,clip" in done.stderr
