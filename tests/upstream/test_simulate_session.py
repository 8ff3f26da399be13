"""``simulate``'s ``session`` and ``thin+session`` policies: SGLang's session radix cache
(``--enable-session-radix-cache``, ``UnifiedSessionRefTracker``) on the real cache, alone and beside
SWA thin. Each does its part: the session reference keeps an idle session's resume point that thin
never demotes anything for (one-pass strangers), thin keeps an unreferenced prefix that the session
tag does not cover (a closed session's, reached by another client). Page 16, window 8, chunk 128,
a 768-slot SWA pool."""

from __future__ import annotations

import json

from devkit.testkit.simulate_fleet import replay, small_fleet
from overlay_tools.simulate import engine, fleet, trace

BOTH = ("stock", "thin", "session", "thin+session")


def _trace(tmp_path, rows, session_key=None) -> list[trace.Request]:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out,
                                        "hash_ids": ids, **({"conv": conv} if conv is not None else {})}) + "\n"
                            for ts, n_in, n_out, ids, conv in rows))
    return trace.load(str(path), 16, session_key=session_key)


def test_an_idle_sessions_resume_point_outlives_one_pass_strangers_under_the_session_radix_cache(tmp_path):
    """A's first turn (512 tokens) goes idle while 24 one-pass strangers of 64 tokens fill the SWA
    pool; A's next turn comes late. Strangers leave only leaves (nothing passed: thin moves nothing),
    so stock and thin lose A's resume point alike; A's session is open (its next turn is to come), so
    the session radix cache holds A's leaf in the referenced partition, evicted after every closed
    stranger: session and thin+session resume at 512."""
    rows = ([(0, 512, 16, [1], None)] + [(5_000 + i, 64, 16, [1000 + i], None) for i in range(24)]
            + [(100_000, 1024, 16, [1, 2], None)])
    requests = _trace(tmp_path, rows)
    last = {policy: replay(policy, requests)[0][-1] for policy in BOTH}
    assert all(t.continuation and t.resume_at == 512 for t in last.values())
    assert last["stock"].stock_prefix < 512 and last["thin"].stock_prefix < 512
    assert last["session"].stock_prefix == last["thin+session"].stock_prefix == 512


def test_a_closed_sessions_prefix_outlives_a_chunked_requests_passed_checkpoints_only_with_thin(tmp_path):
    """Client a's one-turn session (512 tokens) is closed when it finishes; a 4,096-token request
    runs in 32 chunks; client b (another session id) then sends a's 512 tokens plus its own. a's
    prefix is unreferenced (closed: the session tag no longer covers it), so the session radix cache
    evicts it with the chunked request's checkpoints in LRU order, as stock does; thin moves those
    passed checkpoints to the evict-first end, alone and beside the session radix cache, and b
    matches a's 512 tokens."""
    rows = [(0, 512, 16, [1], "a"), (5_000, 4096, 16, list(range(100, 108)), "x"), (100_000, 1024, 16, [1, 2], "b")]
    requests = _trace(tmp_path, rows, session_key="conv")
    last = {policy: replay(policy, requests)[0][-1] for policy in BOTH}
    assert not last["stock"].continuation
    assert last["stock"].stock_prefix == last["session"].stock_prefix == 0
    assert last["thin"].stock_prefix == last["thin+session"].stock_prefix == 512


def test_every_session_is_tagged_and_closed_once_its_last_turn_has_finished(tmp_path):
    """Under thin+session: two sessions of two turns and a stranger. While A is idle its leaf is
    session-referenced (Full and SWA); after the replay every session is closed (``release_radix_session``):
    no component indexes a session leaf, no node keeps a session reference, and the tree passes
    SGLang's sanity check and the leak check."""
    rows = [(0, 512, 16, [1], None), (1, 512, 16, [2], None), (2, 64, 16, [9], None),
            (50_000, 1024, 16, [1, 3], None), (60_000, 1024, 16, [2, 4], None)]
    requests = _trace(tmp_path, rows)
    kit = fleet.build_kit("thin+session", small_fleet(), max_ctx=2048)
    seen: list[int] = []
    try:
        from adapter import cost_model

        replay_ = engine.Replay(kit, requests, chunk=128, max_running=8, coef=cost_model.DEFAULTS,
                                progress=lambda n: seen.append(_referenced(kit)))
        replay_.run()
        kit.cache.sanity_check()
        assert kit.leak_check() == {"full": 0, "swa": 0}
    finally:
        fleet.uninstall()
    assert kit.cache.enable_session_radix_cache and kit.is_python_core()
    assert max(seen) > 0  # while a session was open, its leaf was referenced
    assert replay_.closed_sessions == 3 and _referenced(kit) == 0
    assert all(not c._session_leaves for c in kit.cache.session_refs.components)


def _referenced(kit) -> int:
    """Nodes with a session reference in any component."""
    count, stack = 0, [kit.core.root_node]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        count += any(d is not None and d.session_ref > 0 for d in node.component_data)
    return count
