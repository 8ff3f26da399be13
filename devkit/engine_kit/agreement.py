"""One concurrent workload on a kit server and through ``simulate``'s replay, request by request.

A workload is waves of requests (:class:`Ask`). A wave's requests reach the server as one batched
``/generate`` call: SGLang's tokenizer manager hands a token-id batch to the scheduler as one
message, so they join the waiting queue in one pass, in order, on every boot, and run together
(chunked prefill, several rows decoding, retraction when the pool runs out). The next wave is sent
when the whole wave has answered. In the replay a wave's requests share one arrival time and the
waves are :data:`WAVE_MS` apart, so each wave starts on an idle instance there too (checked).

Requests are sent with ``min_new_tokens = max_new_tokens`` instead of ``ignore_eos``: every request
decodes exactly its output length, and the admission reserves the running requests' future tokens
at the scheduler's ``new_token_ratio`` (``PrefillAdder`` counts an ``ignore_eos`` request's whole
remaining output instead), as the replay's requests do, so a wave can outgrow the pool and retract.

Token ids: a request's prompt is its parent's history (the parent's prompt and output) and its own
new tokens. The replay's outputs are ``OUTPUT_TOKEN`` and its history keeps what the tree keeps of
the parent (``Request.out_tokens``: whole pages of prompt + output - 1); the server's history is
the parent's prompt and that many of its real output tokens. New tokens are ids in ``[8, vocab)``
(never ``OUTPUT_TOKEN``), the same ids on both sides.

Compared per request: the prefix it ran from (the server's ``meta_info.cached_tokens``, counted at
the first admission only; the replay's ``Turn.prefix``) and its retractions (``num_retractions``;
``Turn.retractions``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import requests

from overlay_tools.simulate.cache_kit import OUTPUT_TOKEN

WAVE_MS = 10**7  # between waves in the replay: each wave finishes long before the next arrives
FIRST_ID = 8  # new tokens start above OUTPUT_TOKEN
TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Ask:
    """One request: its wave, the request it continues (an index, or None), its new tokens and
    its output length."""

    wave: int
    parent: int | None
    new: tuple[int, ...]
    output: int


@dataclass
class Row:
    """One request's figures on one side."""

    cached: int
    retractions: int
    prompt: int = 0
    output_ids: list[int] = field(default_factory=list)


def kept(prompt: int, output: int, page: int) -> int:
    """Output tokens the finished turn leaves in the tree (whole pages of prompt + output - 1)."""
    return max(0, (prompt + output - 1) // page * page - prompt)


def replay_prompts(asks: list[Ask], page: int) -> list[list[int]]:
    """Every request's prompt as the replay sees it (parents' outputs as ``OUTPUT_TOKEN``)."""
    prompts: list[list[int]] = []
    for a in asks:
        head: list[int] = []
        if a.parent is not None:
            p = prompts[a.parent]
            head = p + [OUTPUT_TOKEN] * kept(len(p), asks[a.parent].output, page)
        prompts.append(head + list(a.new))
    return prompts


def check(asks: list[Ask], page: int) -> None:
    """Parents come first and in an earlier wave; prompts are whole pages; new ids avoid OUTPUT_TOKEN."""
    for i, (a, p) in enumerate(zip(asks, replay_prompts(asks, page), strict=True)):
        if a.parent is not None and not (a.parent < i and asks[a.parent].wave < a.wave):
            raise ValueError(f"request {i}: its parent {a.parent} must come in an earlier wave")
        if len(p) % page or OUTPUT_TOKEN in a.new or min(a.new, default=FIRST_ID) < FIRST_ID:
            raise ValueError(f"request {i}: prompt of {len(p)} tokens (page {page}) or new ids below {FIRST_ID}")
        if i and asks[i - 1].wave > a.wave:
            raise ValueError(f"request {i}: waves must be in order")


def on_server(base_url: str, asks: list[Ask], page: int) -> list[Row]:
    """Every wave as one batched ``/generate`` call, the next when it has answered."""
    rows: list[Row | None] = [None] * len(asks)
    prompts: list[list[int]] = [[] for _ in asks]
    for wave in sorted({a.wave for a in asks}):
        members = [i for i, a in enumerate(asks) if a.wave == wave]
        for i in members:
            a = asks[i]
            head: list[int] = []
            if a.parent is not None:
                p, r = prompts[a.parent], rows[a.parent]
                head = p + r.output_ids[: kept(len(p), asks[a.parent].output, page)]
            prompts[i] = head + list(a.new)
        body = {"input_ids": [prompts[i] for i in members],
                "sampling_params": [{"max_new_tokens": asks[i].output, "min_new_tokens": asks[i].output,
                                     "temperature": 0.0} for i in members]}
        response = requests.post(base_url + "/generate", json=body, timeout=TIMEOUT_S)
        response.raise_for_status()
        for i, out in zip(members, response.json(), strict=True):
            meta = out["meta_info"]
            if meta["completion_tokens"] != asks[i].output:
                raise AssertionError(f"request {i}: {meta['completion_tokens']} tokens, not {asks[i].output}")
            rows[i] = Row(meta["cached_tokens"], meta.get("num_retractions", 0), meta["prompt_tokens"],
                          list(out["output_ids"]))
    return rows


def replay_requests(asks: list[Ask], page: int) -> list[Any]:
    """The workload as ``simulate``'s requests (waves :data:`WAVE_MS` apart)."""
    from overlay_tools.simulate import trace

    out = []
    for i, (a, p) in enumerate(zip(asks, replay_prompts(asks, page), strict=True)):
        r = trace.Request(i, i + 1, a.wave * WAVE_MS, len(p), a.output, [], parent=a.parent)
        r.prompt, r.out_tokens = [(t, 1, 1) for t in p], kept(len(p), a.output, page)
        out.append(r)
    for r in out:
        r.session = r.index if r.parent is None else out[r.parent].session
        if r.parent is not None:
            out[r.parent].children.append(r.index)
    return out


def in_replay(asks: list[Ask], geo: Any, policy: str) -> tuple[list[Row], Any]:
    """The workload through ``simulate.run_policy`` at ``geo``: a row per request, and the turns."""
    from overlay_tools import simulate
    from overlay_tools.simulate import engine

    turns, row = simulate.run_policy(policy, geo, replay_requests(asks, geo.page), progress=False)
    assert row["leak"] == 0
    for a, t in zip(asks, turns, strict=True):  # every wave starts on an idle instance and ends before the next
        assert a.wave * WAVE_MS * engine.FS_PER_MS <= t.ready_fs < (a.wave + 1) * WAVE_MS * engine.FS_PER_MS
    return [Row(t.prefix, t.retractions, t.prompt) for t in turns], turns


def table(asks: list[Ask], server: list[Row], replay: list[Row]) -> str:
    """Per request: wave, parent, prompt, output, cached tokens and retractions on both sides."""
    lines = ["req wave parent prompt output | server cached retr | replay cached retr |"]
    for i, (a, s, r) in enumerate(zip(asks, server, replay, strict=True)):
        mark = "" if (s.cached, s.retractions) == (r.cached, r.retractions) else " <- differs"
        lines.append(f"{i:>3} {a.wave:>4} {'-' if a.parent is None else a.parent:>6} {r.prompt:>6} {a.output:>6} | "
                     f"{s.cached:>13} {s.retractions:>4} | {r.cached:>13} {r.retractions:>4} |{mark}")
    return "\n".join(lines)


def pairs(rows: list[Row]) -> list[tuple[int, int]]:
    return [(r.cached, r.retractions) for r in rows]
