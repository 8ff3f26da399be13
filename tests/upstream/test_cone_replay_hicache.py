"""Cone replay beside HiCache, on the real ``UnifiedRadixCache`` with HiCache attached
(``init_hicache``: the real host pools, cache controller and transfers; ``overlay_tools.simulate.cache_kit.HiCache``).

HiCache keeps an idle session's window on host when it leaves the device (write-back: on eviction;
write-through: when a node is hit), and the stock admission loads it back. The cone acts only where
that cannot help: the window at F is on neither device nor host. With the Full KV of ``[0, F)`` on
device it starts from ``s = F - N`` if s lies past the stock resume point after load-back
(``best_match_node``'s depth B), queues no load-back, and replays N tokens. With the Full KV of
``[D, F)`` on host only, the admission loads it back through HiCache's own ``init_load_back`` (the
Full component only: HiCache's counters move, the SWA host pool is not touched), then replays N.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from devkit.testkit import cone_replay_parts as cone_replay
from devkit.testkit import radix_cache as rc
from devkit.testkit.cone import cone_turn, model_kit, recorder
from devkit.testkit.tiny_hybrid import TinyHybrid
from overlay_tools.simulate import cache_kit
from overlay_tools.simulate.cone_turn import install

N = 64  # 4 pages of the SMALL geometry (page 16, window 8)
POLICIES = ["write_back", "write_through"]


def _window_state(kit: cache_kit.CacheKit, history: list[int]) -> dict[str, bool]:
    """Where the resume point F = page_floor(len(history))'s last node keeps its Full KV and SWA
    window: on device, on host (python core)."""
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    page = kit.geometry.page
    f = len(history) // page * page
    node, off = kit.core.root_node, 0
    while off < f:
        head = tuple(history[off : off + page])
        child = next((c for c in node.children.values() if tuple(c.key.token_ids[:page]) == head), None)
        if child is None:
            break
        node, off = child, off + len(child.key)
    full, swa = node.component_data[ComponentType.FULL], node.component_data[ComponentType.SWA]
    return {"full_device": full.value is not None, "full_host": full.host_value is not None,
            "swa_device": swa.value is not None, "swa_host": swa.host_value is not None, "depth": off}


def _lose_window_everywhere(kit: cache_kit.CacheKit, toks: rc.Tokens) -> list[int]:
    """Session A runs a turn and a fork continues it (A's resume point becomes an inner node, as a
    retried or branched agent turn leaves it); traffic runs until A's window is on neither device
    nor host while its Full KV stays on device."""
    history = kit.run_turn(toks.fresh(400), out_len=16).history
    kit.run_turn(history + toks.fresh(32), out_len=16)
    for _ in range(60):
        where = _window_state(kit, history)
        if where["full_device"] and not where["swa_device"] and not where["swa_host"]:
            return history
        first = kit.run_turn(toks.fresh(512), out_len=16)
        kit.run_turn(first.history + toks.fresh(64), out_len=16)
    raise AssertionError(f"A's window never left both tiers: {_window_state(kit, history)}")


def _lose_window_and_full_kv(kit: cache_kit.CacheKit, toks: rc.Tokens, history: list[int],
                             traffic: Any = None) -> dict[str, Any]:
    """Push every turn's Full KV off the device (to host: write-back backs it up on eviction,
    write-through already has) while the small host SWA tier churns A's window out; until A's
    resume point F keeps its Full KV on host only and its window nowhere. ``traffic(tokens)`` runs a
    turn (default: the kit's own, without a model)."""
    run = traffic or (lambda tokens: kit.run_turn(tokens, out_len=16))
    kit.evict(full=1 << 20)
    for _ in range(40):
        run(toks.fresh(256))
        kit.evict(full=1 << 20)
        where = _window_state(kit, history)
        if not where["full_device"] and where["full_host"] and not where["swa_device"] and not where["swa_host"]:
            return where
    raise AssertionError(f"A's Full KV never sat on host only with its window gone: {_window_state(kit, history)}")


def _sane(kit: cache_kit.CacheKit) -> None:
    kit.cache.sanity_check()
    assert kit.leak_check() == {"full": 0, "swa": 0}


@pytest.mark.parametrize("policy", POLICIES)
def test_beside_hicache_a_window_on_neither_tier_is_replayed_from_s_without_a_load_back(policy, capfd):
    install(N)
    kit = cache_kit.build(cache_kit.SMALL, hicache=cache_kit.HiCache(ratio=0.5, write_policy=policy))
    assert kit.cache.cache_controller is not None and kit.cache.host_pool_group is not None
    toks = rc.Tokens()
    history = _lose_window_everywhere(kit, toks)
    turn = cone_turn(kit, history + toks.fresh(64), out_len=16)
    plan = turn.plan
    assert plan is not None, cone_replay.FALLBACKS
    assert plan.B < plan.s == plan.F - N and turn.prefix_len == plan.s
    assert turn.recomputed == len(history) + 64 - plan.s
    assert kit.loaded_from_host == 0  # the cone queued no load-back
    assert turn.checks["cache_protected_len"] == plan.F and turn.checks["window_holes"] == []
    assert turn.checks["leak_after_first_checkpoint"] == {"full": 0}
    _sane(kit)
    nxt = cone_turn(kit, turn.history + toks.fresh(32), out_len=16)
    assert nxt.plan is None and nxt.prefix_len == len(turn.history) // kit.geometry.page * kit.geometry.page
    _sane(kit)
    err = capfd.readouterr().err
    assert re.search(rf"DSV41_SWA_CONE plan rid={turn.rid} F={plan.F} s={plan.s} N={N} P=\d+ B={plan.B}", err), err
    assert cone_replay.FALLBACKS == {}


@pytest.mark.parametrize("policy", POLICIES)
def test_beside_hicache_a_window_kept_on_host_is_loaded_back_and_the_cone_stays_out(policy):
    """Without the fork, A's resume point is a leaf: HiCache moves it to host whole (write-back) or
    has backed it up (write-through); the stock load-back restores it and nothing is replayed."""
    install(N)
    kit = cache_kit.build(cache_kit.SMALL, hicache=cache_kit.HiCache(ratio=2.0, write_policy=policy))
    toks = rc.Tokens()
    history = kit.run_turn(toks.fresh(400), out_len=16).history
    for _ in range(60):
        if kit.resume_state(history)["lost"]:
            break
        first = kit.run_turn(toks.fresh(512), out_len=16)
        kit.run_turn(first.history + toks.fresh(64), out_len=16)
    assert kit.resume_state(history)["lost"]  # gone from the device
    turn = cone_turn(kit, history + toks.fresh(64), out_len=16)
    assert turn.plan is None and turn.prefix_len == len(history) // kit.geometry.page * kit.geometry.page
    assert kit.loaded_from_host > 0 and turn.recomputed == 64
    assert cone_replay.COUNTERS.plans == 0 and cone_replay.FALLBACKS == {}
    _sane(kit)


def _hit_beside_a_hicache_kit():
    """The tiny model on the cache's own SWAKVPool: kit A (no HiCache, everything kept) runs a
    400-token session and resumes it with a prefix hit; kit B (HiCache write-back) runs the same
    first turn. Returns (model, kit A, kit B, the session's history, its new tokens, the rows each
    named forward recorded, a recorder for B's forwards, B's traffic tokens)."""
    install(N)
    model = TinyHybrid("SFSS", window=8, d=16)  # bound 48 <= N
    g = cache_kit.SMALL.with_pools(full_tokens=16384, swa_tokens=1024)
    outs: dict[str, dict[int, torch.Tensor]] = {"hit": {}, "cone": {}, "t1a": {}, "t1b": {}, "fork": {}, "other": {}}

    def rec(kit, name):
        return recorder(model, kit, outs[name])

    prompt = rc.Tokens(start=5).fresh(400)
    new = rc.Tokens(start=100_000).fresh(48)
    kit_a = model_kit(model, g.with_pools(swa_tokens=16384))
    hist = cone_turn(kit_a, prompt, 16, forward=rec(kit_a, "t1a")).history
    hit = cone_turn(kit_a, hist + new, 16, forward=rec(kit_a, "hit"))
    assert hit.plan is None and hit.F is None
    kit_b = model_kit(model, g, hicache=cache_kit.HiCache(ratio=0.5, write_policy="write_back"))
    cone_turn(kit_b, prompt, 16, forward=rec(kit_b, "t1b"))
    return model, kit_a, kit_b, hist, new, outs, lambda name: rec(kit_b, name), rc.Tokens(start=200_000)


def test_beside_hicache_a_cone_turn_is_bit_identical_to_a_prefix_hit():
    """The tiny model on the cache's own SWAKVPool: kit A (no HiCache, window kept) resumes with a
    prefix hit at F; kit B (HiCache write-back) loses the window on device and host and replays.
    Every row from F agrees bit for bit."""
    _, kit_a, kit_b, hist, new, outs, rec_b, toks = _hit_beside_a_hicache_kit()
    cone_turn(kit_b, hist + toks.fresh(32), 16, forward=rec_b("fork"))
    for _ in range(60):
        where = _window_state(kit_b, hist)
        if where["full_device"] and not where["swa_device"] and not where["swa_host"]:
            break
        # Traffic through the model, so the freed SWA pages are overwritten with other KV.
        cone_turn(kit_b, toks.fresh(256), 16, forward=rec_b("other"))
    cone = cone_turn(kit_b, hist + new, 16, forward=rec_b("cone"))
    assert cone.plan is not None and kit_b.loaded_from_host == 0
    F = cone.plan.F
    rows = sorted(r for r in outs["hit"] if r >= F)
    assert rows and all(torch.equal(outs["cone"][r], outs["hit"][r]) for r in rows)
    _sane(kit_a)
    _sane(kit_b)


@pytest.mark.parametrize("policy", POLICIES)
def test_beside_hicache_full_kv_on_host_is_loaded_back_full_only_and_the_cone_replays_n_tokens(policy, capfd):
    """A's Full KV up to F is on host only and its window on neither tier: stock resumes at B (0
    here) and re-prefills everything; the cone loads [D, F) back through HiCache (Full only; its
    load-back counters move, no SWA host slot is read) and recomputes N + the new tokens."""
    install(N)
    kit = cache_kit.build(cache_kit.SMALL, hicache=cache_kit.HiCache(ratio=0.5, write_policy=policy))
    toks = rc.Tokens()
    history = kit.run_turn(toks.fresh(400), out_len=16).history
    _lose_window_and_full_kv(kit, toks, history)
    h2d = dict(kit.cache.metrics_collector.h2d_tokens)
    new = toks.fresh(64)
    turn = cone_turn(kit, history + new, out_len=16)
    plan = turn.plan
    assert plan is not None, cone_replay.FALLBACKS
    F, L = plan.F, len(history) + len(new)
    assert plan.s == F - N and turn.prefix_len == plan.s and 0 < plan.load <= F
    assert turn.recomputed == N + (L - F) < L - plan.B  # stock + HiCache re-prefills [B, L)
    loaded = {k: v - h2d.get(k, 0) for k, v in kit.cache.metrics_collector.h2d_tokens.items() if v != h2d.get(k, 0)}
    assert loaded == {"kv": plan.load}, loaded  # one batch of Full copies, counted by HiCache; no SWA
    assert cone_replay.COUNTERS.loads == 1 and cone_replay.COUNTERS.loaded_tokens == plan.load
    assert turn.checks["cache_protected_len"] == F and turn.checks["window_holes"] == []
    assert turn.checks["row_is_tree_pages"] and turn.checks["leak_after_first_checkpoint"] == {"full": 0}
    _sane(kit)
    nxt = cone_turn(kit, turn.history + toks.fresh(32), out_len=16)  # a prefix hit: the window is back
    assert nxt.plan is None and nxt.prefix_len == len(turn.history) // kit.geometry.page * kit.geometry.page
    _sane(kit)
    err = capfd.readouterr().err
    assert re.search(r"cone_replay installed N=64 bound=\d+ .*host_full_kv=load_back", err), err  # the receipt says so
    assert re.search(rf"DSV41_SWA_CONE plan rid={turn.rid} F={F} s={plan.s} N={N} P=\d+ B={plan.B} load={plan.load}", err), err
    assert len(re.findall(rf"DSV41_SWA_CONE load rid={turn.rid} tokens={plan.load} D={F - plan.load} F={F}", err)) == 1, err
    assert cone_replay.FALLBACKS == {}


def _session_hicache_will_not_load_back() -> tuple[cache_kit.CacheKit, rc.Tokens, list[int]]:
    """The cone installed, a session's window and Full KV lost to host, HiCache's ``load_back_threshold``
    above any load: the session's next prompt, whose cone load-back HiCache refuses."""
    install(N)
    kit = cache_kit.build(cache_kit.SMALL, hicache=cache_kit.HiCache(ratio=0.5, write_policy="write_back"))
    toks = rc.Tokens()
    history = kit.run_turn(toks.fresh(400), out_len=16).history
    _lose_window_and_full_kv(kit, toks, history)
    kit.cache.load_back_threshold = 1 << 20
    return kit, toks, history + toks.fresh(64)


def test_beside_hicache_a_load_back_hicache_refuses_falls_back_to_stock_once_naming_why(capfd):
    """HiCache will not load fewer tokens than its ``load_back_threshold``: the cone's load-back
    comes back empty, the request runs stock (one fallback line, however often it is matched)."""
    kit, _, prompt = _session_hicache_will_not_load_back()
    turn = cone_turn(kit, prompt, out_len=16)
    # Stock + HiCache: its own load-back (whose SWA transfer the threshold does not stop) up to B < s.
    assert turn.plan is None and turn.F is not None and turn.prefix_len < turn.F - N
    assert turn.recomputed == len(prompt) - turn.prefix_len > N + len(prompt) - turn.F
    assert cone_replay.FALLBACKS == {"load_back_threshold": 1} and cone_replay.COUNTERS.loads == 0
    err = capfd.readouterr().err
    assert len(re.findall(rf"DSV41_SWA_CONE fallback rid={turn.rid} reason=load_back_threshold", err)) == 1, err
    _sane(kit)


def test_beside_hicache_the_rust_tree_core_falls_back_with_load_back_rust_core(capfd):
    """The Rust tree core builds its load-back spec in Rust (no per-component seam to leave the SWA
    transfer out): the cone names it and the turn runs stock."""
    install(N)
    kit = cache_kit.build(cache_kit.SMALL, backend="rust", hicache=cache_kit.HiCache(ratio=0.5, write_policy="write_back"))
    toks = rc.Tokens()
    history = kit.run_turn(toks.fresh(400), out_len=16).history
    kit.evict(full=1 << 20)
    for _ in range(40):
        kit.run_turn(toks.fresh(256), out_len=16)
        kit.evict(full=1 << 20)
        if "load_back_rust_core" in cone_replay.FALLBACKS:
            break
    turn = cone_turn(kit, history + toks.fresh(64), out_len=16)
    assert turn.plan is None and turn.prefix_len == turn.stock_prefix
    assert cone_replay.FALLBACKS == {"load_back_rust_core": 1}, cone_replay.FALLBACKS
    err = capfd.readouterr().err
    assert re.search(r"cone_replay installed N=64 .*host_full_kv=stock_rust_core", err), err
    assert re.search(rf"DSV41_SWA_CONE fallback rid={turn.rid} reason=load_back_rust_core", err), err


def test_beside_hicache_a_cone_with_full_kv_loaded_from_host_is_bit_identical_to_a_prefix_hit():
    """The tiny model on the cache's own SWAKVPool: kit A (no HiCache, everything kept) resumes
    with a prefix hit at F; kit B (HiCache write-back) has A's Full KV on host only and its window
    on neither tier, loads the Full KV back and replays. The loaded Full KV of [0, F) and every row
    from F (which reads the replayed window) agree with the hit's bit for bit."""
    model, kit_a, kit_b, hist, new, outs, rec_b, toks = _hit_beside_a_hicache_kit()
    # Traffic through the model, so the freed pages are overwritten with other KV.
    _lose_window_and_full_kv(kit_b, toks, hist, lambda tokens: cone_turn(kit_b, tokens, 16, forward=rec_b("other")))
    cone = cone_turn(kit_b, hist + new, 16, forward=rec_b("cone"))
    assert cone.plan is not None and cone.plan.load > 0, cone_replay.FALLBACKS
    F = cone.plan.F
    rows = sorted(r for r in outs["hit"] if r >= F)
    assert rows and all(torch.equal(outs["cone"][r], outs["hit"][r]) for r in rows)
    # The Full KV the two caches hold for [0, F) (loaded from host in B), slot by slot. The replayed
    # window is what every row >= F read in the three sliding-window layers (compared above).
    key = hist[:F]
    slots = {name: kit.cache.path_device_indices(kit.node_at(key))[:F].to(torch.int64)
             for name, kit in (("a", kit_a), ("b", kit_b))}
    assert all(len(v) == F for v in slots.values())
    for layer in model.full_layer_ids:
        for get in ("get_key_buffer", "get_value_buffer"):
            a = getattr(kit_a.allocator.get_kvcache(), get)(layer)[slots["a"]]
            b = getattr(kit_b.allocator.get_kvcache(), get)(layer)[slots["b"]]
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (layer, get)
    _sane(kit_a)
    _sane(kit_b)


def _uncapped_then_capped_adder(kit: cache_kit.CacheKit, cap: int, first: Any) -> Any:
    """A real ``PrefillAdder`` without chunking whose input cap refuses any request of ``cap`` input
    tokens or more once ``first`` (a short fresh request) is admitted: "allow the first request
    even above the input cap", not the second."""
    from sglang.srt.managers.schedule_policy import PrefillAdder

    adder = PrefillAdder(kit.geometry.page, kit.cache, kit.allocator, running_batch=None, new_token_ratio=0.0,
                         rem_input_tokens=cap, rem_chunk_tokens=None)
    first.init_next_round_input(kit.cache)
    adder.add_one_req(first, has_chunked_req=False, truncation_align_size=None)
    assert adder.can_run_list == [first]
    return adder


def test_a_request_whose_cone_load_back_fell_back_runs_stock_when_matched_again_and_names_why_once(capfd):
    """A request left waiting is matched again on every scheduler pass. Once its cone load-back fell
    back (HiCache's ``load_back_threshold`` here), the request runs stock from then on: no second
    plan, no second load-back try, one fallback line, however often it is matched."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    kit, toks, prompt = _session_hicache_will_not_load_back()

    def req(rid: str, tokens: list[int]) -> Any:
        r = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", tokens),
                sampling_params=SamplingParams(temperature=0, max_new_tokens=17))
        kit.pool.alloc([r])
        return r

    waiting = req("waiting", prompt)
    waiting.init_next_round_input(kit.cache)  # pass 1: the cone plans a load of [D, F)
    plan = getattr(waiting, cone_replay.REQ_ATTR)
    assert plan is not None and plan.load > 0, cone_replay.FALLBACKS
    # The cone's pass [s, L) fits under the cap, the stock pass [B, L) does not: once the cone falls
    # back, the stock selection leaves the request waiting.
    cap = len(prompt) - plan.B
    assert len(prompt) - plan.s < cap
    firsts = []
    for pass_no in range(3):
        firsts.append(req(f"first{pass_no}", toks.fresh(16)))
        adder = _uncapped_then_capped_adder(kit, cap, firsts[-1])
        if pass_no:
            waiting.init_next_round_input(kit.cache)  # matched again, as the scheduler does each pass
            assert getattr(waiting, cone_replay.REQ_ATTR, None) is None  # stock: no plan
        adder.add_one_req(waiting, has_chunked_req=False, truncation_align_size=None)
        assert adder.can_run_list == [firsts[-1]]  # still waiting
        assert cone_replay.FALLBACKS == {"load_back_threshold": 1}, (pass_no, cone_replay.FALLBACKS)
        assert cone_replay.COUNTERS.plans == 1 and cone_replay.COUNTERS.loads == 0
        kit.cache.unlock(firsts[-1].lock)
        kit.pool.free(firsts[-1])
    err = capfd.readouterr().err
    assert len(re.findall(rf"DSV41_SWA_CONE fallback rid={waiting.rid} reason=load_back_threshold", err)) == 1, err
    assert len(re.findall(rf"DSV41_SWA_CONE plan rid={waiting.rid} ", err)) == 1, err
    kit.pool.free(waiting)
    _sane(kit)


LOAD_VERDICTS = [
    # (what init_load_back left: loaded, F's node on device, spec tokens seen, threshold) -> verdict
    pytest.param(48, True, 48, 1, None, id="the_planned_load"),
    pytest.param(80, True, 80, 1, None, id="more_than_planned_goes_on"),
    pytest.param(16, True, 16, 1, None, id="fewer_than_planned_goes_on"),
    pytest.param(0, True, 0, 1, None, id="another_load_brought_F_back"),
    pytest.param(32, False, 48, 1, "load_back_partial", id="pages_committed_but_not_F"),
    pytest.param(0, False, None, 1, "load_back_pinned", id="spec_never_built"),
    pytest.param(0, False, 0, 1, "load_back_pinned", id="empty_spec"),
    pytest.param(0, False, 48, 64, "load_back_threshold", id="under_threshold"),
    pytest.param(0, False, 48, 0, "load_back_refused", id="no_room"),
]


@pytest.mark.parametrize("loaded, anchor_on_device, spec_tokens, threshold, verdict", LOAD_VERDICTS)
def test_the_cone_goes_on_whenever_f_is_on_device_after_its_load_back_and_never_raises(
        loaded, anchor_on_device, spec_tokens, threshold, verdict):
    """Stock raises ``RuntimeError`` on ``0 < loaded < promised``; the cone needs F's node on device,
    not a count: it goes on with what it got, and a load that committed pages short of F is a
    fallback (``load_back_partial``), never an exception on the scheduler thread."""
    from adapter.switches.cone_replay.hicache import load_verdict

    assert load_verdict(loaded, anchor_on_device, spec_tokens, threshold) == verdict
