"""Cone replay on the real ``UnifiedRadixCache`` (FULL + SWA), both tree cores.

An idle session's resume point loses its SWA window to other traffic while its Full KV stays; its
next turn is matched through the installed switch (plan), admitted by a real ``PrefillAdder``
through the switch's wrapped ``_select_prefill_admission``, copied by the switch's
``copy_replay_rows`` (called by ``devkit.testkit.cone.cone_turn`` where the switch's wrapped
``ScheduleBatch.prepare_for_extend`` calls it: these tests need only the copy; the wrapped
``prepare_for_extend`` runs in ``test_cone_replay_scheduler.py`` on a real ``Scheduler``), and
checkpointed by the real ``checkpoint_kv_cache`` / ``release_kv_cache``.
"""

from __future__ import annotations

import re
from array import array

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapter.core import boot
from devkit.testkit import cone_replay_parts as cone_replay
from devkit.testkit import radix_cache as rc
from devkit.testkit.cone import cone_turn, model_kit, recorder
from devkit.testkit.hypothesis_budget import examples
from devkit.testkit.tiny_hybrid import TinyHybrid
from overlay_tools.simulate import cache_kit
from overlay_tools.simulate.cone_turn import install

N = 64  # 4 pages of the SMALL geometry (page 16, window 8)
BACKENDS = ["python", "rust"]


def _install(tokens: int = N) -> boot.State:
    state = install(tokens)
    assert state.outcomes["cone_replay"].status == "armed", state.outcomes["cone_replay"]
    return state


def _lose_resume_point(kit: cache_kit.CacheKit, toks: rc.Tokens, prompt: int = 400) -> list[int]:
    """Session A runs one chunked turn, then two-turn traffic runs until A's window is gone."""
    history = kit.run_turn(toks.fresh(prompt), out_len=16).history
    for _ in range(200):
        if kit.resume_state(history)["lost"]:
            break
        first = kit.run_turn(toks.fresh(512), out_len=16)
        kit.run_turn(first.history + toks.fresh(64), out_len=16)
    state = kit.resume_state(history)
    assert state["lost"] and state["full_resident"] >= state["resume_at"] - kit.geometry.page, state
    return history


def _sane(kit: cache_kit.CacheKit) -> None:
    if kit.is_python_core():
        kit.cache.sanity_check()
    assert kit.leak_check() == {"full": 0, "swa": 0}


@pytest.mark.parametrize("backend", BACKENDS)
def test_lost_resume_point_is_replayed_from_s_and_the_next_turn_matches_fully(backend, capfd):
    _install()
    kit = cache_kit.build(cache_kit.SMALL, backend=backend)
    toks = rc.Tokens()
    history = _lose_resume_point(kit, toks)
    turn = cone_turn(kit, history + toks.fresh(64), out_len=16)
    page = kit.geometry.page
    plan = turn.plan
    assert plan is not None and turn.F == plan.F
    assert len(history) // page * page - page <= plan.F and plan.P < plan.s == plan.F - N
    assert turn.prefix_len == plan.s and turn.recomputed == len(history) + 64 - plan.s
    if backend == "python":
        assert turn.checks["anchor_locked"] >= 1  # the request's lock holds F's node
    assert turn.checks["pages"] == N // page and turn.checks["bytes"] > 0
    # The first checkpoint inserts exactly [0, F): replay pages freed as duplicates, the row points
    # at the tree's pages, F's window re-published, the branching point consumed, nothing leaked.
    assert turn.checks["cache_protected_len"] == plan.F
    assert turn.checks["swa_branching_seqlen"] is None
    assert turn.checks["row_is_tree_pages"]
    assert turn.checks["window_holes"] == []
    assert turn.checks["leak_after_first_checkpoint"] == {"full": 0}
    # The checkpoint re-publishes the replay's SWA KV of the last align_up(W, page) + page rows
    # before F (what the bound's last page pays for), and none below it (inexact near s).
    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = RadixKey(array("q", turn.history[: plan.F]))
    below = plan.F - cone_replay.align_up(kit.geometry.window, page) - page
    assert kit.core.swa_tombstone_ranges(key, plan.s, below) == [(plan.s, below)]
    _sane(kit)
    nxt = cone_turn(kit, turn.history + toks.fresh(32), out_len=16)
    assert nxt.plan is None and nxt.F is None
    assert nxt.prefix_len == len(turn.history) // page * page
    _sane(kit)
    err = capfd.readouterr().err
    assert re.search(rf"DSV41_SWA_CONE plan rid={turn.rid} F={plan.F} s={plan.s} N={N} ", err), err
    assert re.search(rf"DSV41_SWA_CONE copy rid={turn.rid} pages={N // page} bytes=\d+", err), err
    assert cone_replay.COUNTERS.plans == 1 and cone_replay.COUNTERS.fallbacks == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_first_chunk_shorter_than_the_replay_falls_back_to_the_stock_match(backend, capfd):
    _install()
    kit = cache_kit.build(cache_kit.SMALL, backend=backend)
    toks = rc.Tokens()
    history = _lose_resume_point(kit, toks)
    turn = cone_turn(kit, history + toks.fresh(64), out_len=16, chunk=N - kit.geometry.page)
    assert turn.plan is None and turn.prefix_len == turn.stock_prefix < turn.F
    assert turn.recomputed == len(history) + 64 - turn.stock_prefix
    _sane(kit)
    nxt = cone_turn(kit, turn.history + toks.fresh(32), out_len=16)
    assert nxt.plan is None and nxt.prefix_len == len(turn.history) // kit.geometry.page * kit.geometry.page
    _sane(kit)
    assert re.search(rf"DSV41_SWA_CONE fallback rid={turn.rid} reason=first_chunk_short", capfd.readouterr().err)
    assert cone_replay.FALLBACKS == {"first_chunk_short": 1}


def test_switch_off_leaves_the_stock_reprefill():
    kit = cache_kit.build(cache_kit.SMALL, backend="python")
    toks = rc.Tokens()
    history = _lose_resume_point(kit, toks)
    turn = cone_turn(kit, history + toks.fresh(64), out_len=16)
    assert turn.plan is None and turn.F is not None and turn.prefix_len == turn.stock_prefix < turn.F - N
    _sane(kit)


@pytest.mark.parametrize("tokens,why", [(16, "< bound=48"), (40, "not a multiple of the page size 16")])
def test_replay_depth_below_the_bound_or_off_page_refuses_at_cache_build(tokens, why, capfd):
    state = _install(tokens)
    model = TinyHybrid("SSSF", window=8)  # bound = align_up(16 + 2 * 8, 16) + 16 = 48
    kit = model_kit(model, cache_kit.SMALL.with_pools(full_tokens=4096, swa_tokens=1024), backend="python")
    cfg = cone_replay.cache_config(kit.cache)
    assert cfg is not None and not cfg.enabled and why in cfg.reason
    assert state.outcomes["cone_replay"].status == "refused"
    err = capfd.readouterr().err
    assert f"cone_replay armed N={tokens} " in err and "cone_replay installed" not in err  # never both
    assert re.search(rf"cone_replay refused: DSV41_SWA_CONE_TOKENS={tokens} ", err)
    toks = rc.Tokens()
    history = kit.run_turn(toks.fresh(256), out_len=16).history
    kit.evict(swa=4096)  # the window goes, the Full KV stays
    turn = cone_turn(kit, history + toks.fresh(32), out_len=16)
    assert turn.plan is None  # refused: the stock match stands


def test_a_quantized_full_kv_cache_refuses_at_cache_build_and_stays_stock(capfd):
    """The forward side reads the replay rows' K/V back from the Full pool: fp8 cannot give the
    bytes the forward computed, so such an engine must not replay."""
    state = _install()
    kit = cache_kit.build(cache_kit.SMALL, backend="python", kv_dtype=torch.float8_e4m3fn)
    assert state.outcomes["cone_replay"].status == "refused"
    assert "the Full KV cache is quantized (torch.float8_e4m3fn)" in capfd.readouterr().err
    toks = rc.Tokens()
    history = _lose_resume_point(kit, toks)
    turn = cone_turn(kit, history + toks.fresh(64), out_len=16)
    assert turn.plan is None and turn.prefix_len == turn.stock_prefix < turn.F - N
    _sane(kit)


def test_strict_refusal_at_cache_build_is_a_boot_error():
    install(16, DSV41_STRICT="1")
    with pytest.raises(boot.BootError, match="DSV41_SWA_CONE_TOKENS=16 < bound=48"):
        model_kit(TinyHybrid("SSSF", window=8), cache_kit.SMALL.with_pools(full_tokens=4096, swa_tokens=1024))


@pytest.mark.parametrize("backend", BACKENDS)
def test_cone_turn_on_the_cache_is_bit_identical_to_a_prefix_hit_end_to_end(backend):
    """The tiny model runs on the cache's own SWAKVPool: kit A keeps the window (prefix hit at F),
    kit B loses it to traffic whose slots overwrite the freed SWA pages (cone). Rows >= F agree."""
    _install()
    model = TinyHybrid("SFSS", window=8, d=16)  # bound = align_up(16 + 2 * 8, 16) + 16 = 48 <= N
    g = cache_kit.SMALL.with_pools(full_tokens=16384, swa_tokens=1024)
    outs: dict[str, dict[int, torch.Tensor]] = {"hit": {}, "cone": {}}

    def rec(kit, name):
        return recorder(model, kit, outs[name])

    prompt = rc.Tokens(start=5).fresh(400)
    new = rc.Tokens(start=100_000).fresh(48)
    # kit A: turn 1 with the model, then turn 2 as a prefix hit at F
    kit_a = model_kit(model, g.with_pools(swa_tokens=16384), backend)
    outs["t1a"] = {}
    hist = cone_turn(kit_a, prompt, 16, forward=rec(kit_a, "t1a")).history
    hit = cone_turn(kit_a, hist + new, 16, forward=rec(kit_a, "hit"))
    assert hit.plan is None and hit.F is None
    kit_b = model_kit(model, g, backend)
    outs["t1b"] = {}
    cone_turn(kit_b, prompt, 16, forward=rec(kit_b, "t1b"))
    toks = rc.Tokens(start=200_000)
    for _ in range(60):
        if kit_b.resume_state(hist)["lost"]:
            break
        kit_b.run_turn(toks.fresh(256), out_len=16)
    cone = cone_turn(kit_b, hist + new, 16, forward=rec(kit_b, "cone"))
    # The SWA-evicted last leaf took its Full page along, so F may sit a page below the hit.
    F = cone.plan.F
    assert cone.plan is not None and hit.prefix_len - kit_a.geometry.page <= F <= hit.prefix_len
    rows = sorted(r for r in outs["hit"] if r >= F)
    assert len(rows) == len(hist) + len(new) + 16 - hit.prefix_len
    assert all(torch.equal(outs["cone"][r], outs["hit"][r]) for r in rows)
    # Rows [F, hit's prefix) were turn 1's decode rows in kit A: the cone recomputed them bit for bit.
    assert all(torch.equal(outs["cone"][r], outs["t1a"][r]) for r in range(F, hit.prefix_len))
    _sane(kit_a)
    _sane(kit_b)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["turn", "turn", "new", "traffic", "evict"]), st.integers(0, 3),
                              st.sampled_from([32, 64, 128])), min_size=4, max_size=16))
def test_trace_of_replays_mixed_with_other_traffic_keeps_the_tree_sane(backend, ops):
    """Sessions take turns among new sessions, traffic and evictions; each turn goes through the
    cone path with chunk 64 or 32 (fallback). Invariants after every step: no slot leaked, the
    tree is sane, a cone recomputes at most N + the new tokens, and a turn never starts below a
    usable cone start."""
    boot.uninstall()
    _install()
    kit = cache_kit.build(cache_kit.SMALL, backend=backend)
    toks = rc.Tokens()
    sessions: list[list[int]] = []
    page = kit.geometry.page
    # Two idle sessions whose windows an SWA shortage takes first, then the drawn trace.
    for op, who, size in [("new", 0, 64), ("new", 1, 128), ("evict", 0, 128), *ops]:
        if op == "new" or (op == "turn" and not sessions):
            sessions.append(kit.run_turn(toks.fresh(size + 256), out_len=16).history)
        elif op == "turn":
            i = who % len(sessions)
            new = toks.fresh(32)
            chunk = 64 if size != 32 else 32
            turn = cone_turn(kit, sessions[i] + new, out_len=16, chunk=chunk)
            if turn.plan is not None:
                assert turn.recomputed == N + len(sessions[i]) - turn.plan.F + len(new)
                assert turn.checks["window_holes"] == [] and turn.checks["cache_protected_len"] == turn.plan.F
            elif turn.F is not None and chunk >= N:
                assert cone_replay.cone_start(turn.F, N, page) <= turn.stock_prefix
            sessions[i] = turn.history
        elif op == "traffic":
            kit.run_turn(toks.fresh(size * 8), out_len=16)
        else:  # an SWA shortage: from a few pages to the whole pool
            kit.evict(swa=size * 8)
        _sane(kit)


def test_cone_replay_beside_swa_thin_replays_and_keeps_the_tree_sane():
    """Both SWA switches on (the python core, as SWA thin needs): the cone still plans, copies and
    re-publishes F's window; the next turn matches fully."""
    state = install(N, DSV41_SWA_THIN="1")
    kit = cache_kit.build(cache_kit.SMALL, backend="python")
    assert {state.outcomes[n].status for n in ("cone_replay", "swa_thin")} == {"installed"}
    toks = rc.Tokens()
    history = _lose_resume_point(kit, toks)
    turn = cone_turn(kit, history + toks.fresh(64), out_len=16)
    assert turn.plan is not None and turn.prefix_len == turn.plan.F - N
    assert turn.checks["window_holes"] == [] and turn.checks["cache_protected_len"] == turn.plan.F
    _sane(kit)
    nxt = cone_turn(kit, turn.history + toks.fresh(32), out_len=16)
    assert nxt.plan is None and nxt.prefix_len == len(turn.history) // kit.geometry.page * kit.geometry.page
    _sane(kit)
