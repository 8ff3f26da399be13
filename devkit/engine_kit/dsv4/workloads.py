"""Seeded workloads for switch checks on the DSV4 kit server (page 256, window 128, chunk 256).

Each function drives a running :class:`devkit.engine_kit.launcher.Server` and returns plain data
(greedy output ids, SGLang's ``cached_tokens``, retraction counts) so boots of different profiles
can be compared on the same prompts. Prompt ids come from :func:`ids` (seeded, no specials).

* :func:`resume_after_churn`: an idle session (``SESSION`` tokens, one turn) then ``CHURN`` other
  requests of ``CHURN_TOKENS`` (4 chunks each), then the session resumes. With 8 SWA pages (the
  :data:`SWA_GEOMETRY`) stock evicts the session's resume point; SWA thin keeps it.
* :func:`yield_phase`: two streams decode while a ``LONG``-token prompt prefills in 256-token
  chunks (the scheduler log then says how many decode steps ran between chunks).
* :func:`crowd`: three 480-token prompts decoding 64 tokens each (a 2048-token pool retracts one;
  so do the 8 SWA pages of :data:`SWA_GEOMETRY`; :data:`ROOMY_POOL` retracts none).
"""

from __future__ import annotations

import random
from typing import Any

from devkit.engine_kit import client

# 16384 Full tokens, 8 SWA pages (the smallest check_pages accepts for 3 running requests).
SWA_GEOMETRY = {"max_total_tokens": 16384, "max_running": 3, "chunk": 256, "swa_ratio": 0.125}
# The retraction pool of tests/engine/test_dsv4_server.py: 8 pages for 3 x (480 + 64) tokens.
SMALL_POOL = {"max_total_tokens": 2048, "max_running": 3, "chunk": 256, "swa_ratio": 1.0}
# The crowd without retraction: 64 Full pages and as many SWA pages.
ROOMY_POOL = {"max_total_tokens": 16384, "max_running": 3, "chunk": 256, "swa_ratio": 1.0}
SESSION = 768  # three chunks: its resume point is the 768-token page boundary
CHURN = 2  # stock loses the resume point after 2 (measured in-process on the real DSV4 pool); thin after 3
CHURN_TOKENS = 1024  # four chunks: its checkpoints at 256 and 512 are passed (thin demotes them)
TURN = 8
LONG = 1024  # four chunks: three gaps between consecutive chunks
STREAMS = 2


def ids(tag: str, n: int) -> list[int]:
    rng = random.Random(f"dsv4:{tag}")
    return [rng.randrange(6, 1024) for _ in range(n)]  # ids below 6 are the kit tokenizer's specials


def resume_after_churn(url: str) -> dict[str, Any]:
    client.flush_cache(url)
    session = ids("session", SESSION)
    first = client.generate(url, session, TURN)
    out: dict[str, Any] = {"session_turn1": first["output_ids"]}
    for i in range(CHURN):
        out[f"churn{i}"] = client.generate(url, ids(f"churn{i}", CHURN_TOKENS), 4)["output_ids"]
    resume = client.generate(url, session + first["output_ids"] + ids("user2", 24), TURN)
    out["session_turn2"] = resume["output_ids"]
    return {"outputs": out, "resume_cached_tokens": int(resume["meta_info"]["cached_tokens"])}


def yield_phase(url: str, stream_tokens: int = 1200) -> dict[str, Any]:
    client.flush_cache(url)
    streams = [client.Stream(url, f"yield-s{i}", ids(f"stream{i}", 32), stream_tokens, 600).start()
               for i in range(STREAMS)]
    try:
        client.wait_until(lambda: all(s.tokens >= 4 or s.error for s in streams), 600, "streams to decode")
        long = client.Stream(url, "yield-long", ids("long", LONG), 8, 600).start()
        client.wait_until(lambda: long.tokens >= 1 or long.error, 600, "the long prompt's first token")
        long.join(600)
        running = [s.tokens < stream_tokens for s in streams]
    finally:
        client.stop_streams(url, streams)
    if long.error:
        raise RuntimeError(f"long prompt failed: {long.error}")
    return {"long": long.output_ids, "streams": [s.output_ids for s in streams], "streams_ran_through": all(running)}


def crowd(url: str) -> list[dict[str, Any]]:
    client.flush_cache(url)
    # one batched call: the three arrive in one scheduler pass on every boot (client.generate_batch)
    return client.generate_batch(url, [ids(f"crowd{i}", 480) for i in range(3)], 64, 600)
