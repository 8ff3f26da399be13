"""``python -m adapter bench cone-replay [--quick]``: tokens recomputed when a resume point's SWA
window is gone, stock vs cone replay, on the real ``UnifiedRadixCache`` at DeepSeek-V4 geometry.

Geometry: page 256, SWA window 128, chunked prefill 8192, ``DSV41_SWA_CONE_TOKENS`` = 8192, a
64-page SWA pool (so other traffic evicts an idle session's window quickly) and a 4M-token Full
pool. For each session length (130K-1M tokens) two caches run side by side, interleaved turn by
turn: one built before the switch was installed (stock), one after (cone). In each, the session
runs a turn, 16K-token traffic runs until the session's resume point has lost its window while its
Full KV stays, and the session's next turn (+1024 tokens) is matched, admitted (the switch's rule),
copied (the switch's copy on the real pool) and checkpointed on the real tree.

"Recomputed" counts the session's history tokens that are prefilled again (the new tokens of the
turn are not counted): stock ``len(history) - P``, cone ``len(history) - s`` = N plus the part of
the history past F (the SWA-evicted last leaf takes its Full page along, so at most a page).

Time to first token is modelled with the decode-yield cost model (``adapter.cost_model``,
``chunk_cost`` summed over the turn's 8192-token chunks, DEFAULTS coefficients: placeholders, not a
fleet measurement); nothing is timed. A last row repeats the shortest session with a 4096-token
chunk, below N, to show the logged fallback.
"""

from __future__ import annotations

import time
from typing import Any

PAGE, WINDOW, CHUNK, N = 256, 128, 8192, 8192
NEW_TOKENS, OUT_TOKENS, TRAFFIC = 1024, 256, 16384
LENGTHS_QUICK = (131072, 524288, 1048576)
LENGTHS_FULL = (131072, 196608, 262144, 393216, 524288, 786432, 1048576)


def _ttft_fs(prefix: int, end: int, chunk: int) -> int:
    from adapter import cost_model

    total, pos = 0, prefix
    while pos < end:
        c = min(chunk, end - pos)
        total += cost_model.chunk_cost([(c, pos)])
        pos += c
    return total


def _session(kit: Any, toks: Any, length: int, chunk: int) -> dict[str, Any]:
    from devkit.testkit.cone import cone_turn

    history = kit.run_turn(toks.fresh(length), out_len=OUT_TOKENS).history
    traffic = 0
    while not kit.resume_state(history)["lost"]:
        kit.run_turn(toks.fresh(TRAFFIC), out_len=OUT_TOKENS)
        traffic += 1
    turn = cone_turn(kit, history + toks.fresh(NEW_TOKENS), out_len=OUT_TOKENS, chunk=chunk)
    prompt = len(history) + NEW_TOKENS
    leak = kit.leak_check()
    return {
        "P": turn.stock_prefix, "F": turn.F, "prefix": turn.prefix_len,
        # history tokens (computed once already) prefilled again; the new tokens are not counted
        "recomputed": len(history) - turn.prefix_len,
        "replayed": (turn.plan.F - turn.plan.s) if turn.plan is not None else 0,
        "ttft_fs": _ttft_fs(turn.prefix_len, prompt, chunk), "traffic_turns": traffic,
        "cone": turn.plan is not None, "leak": leak["full"] + leak["swa"],
    }


def run(quick: bool = False, backend: str = "rust") -> dict[str, Any]:
    from adapter.core import boot
    from devkit.testkit import cone_replay_parts as cone_replay
    from devkit.testkit import radix_cache as rc
    from overlay_tools.simulate import cache_kit
    from overlay_tools.simulate.cone_turn import install

    geometry = cache_kit.Geometry(page=PAGE, window=WINDOW, chunk=CHUNK, full_tokens=4 * 1024 * 1024,
                           swa_tokens=64 * PAGE, max_reqs=8, max_ctx=(1 << 20) + 4 * CHUNK)
    lengths = LENGTHS_QUICK if quick else LENGTHS_FULL
    boot.uninstall()
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    try:
        for length in [*lengths, lengths[0]]:
            chunk = CHUNK if len(rows) < len(lengths) else CHUNK // 2
            boot.uninstall()
            stock_kit = cache_kit.build(geometry, backend=backend)  # built before the switch: stock
            state = install(N)
            assert state.outcomes["cone_replay"].status == "armed", state.outcomes["cone_replay"]
            cone_kit = cache_kit.build(geometry, backend=backend)
            cone_replay.reset_counters()
            stock = _session(stock_kit, rc.Tokens(), length, chunk)
            cone = _session(cone_kit, rc.Tokens(), length, chunk)
            rows.append({"length": length, "chunk": chunk, "stock": stock, "cone": cone,
                         "fallbacks": dict(cone_replay.FALLBACKS)})
            del stock_kit, cone_kit
    finally:
        boot.uninstall()
    wall = time.perf_counter() - start

    head = (f"{'session':>9} {'chunk':>5} {'F':>8} {'stock P':>8} {'cone s':>8} {'stock recomp':>12} "
            f"{'cone recomp':>11} {'replayed':>8} {'TTFT stock':>10} {'TTFT cone':>9} {'x':>6}  fallbacks")
    from devkit.testkit.cone_replay_parts import cone_bound, cone_bound_dsv4

    print(f"cone replay, DSV4 geometry (page {PAGE}, window {WINDOW}, N {N}; bound with 43 / 61 SWA layers: "
          f"{cone_bound(WINDOW, PAGE, 43)} / {cone_bound(WINDOW, PAGE, 61)}; on a DeepSeek-V4 pool, 61 layers, "
          f"last layer C128 / C4: {cone_bound_dsv4(WINDOW, PAGE, 61, ratios=[4] * 60 + [128])} / "
          f"{cone_bound_dsv4(WINDOW, PAGE, 61, ratios=[128] * 60 + [4])}), {backend} tree core; "
          f"recomputed = history tokens prefilled again (+{NEW_TOKENS} new tokens each); "
          f"TTFT modelled (cost_model DEFAULTS, placeholders)")
    print(head)
    for r in rows:
        s, c = r["stock"], r["cone"]
        print(f"{r['length']:>9} {r['chunk']:>5} {c['F'] or 0:>8} {s['prefix']:>8} {c['prefix']:>8} "
              f"{s['recomputed']:>12} {c['recomputed']:>11} {c['replayed']:>8} {s['ttft_fs'] / 1e15:>9.2f}s "
              f"{c['ttft_fs'] / 1e15:>8.2f}s {s['ttft_fs'] / c['ttft_fs']:>6.1f}  {r['fallbacks'] or '-'}")
    main = [r for r in rows if r["chunk"] == CHUNK]
    fig = {
        "backend": backend,
        "N": N,
        "page": PAGE,
        "sessions": [r["length"] for r in main],
        "max_recompute_tokens": max(r["cone"]["recomputed"] for r in main),
        "max_replay_tokens": max(r["cone"]["replayed"] for r in main),
        "stock_recompute_tokens": max(r["stock"]["recomputed"] for r in main),
        "stock_recompute_tokens_total": sum(r["stock"]["recomputed"] for r in main),
        "cone_recompute_tokens_total": sum(r["cone"]["recomputed"] for r in main),
        "fallbacks": sum(sum(r["fallbacks"].values()) for r in main),
        "fallbacks_at_chunk_4096": rows[-1]["fallbacks"],
        "ttft_stock_s_max": round(max(r["stock"]["ttft_fs"] for r in main) / 1e15, 2),
        "ttft_cone_s_max": round(max(r["cone"]["ttft_fs"] for r in main) / 1e15, 2),
        "leaked_slots": sum(r["stock"]["leak"] + r["cone"]["leak"] for r in rows),
        "target_max_recompute_tokens": N + PAGE,
        "meets_targets": all(r["cone"]["recomputed"] <= N + PAGE for r in main)
        and all(r["cone"]["cone"] for r in main) and not any(r["fallbacks"] for r in main),
        "wall_s": round(wall, 1),
    }
    print(f"max recomputed {fig['max_recompute_tokens']} <= N + page {N + PAGE}; fallbacks at chunk {CHUNK}: "
          f"{fig['fallbacks']}; wall {wall:.1f}s")
    return fig
