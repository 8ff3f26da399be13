"""What each worker served, from its own request log, and the request sequence as a Mooncake trace.

Every worker boots with SGLang's request log as JSON lines (``--log-requests --log-requests-level 3
--log-requests-format json --log-requests-target DIR``, :data:`REQUEST_LOG_ARGS`): one
``request.finished`` line per request, with the prompt's token ids (``obj.input_ids``, after the chat
template), the routing key the client sent (``obj.routing_key``, from ``X-SMG-Routing-Key``) and
SGLang's ``meta_info``: ``request_received_ts``, ``prompt_tokens``, ``cached_tokens``,
``completion_tokens``, ``first_token_latency`` (the server's TTFT), ``e2e_latency``.

:func:`read_served` gives one :class:`Served` per request; merged over the workers and sorted by
arrival it is the sequence the router dispatched (the router adds a loopback hop, well under a
millisecond against arrivals 100s of ms apart). :func:`link_conversations` names each request's
conversation: the earlier request whose prompt is the longest prefix of its own (a later turn's
prompt is the earlier turn's prompt, its answer and the new message). :func:`mooncake_lines` writes
the trace ``simulate`` reads (``overlay_tools.simulate.trace``): ``timestamp`` (ms from the first
arrival), ``input_length``, ``output_length``, ``hash_ids`` (one id per 512-token block of the prompt,
the id of the whole prefix up to the block's end, so equal ids are a shared prefix), and beside them
``session`` (the conversation), ``routing_key``, and what was observed: ``worker`` (its index in the
fleet) and ``cached_tokens``.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK = 512  # tokens per hash_ids block: overlay_tools.simulate.trace.BLOCK (Mooncake's)
FINISHED = "request.finished"
HEALTH_PREFIX = "HEALTH_CHECK"


def request_log_args(folder: Path) -> list[str]:
    """The worker's launch arguments that write its request log to ``folder``."""
    return ["--log-requests", "--log-requests-level", "3", "--log-requests-format", "json",
            "--log-requests-target", str(folder)]


@dataclass
class Served:
    rid: str
    worker: int
    received_s: float  # the worker's request_received_ts (wall clock; one machine, one clock)
    input_ids: list[int]
    routing_key: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None
    e2e_s: float | None
    session: int = -1  # the conversation (link_conversations)

    @property
    def itl_s(self) -> float | None:
        """Mean gap between output tokens after the first."""
        if self.ttft_s is None or self.e2e_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


def parse_lines(lines: Iterable[str], worker: int) -> list[Served]:
    """The ``request.finished`` records of one worker's request log (health checks left out)."""
    out = []
    for line in lines:
        start = line.find("{")
        if start < 0:
            continue
        try:
            record = json.loads(line[start:])
        except ValueError:
            continue
        if record.get("event") != FINISHED or str(record.get("rid", "")).startswith(HEALTH_PREFIX):
            continue
        obj, meta = record.get("obj") or {}, (record.get("out") or {}).get("meta_info") or {}
        ids = obj.get("input_ids") or []
        out.append(Served(
            rid=str(record["rid"]), worker=worker, received_s=float(meta["request_received_ts"]),
            input_ids=list(ids), routing_key=obj.get("routing_key") or (record.get("headers") or {}).get(
                "x-smg-routing-key"),
            prompt_tokens=int(meta.get("prompt_tokens", len(ids))), cached_tokens=int(meta.get("cached_tokens") or 0),
            completion_tokens=int(meta.get("completion_tokens") or 0),
            ttft_s=meta.get("first_token_latency"), e2e_s=meta.get("e2e_latency")))
    return out


def read_served(texts: Sequence[str]) -> list[Served]:
    """Every worker's records (``texts[i]``: worker i's request log over the run), by arrival."""
    served = [s for worker, text in enumerate(texts) for s in parse_lines(text.splitlines(), worker)]
    served.sort(key=lambda s: (s.received_s, s.rid))
    link_conversations(served)
    return served


def link_conversations(served: Sequence[Served]) -> None:
    """Each request's ``session``: that of the earlier request whose prompt is the longest prefix of
    its own, else a new conversation (numbered in order of first arrival)."""
    sessions = 0
    for i, s in enumerate(served):
        parent = max((p for p in served[:i] if len(p.input_ids) < len(s.input_ids)
                      and s.input_ids[:len(p.input_ids)] == p.input_ids), key=lambda p: len(p.input_ids), default=None)
        if parent is None:
            s.session, sessions = sessions, sessions + 1
        else:
            s.session = parent.session


def block_hash_ids(input_ids: Sequence[int], table: dict[tuple[int, ...], int]) -> list[int]:
    """One id per :data:`BLOCK`-token block (the last may be partial): the id of the prefix up to
    the block's end, numbered in order of first sight in ``table`` (shared across the trace)."""
    ids = []
    for end in range(BLOCK, len(input_ids) + BLOCK, BLOCK):
        key = tuple(input_ids[:min(end, len(input_ids))])
        ids.append(table.setdefault(key, len(table)))
    return ids


def mooncake_lines(served: Sequence[Served]) -> list[str]:
    """The run's requests in arrival order as Mooncake trace lines (see the module docstring)."""
    if not served:
        return []
    t0 = served[0].received_s
    table: dict[tuple[int, ...], int] = {}
    lines = []
    for s in served:
        row: dict[str, Any] = {
            "timestamp": round((s.received_s - t0) * 1000), "input_length": len(s.input_ids),
            "output_length": max(1, s.completion_tokens), "hash_ids": block_hash_ids(s.input_ids, table),
            "session": s.session, "routing_key": s.routing_key, "worker": s.worker,
            "cached_tokens": s.cached_tokens, "rid": s.rid}
        lines.append(json.dumps(row))
    return lines


def per_worker(served: Sequence[Served], workers: int) -> list[dict[str, Any]]:
    """Per worker: requests, prompt tokens, cached tokens, prefilled (prompt - cached), conversations
    it served, mean / p99 server TTFT and mean ITL in ms."""
    rows = []
    for w in range(workers):
        mine = [s for s in served if s.worker == w]
        ttfts = [s.ttft_s * 1000 for s in mine if s.ttft_s is not None]
        itls = [s.itl_s * 1000 for s in mine if s.itl_s is not None]
        prompt, cached = sum(s.prompt_tokens for s in mine), sum(s.cached_tokens for s in mine)
        rows.append({"worker": w, "requests": len(mine), "prompt_tokens": prompt, "cached_tokens": cached,
                     "prefilled_tokens": prompt - cached, "conversations": len({s.session for s in mine}),
                     "mean_ttft_ms": _mean(ttfts), "p99_ttft_ms": _pct(ttfts, 0.99), "mean_itl_ms": _mean(itls)})
    return rows


def moved_turns(served: Sequence[Served]) -> int:
    """Later turns served by another worker than their conversation's previous turn."""
    last: dict[int, int] = {}
    moved = 0
    for s in served:
        if s.session in last and last[s.session] != s.worker:
            moved += 1
        last[s.session] = s.worker
    return moved


def _mean(values: Sequence[float]) -> float | None:
    return round(statistics.fmean(values), 1) if values else None


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)
