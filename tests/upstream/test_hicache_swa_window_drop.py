"""Where HiCache drops an SWA window a later resume needs, on the real ``UnifiedRadixCache`` with
HiCache attached (``init_hicache``: SGLang's host pools, controller and transfers on the engine
kit's CPU routes), under each write policy; and what upstream PR #40712's demotion would give.

The case (``devkit/testkit/swa_host_demote.py``): an internal node whose Full KV is on host and whose
SWA window is on device only. SGLang 0.5.23 backs an internal window up before its SWA tombstone
only under write-back and only while the node's Full KV is not on host, so this window is dropped
on both tiers while the Full KV stays on device, and a request resuming at the node's boundary
matches short of it. A node gets there after its SWA host copy was evicted for host room and a
request recomputed through it (the window republished on device only): at steady state, with the
host tier full, under write-back and under write-through (the datacenter profile's policy) alike.
"""

from __future__ import annotations

import random

import pytest
import torch

from devkit.testkit import radix_cache as rc
from devkit.testkit import swa_host_demote as demote
from overlay_tools.simulate import cache_kit

POLICIES = ["write_back", "write_through", "write_through_selective"]
PAGE, OUT = 16, 16
GEOMETRY = cache_kit.Geometry(PAGE, 8, 128, full_tokens=1 << 14, swa_tokens=1024, max_reqs=8, max_ctx=1 << 16)
SWA_LAYER = 0  # the kit's SWAKVPool: layer 0 is the sliding-window layer


def _node_at(kit: cache_kit.CacheKit, tokens: list[int]):
    """The node that ends exactly at ``len(tokens)`` (python core)."""
    node, off = kit.core.root_node, 0
    while off < len(tokens):
        head = tuple(tokens[off : off + PAGE])
        node = next(c for c in node.children.values() if tuple(c.key.token_ids[:PAGE]) == head)
        off += len(node.key)
    assert off == len(tokens), (off, len(tokens))
    return node


def _tiers(node) -> dict[str, bool]:
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    full, swa = node.component_data[ComponentType.FULL], node.component_data[ComponentType.SWA]
    return {"full_device": full.value is not None, "full_host": full.host_value is not None,
            "swa_device": swa.value is not None, "swa_host": swa.host_value is not None}


def _swa_rows(kit: cache_kit.CacheKit, node) -> tuple[torch.Tensor, torch.Tensor]:
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    kv, idx = kit.allocator.get_kvcache(), node.component_data[ComponentType.SWA].value
    return kv.get_key_buffer(SWA_LAYER)[idx].clone(), kv.get_value_buffer(SWA_LAYER)[idx].clone()


def _fill_swa_pool(kit: cache_kit.CacheKit) -> None:
    """Distinct rows in every SWA slot: what the next forward would write (the kit runs none)."""
    kv, gen = kit.allocator.get_kvcache(), torch.Generator().manual_seed(5)
    for buf in (kv.get_key_buffer(SWA_LAYER), kv.get_value_buffer(SWA_LAYER)):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))


def _republish_under_host_held_full(kit: cache_kit.CacheKit, toks: rc.Tokens) -> list[int]:
    """A session's resume point H becomes an inner node (a retried turn), churn moves its window to
    host and host pressure frees that copy (Full KV stays on device and host), then a second retry
    recomputes through H and republishes the window on device only. Returns H."""
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    history = kit.run_turn(toks.fresh(256), OUT).history
    kit.run_turn(history + toks.fresh(32), OUT)
    kit.evict(swa=GEOMETRY.swa_tokens)
    kit.cache.evict_host(4 * GEOMETRY.swa_tokens, ComponentType.SWA)  # host room taken for other windows
    assert not _tiers(_node_at(kit, history))["swa_host"]
    _fill_swa_pool(kit)
    kit.run_turn(history + toks.fresh(32), OUT)
    return history


def _still_lost(kit: cache_kit.CacheKit, window: demote.DroppedWindow) -> bool:
    """The node is still there with its Full KV on device, and its window on neither tier."""
    return kit.node_at(window.tokens) == window.node_id and not any(
        _tiers(_node_at(kit, window.tokens))[t] for t in ("swa_device", "swa_host"))


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_a_republished_window_under_host_held_full_kv_is_dropped_on_both_tiers_and_a_resume_there_matches_short(policy):
    """Stock 0.5.23. Write-back: the window at H is on device only while H's Full KV is on host, so
    the SWA walk tombstones it without a backup; a third retry from H keeps nothing of H's context.
    Write-through backed H's window up at insert, but each chunk checkpoint of the second retry
    (128, 256) republished the two pages before it and backed up only the target's (within one
    window of it): the windows ending at 112 and 240 are dropped, and a request branching at 112
    matches short of it."""
    kit = cache_kit.build(GEOMETRY, hicache=cache_kit.HiCache(ratio=2.0, write_policy=policy))
    toks = rc.Tokens()
    history = _republish_under_host_held_full(kit, toks)
    h_tiers = _tiers(_node_at(kit, history))
    assert h_tiers == {"full_device": True, "full_host": True, "swa_device": True,
                       "swa_host": policy != "write_back"}
    with demote.record_dropped_windows() as dropped:
        kit.evict(swa=GEOMETRY.swa_tokens)
    lost = [w for w in dropped.with_full_on_host if _still_lost(kit, w)]
    assert lost, policy
    if policy == "write_back":
        node = _node_at(kit, history)
        assert node.id in {w.node_id for w in lost}
        req = kit.admit(history + toks.fresh(32))
        assert kit.node_at(history) == node.id  # the Full KV up to H is on device
        assert req.prefix_len == 0 < len(history)
    else:
        assert [len(w.tokens) for w in lost] == [112, 240]
        req = kit.admit(lost[0].tokens + toks.fresh(32))
        assert req.prefix_len < len(lost[0].tokens)
    kit.cache.sanity_check()


@pytest.mark.parametrize("policy", POLICIES)
def test_with_pr_40712s_demotion_the_retry_resumes_at_h_with_the_device_windows_bytes(policy):
    """The same sequence with the window backed up before its tombstone: the retry's match reaches
    H (what a device hit gives: page_floor(len(H))), the load-back restores the window, and its
    rows are byte-identical to what the device held (the freed slots are scrubbed in between, so
    the bytes come from host). Write-through backs H's republished window up at insert in this
    sequence, so there H resumes without the demotion too (it closes the windows at 112 and 240)."""
    kit = cache_kit.build(GEOMETRY, hicache=cache_kit.HiCache(ratio=2.0, write_policy=policy))
    toks = rc.Tokens()
    history = _republish_under_host_held_full(kit, toks)
    node = _node_at(kit, history)
    kv = kit.allocator.get_kvcache()
    assert _tiers(node)["swa_device"]
    device_rows = _swa_rows(kit, node)
    with demote.demote_host_backed_windows() as stats, demote.record_dropped_windows() as dropped:
        kit.evict(swa=GEOMETRY.swa_tokens)
    assert dropped.with_full_on_host == []
    assert stats.failed == 0 and (stats.demoted > 0 or policy != "write_back")
    assert _tiers(node) == {"full_device": True, "full_host": True, "swa_device": False, "swa_host": True}
    kv.get_key_buffer(SWA_LAYER).zero_()
    kv.get_value_buffer(SWA_LAYER).zero_()
    req = kit.admit(history + toks.fresh(32))
    assert req.prefix_len == len(history) // PAGE * PAGE == len(history)
    restored = _swa_rows(kit, _node_at(kit, history))
    assert torch.equal(restored[0], device_rows[0]) and torch.equal(restored[1], device_rows[1])
    kit.cache.sanity_check()


def _mixed_traffic(kit: cache_kit.CacheKit, units: int, seed: int = 1) -> None:
    """New sessions on a shared 256-token system prompt, next turns, and retries of a session's last
    turn (its resume point becomes an inner node)."""
    rng, toks = random.Random(seed), rc.Tokens()
    system, sessions = toks.fresh(256), []
    for _ in range(units):
        r = rng.random()
        if r < 0.4 or not sessions:
            sessions.append(kit.run_turn(system + toks.fresh(rng.randint(4, 20) * PAGE), OUT).history)
        else:
            i = rng.randrange(len(sessions))
            turn = kit.run_turn(sessions[i] + toks.fresh(rng.randint(1, 6) * PAGE), OUT)
            if r < 0.7:
                sessions[i] = turn.history


STEADY = GEOMETRY.with_pools(full_tokens=1 << 16, swa_tokens=512)  # the SWA host tier fills within the run


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_at_steady_state_write_back_and_write_through_drop_windows_whose_full_kv_is_on_host(policy):
    """With the host tier full, write-back and write-through (the datacenter profile's policy) drop
    inner windows whose Full KV is on host; a resume at such a boundary whose Full KV is still on
    device matches short of it. With the demotion none is dropped."""
    kit = cache_kit.build(STEADY, hicache=cache_kit.HiCache(ratio=2.0, write_policy=policy))
    with demote.record_dropped_windows() as dropped:
        _mixed_traffic(kit, units=80)
    assert dropped.with_full_on_host, policy
    lost = [w for w in dropped.with_full_on_host if _still_lost(kit, w)]
    assert lost, policy
    req = kit.admit(lost[-1].tokens + rc.Tokens(start=9_000_000).fresh(PAGE))
    assert req.prefix_len < len(lost[-1].tokens)
    kit.cache.sanity_check()

    twin = cache_kit.build(STEADY, hicache=cache_kit.HiCache(ratio=2.0, write_policy=policy))
    with demote.demote_host_backed_windows() as stats, demote.record_dropped_windows() as dropped_twin:
        _mixed_traffic(twin, units=80)
    assert dropped_twin.with_full_on_host == [] and stats.demoted > 0
    twin.cache.sanity_check()
    assert twin.leak_check() == {"full": 0, "swa": 0}


def test_at_steady_state_write_through_selective_drops_only_windows_whose_full_kv_was_never_written():
    """Selective writes a node to host only once it is hit twice: on the same traffic it drops inner
    windows of nodes it never wrote (its design, as without HiCache), none whose Full KV is on host."""
    kit = cache_kit.build(STEADY, hicache=cache_kit.HiCache(ratio=2.0, write_policy="write_through_selective"))
    with demote.record_dropped_windows() as dropped:
        _mixed_traffic(kit, units=80)
    assert dropped.windows and dropped.with_full_on_host == []


def test_the_demotion_experiment_refuses_when_an_upstream_function_it_relies_on_has_drifted(monkeypatch):
    target = next(iter(demote.PINS))
    monkeypatch.setitem(demote.PINS, target, "0" * 64)
    with pytest.raises(demote.ExperimentDrifted, match=target.rpartition(":")[2]), demote.demote_host_backed_windows():
        pass
