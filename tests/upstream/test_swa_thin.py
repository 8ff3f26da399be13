"""SWA thin on the real ``UnifiedRadixCache`` (FULL + SWA, python tree core, scaled DSV4 shape:
page 16, window 8, chunk 128). Each test runs a thin cache beside a stock twin built the same way
(``swa_thin.keep_stock``) and drives both through the scheduler's entry points."""

from __future__ import annotations

import importlib
import logging

import pytest

from adapter.core import boot, receipts
from adapter.switches import swa_thin
from devkit.testkit import radix_cache as rc
from overlay_tools.simulate import cache_kit

P = cache_kit.SMALL.page


def pair(geometry: cache_kit.Geometry = cache_kit.SMALL, session: bool = False) -> tuple[cache_kit.CacheKit, cache_kit.CacheKit]:
    """(stock, thin): two real caches built identically; the first is kept in stock LRU order."""
    stock = cache_kit.build(geometry, backend=None, session=session)
    swa_thin.keep_stock(stock.cache)
    return stock, cache_kit.build(geometry, backend=None, session=session)


def tail_ids(kit: cache_kit.CacheKit, n: int = 1) -> list[int]:
    """Node ids at the evict-first end of the SWA LRU (the tail first)."""
    lru = kit.core.lru_lists[rc_swa()]
    out, x = [], lru.tail.lru_prev[lru._pt]
    while x is not lru.head and len(out) < n:
        if x is not lru.mid and x is not lru.cursor:
            out.append(x.id)
        x = x.lru_prev[lru._pt]
    return out


def window_ids(kit: cache_kit.CacheKit, tokens: list[int]) -> set[int]:
    """The SWA-bearing nodes of the checkpoint ending at ``tokens`` (its last W + page tokens)."""
    node, covered, out = kit.core.node_by_id(kit.node_at(tokens)), 0, set()
    while node is not kit.core.root_node and covered < cache_kit.SMALL.window + P:
        if node.component_data[rc_swa()].value is not None:
            out.add(node.id)
        covered += len(node.key)
        node = node.parent
    return out


def at_tail(kit: cache_kit.CacheKit, tokens: list[int]) -> bool:
    """The checkpoint ending at ``tokens`` is what SWA eviction takes next."""
    ids = window_ids(kit, tokens)
    return bool(ids) and set(tail_ids(kit, len(ids))) == ids


def order_without(kit: cache_kit.CacheKit, tokens: list[int]) -> list[int]:
    """The SWA LRU order (DFS indices) without the window nodes of the checkpoint at ``tokens``."""
    index = {n.id: i for i, n in enumerate(rc._dfs(kit.core))}
    skip = {index[i] for i in window_ids(kit, tokens)}
    return [i for i in rc.swa_lru(kit) if i not in skip]


def rc_swa():
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    return ComponentType.SWA


def position_from_head(kit: cache_kit.CacheKit, node_id: int) -> int:
    lru = kit.core.lru_lists[rc_swa()]
    x, i = lru.head.lru_next[lru._pt], 0
    while x is not lru.tail:
        if x.id == node_id:
            return i
        if x is not lru.mid and x is not lru.cursor:
            i += 1
        x = x.lru_next[lru._pt]
    raise AssertionError(f"node {node_id} not in the SWA LRU")


def both(kits, fn):
    return [fn(k) for k in kits]


def test_switch_selects_the_python_tree_core_and_says_so(thin):
    import os

    assert os.environ[swa_thin.BACKEND_ENV] == "python"
    assert thin.outcomes["swa_thin"].params["backend_set_by"] == "overlay"
    kit = cache_kit.build(cache_kit.SMALL, backend=None)  # the engine's path: backend from the environment
    assert kit.is_python_core()
    boot.uninstall()
    assert swa_thin.BACKEND_ENV not in os.environ  # rollback restores the default (rust) core


def test_switch_refuses_when_the_operator_chose_the_rust_core(monkeypatch):
    monkeypatch.setenv(swa_thin.BACKEND_ENV, "rust")
    state = boot.install({"DSV41_SWA_THIN": "1"})
    outcome = state.outcomes["swa_thin"]
    assert outcome.status == "refused"
    assert "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND='rust'" in outcome.reason
    assert "Python tree core" in outcome.reason
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    assert not hasattr(vars(UnifiedRadixCache)["checkpoint_into_tree"], "__wrapped__")


def test_cache_built_with_an_explicit_rust_core_stays_stock(thin, caplog):
    tok = rc.Tokens()
    kit = cache_kit.build(cache_kit.SMALL, backend="rust")
    a = kit.run_turn(tok.fresh(4 * P), P)
    kit.run_turn(a.history + tok.fresh(2 * P), P)
    assert swa_thin.STATS.rust_caches == 1 and swa_thin.STATS.hooked == 0
    assert kit.leak_check() == {"full": 0, "swa": 0}


def test_passed_chunk_checkpoints_go_to_the_evict_first_end_oldest_first(thin):
    tok = rc.Tokens()
    stock, kit = pair()
    other = tok.fresh(6 * P)
    both((stock, kit), lambda k: k.run_turn(other, P))  # older traffic: stock's next SWA victim
    prompt = tok.fresh(4 * cache_kit.SMALL.chunk)
    reqs = both((stock, kit), lambda k: k.admit(prompt, P))
    ends = [cache_kit.SMALL.chunk * i for i in range(1, 5)]
    for i, end in enumerate(ends):
        for k, r in zip((stock, kit), reqs):
            k.prefill_to(r, end)
        if i == 0:  # the first chunk passes nothing of its own
            assert rc.swa_lru(kit) == rc.swa_lru(stock)
            continue
        passed = prompt[: ends[i - 1]]
        if end == len(prompt):  # the prompt's last chunk checkpoint: where later branches resume
            assert not at_tail(kit, passed)
            assert position_from_head(kit, kit.node_at(passed)) == position_from_head(stock, stock.node_at(passed))
            continue
        # Oldest demoted first: the checkpoints passed before this one stay nearer the tail.
        run = [window_ids(kit, prompt[:e]) for e in ends[:i]]
        tail, at = tail_ids(kit, sum(map(len, run))), 0
        for window in run:
            assert set(tail[at:at + len(window)]) == window, "passed checkpoints are the next SWA victims, oldest first"
            at += len(window)
        assert not at_tail(stock, passed)
        assert position_from_head(kit, kit.node_at(prompt[:end])) == 0, "the new window stays most recently used"
        assert window_ids(kit, prompt[:end]).isdisjoint(tail_ids(kit, 4))
        kit.cache.sanity_check()
    for k, r in zip((stock, kit), reqs):
        k.finish(r, P)
    assert kit.leak_check() == {"full": 0, "swa": 0}


def drain(kit: cache_kit.CacheKit, *reqs) -> None:
    """Prefill and finish ``reqs`` in turn: nothing leaks and the tree stays sound."""
    for r in reqs:
        kit.prefill(r)
        kit.finish(r, P)
    assert kit.leak_check() == {"full": 0, "swa": 0}
    kit.cache.sanity_check()


def test_a_demoted_checkpoint_a_request_matches_again_leaves_the_run_and_later_ones_queue_behind_the_rest(thin):
    tok = rc.Tokens()
    kit = cache_kit.build(cache_kit.SMALL, backend=None)
    kit.run_turn(tok.fresh(6 * P), P)
    prompt = tok.fresh(5 * cache_kit.SMALL.chunk)
    a, b, c = (prompt[: cache_kit.SMALL.chunk * i] for i in (1, 2, 3))
    req = kit.admit(prompt, P)
    for checkpoint in (a, b, c):  # one chunk each: passes a, then b (the run's front)
        kit.prefill_to(req, len(checkpoint))
    branch = kit.admit(b + tok.fresh(2 * P), P)  # matches b: its window goes to the most-recently-used end
    assert not window_ids(kit, b) & set(tail_ids(kit, len(window_ids(kit, a)) + 2))
    kit.prefill_to(req, 4 * cache_kit.SMALL.chunk)  # demotes c
    run = [window_ids(kit, a), window_ids(kit, c)]
    tail = tail_ids(kit, sum(map(len, run)))
    assert set(tail[: len(run[0])]) == run[0] and set(tail[len(run[0]):]) == run[1]
    drain(kit, req, branch)


def test_a_cache_that_outlived_an_uninstall_demotes_again_after_the_switch_is_back(thin):
    tok = rc.Tokens()
    kit = cache_kit.build(cache_kit.SMALL, backend=None)
    prompt = tok.fresh(4 * cache_kit.SMALL.chunk)
    a, b, c = (prompt[: cache_kit.SMALL.chunk * i] for i in (1, 2, 3))
    req = kit.admit(prompt, P)
    for checkpoint in (a, b):
        kit.prefill_to(req, len(checkpoint))  # a demoted: the run's front
    boot.uninstall()
    branch = kit.admit(a + tok.fresh(2 * P), P)  # the front leaves the list unseen
    boot.install({"DSV41_SWA_THIN": "1"})
    kit.prefill_to(req, len(c))  # demotes b
    assert set(tail_ids(kit, len(window_ids(kit, b)))) == window_ids(kit, b)
    drain(kit, req, branch)


def test_first_chunks_prefix_match_node_keeps_its_place(thin):
    tok = rc.Tokens()
    stock, kit = pair()
    first = tok.fresh(6 * P)
    t1 = both((stock, kit), lambda k: k.run_turn(first, P))
    history = t1[0].history
    assert t1[0].history == t1[1].history
    prompt = history + tok.fresh(2 * cache_kit.SMALL.chunk)
    reqs = both((stock, kit), lambda k: k.admit(prompt, P))
    assert reqs[0].prefix_len == reqs[1].prefix_len == len(history)
    resume = kit.node_at(history)
    first_end = reqs[1].prefix_len + cache_kit.SMALL.chunk
    for k, r in zip((stock, kit), reqs):
        k.prefill_to(r, first_end)
    assert rc.swa_lru(kit) == rc.swa_lru(stock), "the first chunk demotes nothing"
    for k, r in zip((stock, kit), reqs):
        k.prefill(r)
    assert not at_tail(kit, history)
    # Only the passed chunk checkpoint moved: among all other nodes the order is stock's.
    passed = prompt[:first_end]
    assert order_without(kit, passed) == order_without(stock, passed)
    assert resume in {n.id for n in rc._dfs(kit.core)}


def test_one_pass_prefill_demotes_its_prefix_match_node(thin):
    tok = rc.Tokens()
    stock, kit = pair()
    first = tok.fresh(6 * P)
    t1 = both((stock, kit), lambda k: k.run_turn(first, P))
    history = t1[1].history
    resume = kit.node_at(history)
    prompt = history + tok.fresh(3 * P)
    reqs = both((stock, kit), lambda k: k.admit(prompt, P))
    assert reqs[1].prefix_len == len(history)
    for k, r in zip((stock, kit), reqs):
        k.prefill(r)  # one pass: 3 pages < chunk
    assert at_tail(kit, history) and kit.node_at(history) == resume
    assert not at_tail(stock, history)
    kit.cache.sanity_check()


def test_finished_turns_demote_nothing(thin):
    tok = rc.Tokens()
    stock, kit = pair()
    both((stock, kit), lambda k: k.run_turn(tok.fresh(6 * P), P))  # older traffic: stock's next SWA victim
    prompt = tok.fresh(4 * cache_kit.SMALL.chunk)
    reqs = both((stock, kit), lambda k: k.admit(prompt, P))
    for k, r in zip((stock, kit), reqs):
        k.prefill(r)
    before = swa_thin.STATS.demoted
    lru_before = [rc.swa_lru(k) for k in (stock, kit)]
    for k, r in zip((stock, kit), reqs):
        k.finish(r, 2 * P)
    assert swa_thin.STATS.demoted == before
    # The release inserts the output the same way in both caches: the thin order moves as stock's does.
    assert lru_before[0] != lru_before[1]
    leaf = kit.node_at(prompt + [cache_kit.OUTPUT_TOKEN] * 2 * P)
    assert position_from_head(kit, leaf) == position_from_head(stock, stock.node_at(prompt + [cache_kit.OUTPUT_TOKEN] * 2 * P)) == 0


def test_locked_nodes_stay_in_place(thin):
    tok = rc.Tokens()
    stock, kit = pair()
    first = tok.fresh(6 * P)
    t1 = both((stock, kit), lambda k: k.run_turn(first, P))
    history = t1[1].history
    resume = kit.node_at(history)
    # Another request is admitted on the same resume point and holds its lock while this one runs.
    holder_prompt = history + tok.fresh(2 * P)
    holders = both((stock, kit), lambda k: k.admit(holder_prompt, P))
    assert kit.core.node_by_id(resume).component_data[rc_swa()].lock_ref > 0
    prompt = history + tok.fresh(3 * P)
    reqs = both((stock, kit), lambda k: k.admit(prompt, P))
    for k, r in zip((stock, kit), reqs):
        k.prefill(r)
    assert not at_tail(kit, history)
    assert position_from_head(kit, resume) == position_from_head(stock, stock.node_at(history))
    for k, r, h in zip((stock, kit), reqs, holders):
        k.finish(r, P)
        drain(k, h)


def test_shared_nodes_stay_in_place(thin):
    tok = rc.Tokens()
    stock, kit = pair()
    first = tok.fresh(6 * P)
    t1 = both((stock, kit), lambda k: k.run_turn(first, P))
    history = t1[1].history
    resume = kit.node_at(history)
    cont = history + tok.fresh(3 * P)
    both((stock, kit), lambda k: k.run_turn(cont, P))  # first continuation
    assert at_tail(kit, history), "a resume point one request has moved past is demoted"
    # A fork from the same resume point: the node now has two children, so it is shared.
    fork = history + tok.fresh(2 * P)
    forks = both((stock, kit), lambda k: k.admit(fork, P))
    for k, r in zip((stock, kit), forks):
        k.prefill(r)
    node = kit.core.node_by_id(resume)
    assert swa_thin.is_shared(node) and len(node.children) == 2
    assert not at_tail(kit, history)
    assert position_from_head(kit, resume) == position_from_head(stock, stock.node_at(history))
    for k, r in zip((stock, kit), forks):
        k.finish(r, P)
    kit.cache.sanity_check()


def _trace(tok: rc.Tokens, n_sessions: int = 4, turns: int = 3):
    """A deterministic multi-session trace: chunked first turns, one-pass and chunked later turns."""
    ops = []
    for t in range(turns):
        for s in range(n_sessions):
            new = tok.fresh((2 * cache_kit.SMALL.chunk + 3 * P) if (t == 0 or (s + t) % 3 == 0) else 3 * P)
            ops.append((s, new, P * (1 + (s + t) % 2)))
    return ops


def test_only_lru_order_differs_from_stock_after_every_operation(thin):
    tok = rc.Tokens()
    stock, kit = pair(cache_kit.SMALL.with_pools(swa_tokens=8192))  # no SWA eviction: trees stay comparable
    histories: dict[int, list[int]] = {}
    differed = 0
    for session, new, out in _trace(tok):
        prompt = histories.get(session, []) + new
        reqs = both((stock, kit), lambda k, prompt=prompt, out=out: k.admit(prompt, out))
        steps = [lambda k, r: k.prefill_to(r, min(len(r.origin_input_ids), r._kit_pos + cache_kit.SMALL.chunk))] * 8
        for step in steps:
            if reqs[0]._kit_pos >= len(prompt):
                break
            for k, r in zip((stock, kit), reqs):
                step(k, r)
            a, b = rc.snapshot(stock), rc.snapshot(kit)
            assert a == b, "thin changed something other than the SWA LRU order"
            assert sorted(rc.swa_lru(stock)) == sorted(rc.swa_lru(kit))
            differed += rc.swa_lru(stock) != rc.swa_lru(kit)
            stock.cache.sanity_check()
            kit.cache.sanity_check()
        hist = [k.finish(r, out) for k, r in zip((stock, kit), reqs)]
        assert hist[0] == hist[1]
        histories[session] = hist[0]
        assert rc.snapshot(stock) == rc.snapshot(kit)
    assert differed > 5, "the trace never exercised a demotion"
    assert swa_thin.STATS.demoted > 0
    assert kit.leak_check() == stock.leak_check() == {"full": 0, "swa": 0}


def _idle_session_survival(kit: cache_kit.CacheKit, tok: rc.Tokens, limit: int = 200) -> tuple[int, int]:
    """Session A runs one chunked turn and goes idle; two-turn sessions run beside it. Returns the
    other requests and SWA slots of traffic after which A's resume point is gone."""
    a = kit.run_turn(tok.fresh(25 * P), P)
    assert not kit.resume_state(a.history)["lost"]
    start, n = kit.swa_alloc_tokens, 0
    while n < limit:
        r = kit.run_turn(tok.fresh(32 * P), P)
        kit.run_turn(r.history + tok.fresh(4 * P), P)
        n += 2
        if kit.resume_state(a.history)["lost"]:
            break
    return n, kit.swa_alloc_tokens - start


def test_idle_session_keeps_its_resume_point_after_other_traffic(thin):
    stock, kit = pair()
    stock_reqs, stock_slots = _idle_session_survival(stock, rc.Tokens())
    _, thin_slots = _idle_session_survival(kit, rc.Tokens())
    assert stock_reqs < 200, "the stock resume point must be lost in this workload"
    assert thin_slots >= 2 * stock_slots, (stock_slots, thin_slots)
    for k in (stock, kit):
        k.cache.sanity_check()
        assert k.leak_check() == {"full": 0, "swa": 0}


def test_session_radix_cache_keeps_its_partition_and_referenced_nodes(thin):
    tok = rc.Tokens()
    stock, kit = pair(session=True)
    lru = kit.core.lru_lists[rc_swa()]
    assert lru.mid is not None
    first = tok.fresh(6 * P)
    t1 = both((stock, kit), lambda k: k.run_turn(first, P, session_id="s1"))
    history = t1[1].history
    resume = kit.node_at(history)
    assert kit.core.node_by_id(resume).component_data[rc_swa()].session_ref > 0
    prompt = history + tok.fresh(3 * cache_kit.SMALL.chunk)
    reqs = both((stock, kit), lambda k: k.admit(prompt, P, session_id="s1"))
    ends = []
    while reqs[1]._kit_pos < len(prompt):
        for k, r in zip((stock, kit), reqs):
            k.prefill_to(r, min(len(prompt), r._kit_pos + cache_kit.SMALL.chunk))
        ends.append(reqs[1]._kit_pos)
        kit.cache.sanity_check()
        order = rc.swa_lru(kit)
        mid = order.index(-1)
        index = {n.id: i for i, n in enumerate(rc._dfs(kit.core))}
        referenced = [i for i in order[:mid]]
        assert index[resume] in referenced, "the session-referenced resume point stays in its partition"
    assert at_tail(kit, prompt[: ends[-3]]), "unreferenced passed checkpoints go to the tail"
    assert not at_tail(kit, prompt[: ends[-2]]), "the prompt's last chunk checkpoint stays"
    for k, r in zip((stock, kit), reqs):
        k.finish(r, P)
    kit.cache.sanity_check()
    assert kit.leak_check() == {"full": 0, "swa": 0}


def test_a_demotion_receipt_is_logged_once_every_1024_hooked_inserts(thin, caplog):
    tok = rc.Tokens()
    kit = cache_kit.build(cache_kit.SMALL, backend=None)
    swa_thin.STATS.hooked = swa_thin.RECEIPT_EVERY - 3
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    receipts.logger().addHandler(handler)
    try:
        a = kit.run_turn(tok.fresh(3 * cache_kit.SMALL.chunk), P)  # 3 chunk checkpoints + release = 4 inserts
        kit.run_turn(a.history + tok.fresh(P), P)
    finally:
        receipts.logger().removeHandler(handler)
    parsed = [receipts.parse_line(line) for line in lines]
    demoted = [r for r in parsed if r is not None and r.switch == "swa_thin" and r.event == "demoted"]
    assert len(demoted) == 1
    assert demoted[0].params["hooked"] == str(swa_thin.RECEIPT_EVERY)
    # chunk 2 passed chunk 1's checkpoint (2 SWA-bearing nodes: W + page spans two pages); chunk 3
    # ends the prefill and keeps chunk 2's
    assert int(demoted[0].params["demoted_nodes"]) == 2


@pytest.mark.spawns
def test_a_scheduler_process_inheriting_the_overlays_choice_reports_backend_set_by_overlay(monkeypatch):
    """The launcher's overlay sets the tree-core variable; the scheduler process inherits it and must
    not report it as the operator's choice."""
    import os
    import subprocess
    import sys

    monkeypatch.delenv(swa_thin.BACKEND_ENV, raising=False)
    state = boot.install({"DSV41_SWA_THIN": "1"})
    importlib.import_module(swa_thin.SWITCH.module_of("checkpoint_into_tree"))
    assert state.outcomes["swa_thin"].params["backend_set_by"] == "overlay"
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}  # what a child inherits
    assert child_env[swa_thin.BACKEND_ENV] == "python"
    script = (
        "import importlib\n"
        "from adapter.core import boot\n"
        "from adapter.switches import swa_thin\n"
        "state = boot.install({'DSV41_SWA_THIN': '1'})\n"
        "importlib.import_module(swa_thin.SWITCH.module_of('checkpoint_into_tree'))\n"
        "print(state.outcomes['swa_thin'].params['backend_set_by'])\n"
    )
    root = str(boot.__file__).rsplit("/adapter/", 1)[0]
    for env, expected in ((child_env, "overlay"),
                          ({k: v for k, v in child_env.items() if k != swa_thin.SET_BY_OVERLAY_ENV}, "operator")):
        out = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == expected
