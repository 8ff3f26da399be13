"""``python -m adapter bench cone-replay-dsv4 [--quick]``: a resumed DeepSeek-V4 session whose SWA window
was evicted, side by side in one boot of the DSV4 kit server (real ``DeepSeekV4TokenToKVPool``,
``DeepseekV4AttnBackend``, ``UnifiedRadixCache``; seeded tiny C0/C4/C128 checkpoint; CPU).

Workload (:mod:`devkit.testkit.dsv4_cone`): turn 1 = 2,048 tokens (F), churn evicts its SWA window
(Full KV stays), turn 2 = the same 2,048 + 512 new tokens, one output token. Rows: the stock prefix
hit at F before churn (the exactness reference), the stock full re-prefill (empty tree), stock after
churn, and cone replay at N = the bound (768). Per row: history tokens recomputed
(``len(A) - cached_tokens``; the prefix hit's turn 1 stopped at F, so it shows one page), time to
first token (one-token request, end to end; on a shared CPU machine it is dominated by load: the
same full re-prefill measured 13.7-91 s across runs, so it is printed, not judged), and the
largest input-logprob distance of rows >= F from the full re-prefill and from the prefix hit.

Upstream's bounded replays do not run on this engine, and the bench says why instead of a row:
``--enable-encoder-swa-bounded-replay`` requires DeepSeek-V4.1 and CUDA or gfx950
(``validate_deepseek_v41_features``); ``--enable-decoder-swa-bounded-replay`` resolves on only on
CUDA/HIP and needs a V4.1 KV-source layout (``config.kv_source_layer_ids``, asserted by the model),
which the kit's V4 model does not have.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

UPSTREAM = {
    "encoder_bounded_replay": "not run: --enable-encoder-swa-bounded-replay requires DeepSeek-V4.1 on CUDA or gfx950 "
                              "(validate_deepseek_v41_features); the kit is V4 on CPU",
    "decoder_bounded_replay": "not run: --enable-decoder-swa-bounded-replay resolves on only on CUDA/HIP and the model "
                              "asserts config.kv_source_layer_ids (a V4.1 KV-source layout the kit's V4 model lacks)",
}


def run(quick: bool = False) -> dict[str, Any]:
    from devkit.testkit import dsv4_cone as dc

    phases = ("hit", "cold", "stock", "cone") if quick else ("hit", "cold", "stock", "cone", "short")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cone_dsv4_") as tmp:
        out = dc.run(Path(tmp), phases=phases)
    wall = time.perf_counter() - start
    rows = {}
    print(f"cone replay on the DSV4 kit server (CPU, page {dc.PAGE}, window {dc.WINDOW}, N {dc.N} = bound, "
          f"chunk {dc.GEOMETRY['chunk']}); F {dc.F}, +{dc.B_LEN} new tokens; boot {out['startup_s']} s")
    print(f"{'row':>8} {'cached':>6} {'recomputed':>10} {'TTFT s':>7} {'|dlogp| vs re-prefill':>22} {'vs hit':>8}")
    for name in phases:
        p = out[name]
        rows[name] = {
            "cached_tokens": p["cached_tokens"],
            "recomputed": dc.A_LEN - p["cached_tokens"],  # history tokens (turn 1's prompt) prefilled again
            "ttft_s": p["ttft_s"],
            "logprob_vs_reprefill": dc.logprob_distance(p, out["cold"]),
            "logprob_vs_hit": dc.logprob_distance(p, out["hit"]),
        }
        r = rows[name]
        print(f"{name:>8} {r['cached_tokens']:>6} {r['recomputed']:>10} {r['ttft_s']:>7.2f} "
              f"{r['logprob_vs_reprefill']:>22.3g} {r['logprob_vs_hit']:>8.3g}")
    for name, why in UPSTREAM.items():
        print(f"{name}: {why}")
    log = "\n".join(out.get("log", []))
    fig = {
        "N": dc.N,
        "F": dc.F,
        "rows": rows,
        "upstream": UPSTREAM,
        "fallbacks": log.count("DSV41_SWA_CONE fallback"),
        "cone_recomputed": rows["cone"]["recomputed"],
        "stock_recomputed": rows["stock"]["recomputed"],
        "meets_targets": rows["cone"]["recomputed"] <= dc.N + dc.PAGE and rows["cone"]["logprob_vs_hit"] == 0.0
        and rows["cone"]["logprob_vs_reprefill"] <= dc.LOGPROB_TOLERANCE,
        "wall_s": round(wall, 1),
    }
    print(f"cone recomputed {fig['cone_recomputed']} <= N + page {dc.N + dc.PAGE}; stock {fig['stock_recomputed']}; "
          f"wall {wall:.0f} s")
    return fig
