"""A Mooncake-format trace: parsed, split into sessions, and given token ids.

One JSON object a line (SGLang's ``bench_serving --dataset-name mooncake`` reads the same):
``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (one id per 512-token prefix
block; equal ids are a shared prefix). A bad line is a :class:`TraceError` naming the line, the
field and the value.

Sessions. A request continues an earlier one when it extends that request's own history: it starts
with every full block of the earlier request, is at least as long as that request's prompt +
output, and those full blocks are not a prompt that other requests share (:func:`link_sessions`
says the rule and why, measured on real traffic); its prompt is then the parent's prompt, the
parent's output and new tokens. With ``--session-key FIELD`` the trace's own session id decides
instead. A session is a first request and every request continuing it, so ``--share`` keeps or
drops whole sessions (a share that keeps none is an error).

Token ids. A prompt's length is rounded up to whole pages (the simulated cache allocates whole
pages; at most a page a request, said in the output). A finished turn leaves in the tree what SGLang
inserts: the KV it computed (prompt + output - 1 tokens; the last sampled token never ran), floored
to a page, so at page 256 a short answer leaves only the prompt. A prompt is built from its parent's
history (that much of prompt + output) when it has one, then from its blocks: a block id seen before
reuses that block's tokens, a new one gets fresh ids (the rest of the parent's output is new to the
tree either way). Output tokens are ``OUTPUT_TOKEN`` (what the cache kit's decode writes), so a
continuation's prompt starts with exactly what its parent left in the tree.
Token sequences are kept as spans (``start, length, step``: fresh ids run up by 1, output runs have
step 0) and materialized only when a request is admitted: a 61M-token trace costs megabytes.
"""

from __future__ import annotations

import json
import random
from array import array
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from overlay_tools.simulate.cache_kit import OUTPUT_TOKEN

BLOCK = 512  # tokens per hash_ids block (Mooncake)
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
FIRST_TOKEN = 1_000_000  # fresh ids start here (below: OUTPUT_TOKEN and the padding ids)
# The replay's clock scales timestamps by a float (--time-scale): past 2**53 a float no longer holds
# every integer millisecond, and a 400-digit timestamp overflows it.
MAX_TIMESTAMP_MS = 2**53
TIMESTAMP_LIMIT = "milliseconds; 2**53 is the most a float clock holds exactly"

Span = tuple[int, int, int]  # (first id, length, step): ids first, first + step, ...


class TraceError(ValueError):
    """A malformed trace line: ``line`` (1-based), ``field``, ``value`` and what is allowed."""

    def __init__(self, path: str, line: int, field: str, value: Any, allowed: str):
        self.line, self.field, self.value = line, field, value
        shown = value if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        super().__init__(f"{path}:{line}: {field}={shown!r}: expected {allowed}")


@dataclass
class Request:
    index: int  # position in the trace (0-based)
    line: int  # 1-based line number
    arrival_ms: int
    input_length: int
    output_length: int
    hash_ids: list[int]
    parent: int | None = None  # index of the request this one continues
    session: int = 0  # index of the session's first request
    children: list[int] = field(default_factory=list)
    prompt: list[Span] = field(default_factory=list)  # page-rounded prompt token ids
    out_tokens: int = 0  # output tokens the finished turn leaves in the tree (whole pages of prompt + output - 1)
    session_id: Any = None  # the --session-key field's value, when the trace carries one
    # Keyed children (--session-key): tokens of the parent's history the prompt may start with, as far
    # as its hash_ids agree with the parent's full blocks (None: all of it; they agree or no key).
    agreed: int | None = None
    inherited: int = 0  # tokens of the prompt taken from the parent's history (set by TokenBuilder)

    @property
    def prompt_len(self) -> int:
        return spans_len(self.prompt)

    @property
    def history_len(self) -> int:
        return self.prompt_len + self.out_tokens


# -- parsing ---------------------------------------------------------------------------------------
def _int_field(path: str, line: int, obj: dict[str, Any], name: str, minimum: int, maximum: int | None = None,
               limit: str = "") -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(path, line, name, value, f"an integer >= {minimum}")
    if maximum is not None and value > maximum:
        raise TraceError(path, line, name, value, f"an integer {minimum}..{maximum:,} ({limit})")
    return value


def parse_line(path: str, line: int, text: str, context_len: int | None = None) -> dict[str, Any]:
    """One line's fields, each checked: integers, ``hash_ids`` one per block, a timestamp the clock
    holds (:data:`MAX_TIMESTAMP_MS`) and, with ``context_len`` (the model's context length as SGLang
    derives it), lengths SGLang's tokenizer manager accepts: the prompt shorter than the context,
    prompt + output within it."""
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise TraceError(path, line, "(json)", text.strip(), f"one JSON object a line ({exc})") from None
    if not isinstance(obj, dict):
        raise TraceError(path, line, "(json)", obj, "a JSON object with " + ", ".join(FIELDS))
    for name in FIELDS:
        if name not in obj:
            raise TraceError(path, line, name, None, "the field to be present (a Mooncake trace line has "
                             + ", ".join(FIELDS) + ")")
    context = f"the model's context length {context_len:,}" if context_len is not None else ""
    out = {"timestamp": _int_field(path, line, obj, "timestamp", 0, MAX_TIMESTAMP_MS, TIMESTAMP_LIMIT),
           "input_length": _int_field(path, line, obj, "input_length", 1,
                                      None if context_len is None else context_len - 1,
                                      f"a prompt shorter than {context}, as SGLang admits it")}
    out["output_length"] = _int_field(path, line, obj, "output_length", 1,
                                      None if context_len is None else context_len - out["input_length"],
                                      f"input_length {out['input_length']:,} + output_length within {context}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in ids):
        raise TraceError(path, line, "hash_ids", ids, "a list of integer block ids")
    if context_len is not None and len(ids) > -(-(context_len - 1) // BLOCK):
        raise TraceError(path, line, "hash_ids", ids, f"at most {-(-(context_len - 1) // BLOCK):,} block ids of "
                         f"{BLOCK} tokens (a prompt shorter than {context}), got {len(ids):,}")
    need = -(-out["input_length"] // BLOCK)
    if len(ids) != need:
        raise TraceError(path, line, "hash_ids", ids, f"{need} block ids for input_length={out['input_length']} "
                         f"(one per {BLOCK} tokens, the last may be partial), got {len(ids)}")
    out["hash_ids"] = ids
    return out


def _session_id(path: str, line: int, text: str, key: str | None) -> Any:
    if key is None:
        return None
    value = json.loads(text).get(key)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TraceError(path, line, key, value, f"a session id (a string or an integer) in every line "
                         f"(--session-key {key})")
    return value


def read(path: str | Path, session_key: str | None = None, context_len: int | None = None) -> list[Request]:
    """Every line of the trace (blank lines skipped), in file order; arrivals must not go back. With
    ``session_key``, every line must carry that field (a string or an integer: the session id); with
    ``context_len``, every length is bounded by it (:func:`parse_line`)."""
    path = str(path)
    requests: list[Request] = []
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            row = parse_line(path, n, text, context_len)
            if requests and row["timestamp"] < requests[-1].arrival_ms:
                raise TraceError(path, n, "timestamp", row["timestamp"],
                                 f"arrivals in order (>= {requests[-1].arrival_ms}, the line before)")
            requests.append(Request(len(requests), n, row["timestamp"], row["input_length"], row["output_length"],
                                    row["hash_ids"], session_id=_session_id(path, n, text, session_key)))
    if not requests:
        raise TraceError(path, 0, "(file)", "", "at least one request line")
    return requests


# -- sessions --------------------------------------------------------------------------------------
REFUSALS = {
    "branch point": "its full blocks are extended by different full blocks in several requests (a shared prompt)",
    "shorter than its history": "the request is shorter than the candidate's prompt + output (a sibling on a "
                                "shared prefix, not a continuation)",
    "shared prefix": "the requests that start with its full blocks are not one growing conversation (each at "
                     "least the one before's prompt + output): a shared prompt with different tails",
}


@dataclass
class LinkStats:
    """What :func:`link_sessions` decided: requests linked to a parent, roots (first turns), candidate
    parents refused by reason (:data:`REFUSALS`; a request can refuse several before its parent)."""

    linked: int
    roots: int
    refused: dict[str, int]
    rule: str  # "heuristic" or "session key FIELD"
    disagreeing: int = 0  # keyed pairs whose hash_ids do not start with the parent's full blocks

    def describe(self) -> str:
        head = f"sessions ({self.rule}): {self.linked:,} requests linked to a parent, {self.roots:,} roots"
        if self.rule != "heuristic":
            return (f"{head}; {self.disagreeing:,} keyed pairs disagree (the child's hash_ids do not start with its "
                    "parent's full blocks: its prompt is its own blocks, the parent's history only as far as "
                    "the blocks match)")
        parts = ", ".join(f"{n:,} {reason}" for reason, n in self.refused.items()) or "none"
        return f"{head}; candidate parents refused: {parts}"

    def as_dict(self) -> dict[str, Any]:
        out = {"linked": self.linked, "roots": self.roots, "refused": dict(self.refused), "rule": self.rule}
        if self.rule != "heuristic":
            out["disagreeing"] = self.disagreeing
        return out


def _prefix_keys(ids: list[int]) -> list[int]:
    """``keys[k]`` names the prefix ``ids[:k]`` (a hash chain: equal keys, equal prefixes)."""
    keys, key = [0], 0
    for h in ids:
        key = hash((key, h))
        keys.append(key)
    return keys


def link_sessions(requests: list[Request], session_key: str | None = None) -> LinkStats:
    """Set ``parent`` / ``session`` / ``children`` and say what was decided.

    With ``session_key`` (the trace's session or conversation id field, read by :func:`read`), a
    request's parent is the latest earlier request with the same id. Otherwise the heuristic: a
    candidate parent is the latest earlier request whose full blocks ``X`` all start this one (the
    deepest ``X`` first); it is refused, and the next shallower candidate tried, when

    * ``X`` is a **branch point**: across the trace, requests extend ``X`` with different full
      blocks. A conversation's later turns all carry its earlier turns, so they extend ``X`` the same
      way; a system prompt or a shared document is extended differently by every user (the one-block
      prompt ``0`` of the Mooncake production trace by hundreds of requests).
    * ``X`` is a **shared prefix**: the requests whose full blocks start with ``X``, in trace order, are
      not one growing conversation (one is shorter than the one before's prompt + output). This
      catches a shared prompt whose users add less than a block each (no full block to branch on).
    * the request is **shorter than its history**: a continuation's prompt carries the parent's prompt
      and output, so it is at least ``input_length + output_length`` of the parent. Requests on a
      shared document asking different short questions are siblings, not turns.

    Why these, measured on two public traces (not in the repository; docs/benchmarks.md names them): on the first
    1,000 requests of the Mooncake production trace (``mooncake_arxiv_head.jsonl``: a one-block
    prompt shared by 452 requests, a 12-block one by 397) the old rule ("every full block of an
    earlier request starts this one") linked 992 requests into 8 sessions, 398 through a one-block
    parent; this rule links 44 (39 sessions of 2 to 4 turns, none through a one-block parent),
    refusing 948 candidates as branch points, 6 as shorter than their history and 2 as shared
    prefixes. On the FAST'25 synthetic trace (``synthetic_trace.jsonl``: long documents asked
    several questions) the old rule linked 1,455 requests; 1,081 of the candidates are shorter than
    the parent's prompt + output (654 do not grow at all: the same document with another question,
    no history), 124 more sit on a document other requests share with other tails, 220 on branch
    points; 31 link (26 sessions), the turns that carry their parent's output. A refused true
    continuation costs the replay at most its parent's last partial block and output (the shared
    blocks still match, their token ids come from the block ids); a wrongly linked one fabricates a
    whole history and holds the request until its "parent" finishes.
    """
    if session_key is not None:
        return _link_by_key(requests, session_key)
    keys = [_prefix_keys(r.hash_ids) for r in requests]
    members: dict[int, list[int]] = {}  # prefix key -> requests whose full blocks start with it
    extended: dict[int, set[int]] = {}  # prefix key -> the full blocks that follow it anywhere in the trace
    for r, ks in zip(requests, keys):
        full = r.input_length // BLOCK
        for k in range(1, full + 1):
            members.setdefault(ks[k], []).append(r.index)
            if k < full:
                extended.setdefault(ks[k], set()).add(r.hash_ids[k])
    growing: dict[int, bool] = {}

    def is_chain(key: int) -> bool:
        if key not in growing:
            m = [requests[i] for i in members.get(key, ())]
            growing[key] = all(b.input_length >= a.input_length + a.output_length for a, b in pairwise(m))
        return growing[key]

    refused = dict.fromkeys(REFUSALS, 0)
    by_blocks: dict[int, int] = {}
    linked = 0
    for r, ks in zip(requests, keys):
        for k in range(len(r.hash_ids), 0, -1):
            parent = by_blocks.get(ks[k])
            if parent is None:
                continue
            p = requests[parent]
            if len(extended.get(ks[k], ())) > 1:
                refused["branch point"] += 1
            elif r.input_length < p.input_length + p.output_length:
                refused["shorter than its history"] += 1
            elif not is_chain(ks[k]):
                refused["shared prefix"] += 1
            else:
                r.parent, r.session = parent, p.session
                p.children.append(r.index)
                linked += 1
                break
        else:
            r.session = r.index
        full = r.input_length // BLOCK
        if full:
            by_blocks[ks[full]] = r.index
    return LinkStats(linked, len(requests) - linked, refused, "heuristic")


def _link_by_key(requests: list[Request], session_key: str) -> LinkStats:
    """The id links; the blocks say how much history a child carries. A child whose hash_ids start
    with every full block of its parent's prompt continues its history (as the heuristic's rule); one
    that does not (an agent that truncated or summarized its context) keeps only the blocks that
    agree (``agreed``), the rest of its prompt is its own blocks. A parent with no full block has
    nothing to compare: the key decides."""
    last: dict[Any, int] = {}
    linked = disagreeing = 0
    for r in requests:
        parent = last.get(r.session_id)
        if parent is None:
            r.session = r.index
        else:
            p = requests[parent]
            r.parent, r.session = parent, p.session
            p.children.append(r.index)
            linked += 1
            full = p.input_length // BLOCK
            same = next((i for i, (a, b) in enumerate(zip(p.hash_ids[:full], r.hash_ids)) if a != b),
                        min(full, len(r.hash_ids)))
            if same < full:
                r.agreed = same * BLOCK
                disagreeing += 1
        last[r.session_id] = r.index
    return LinkStats(linked, len(requests) - linked, {}, f"session key {session_key!r}", disagreeing)


class ShareError(ValueError):
    """A ``--share`` that keeps no session (named with the share, the seed and the session count)."""


def sample_sessions(requests: list[Request], share: float, seed: int) -> list[Request]:
    """A seeded ``share`` of the sessions, each with all its turns (in trace order). A share below 1
    that keeps no session (or of a trace with one session) is a :class:`ShareError`."""
    if not 0 < share <= 1:
        raise ValueError(f"--share={share}: expected a fraction in (0, 1]")
    if share == 1:
        return list(requests)
    roots = [r.index for r in requests if r.parent is None]
    if len(roots) < 2:
        raise ShareError(f"--share={share:g}: the trace has {len(roots)} session; a share below 1 would keep "
                         "none of it or all of it (use --share 1)")
    rng = random.Random(seed)
    keep = {i for i in roots if rng.random() < share}
    if not keep:
        raise ShareError(f"--share={share:g} (seed {seed}) keeps none of the trace's {len(roots):,} sessions: "
                         f"expected a share of at least about 1/{len(roots)} (or another --seed)")
    return [r for r in requests if r.session in keep]


# -- token ids -------------------------------------------------------------------------------------
def spans_len(spans: list[Span]) -> int:
    return sum(n for _, n, _ in spans)


def spans_slice(spans: list[Span], end: int) -> list[Span]:
    """The first ``end`` tokens of ``spans``."""
    out, left = [], end
    for start, n, step in spans:
        if left <= 0:
            break
        take = min(n, left)
        out.append((start, take, step))
        left -= take
    return out


def _append(spans: list[Span], span: Span) -> None:
    start, n, step = span
    if n <= 0:
        return
    if spans:
        s0, n0, st0 = spans[-1]
        if st0 == step and ((step == 0 and s0 == start) or (step != 0 and s0 + n0 * step == start)):
            spans[-1] = (s0, n0 + n, step)
            return
    spans.append(span)


def materialize(spans: list[Span]) -> array:
    """The token ids of ``spans`` as an ``array('q')`` (what a Req keeps)."""
    import numpy as np

    parts = [np.arange(start, start + n * step, step, dtype=np.int64) if step else np.full(n, start, dtype=np.int64)
             for start, n, step in spans]
    out = array("q")
    if parts:
        out.frombytes(np.concatenate(parts).tobytes())
    return out


class TokenBuilder:
    """Token spans for every request, in trace order (so equal blocks get equal ids whatever the
    policy's timing)."""

    def __init__(self, page: int):
        if BLOCK % page and page % BLOCK:
            raise ValueError(f"page={page}: the simulation needs a page that divides or is a multiple of {BLOCK}")
        self.page = page
        self.next_id = FIRST_TOKEN
        self.blocks: dict[int, list[Span]] = {}

    def _fresh(self, n: int) -> Span:
        span = (self.next_id, n, 1)
        self.next_id += n
        return span

    def round_up(self, n: int) -> int:
        return -(-n // self.page) * self.page

    def build(self, requests: list[Request], by_index: dict[int, Request]) -> None:
        for r in requests:
            length = self.round_up(r.input_length)
            spans: list[Span] = []
            parent = by_index.get(r.parent) if r.parent is not None else None
            if parent is not None:
                history = [*parent.prompt, (OUTPUT_TOKEN, parent.out_tokens, 0)]
                for span in spans_slice(history, length if r.agreed is None else min(length, r.agreed)):
                    _append(spans, span)
            r.inherited = spans_len(spans)
            for i, h in enumerate(r.hash_ids):  # the blocks past the parent's history
                lo, hi = i * BLOCK, min(length, (i + 1) * BLOCK)
                have = spans_len(spans)
                if hi <= have:
                    continue
                known = self.blocks.get(h)
                if known is not None and spans_len(known) >= hi - lo and have == lo:
                    for span in spans_slice(known, hi - lo):
                        _append(spans, span)
                else:
                    _append(spans, self._fresh(hi - have))
            _append(spans, self._fresh(length - spans_len(spans)))  # a page larger than the blocks
            r.prompt = spans
            # What the finished turn leaves in the tree: SGLang inserts the KV the request computed,
            # prompt + output - 1 tokens (the last sampled token never ran), page-floored.
            r.out_tokens = max(0, (length + r.output_length - 1) // self.page * self.page - length)
            for i, h in enumerate(r.hash_ids[: r.input_length // BLOCK]):  # full blocks only
                if h not in self.blocks:
                    self.blocks[h] = _sub(spans, i * BLOCK, (i + 1) * BLOCK)


def _sub(spans: list[Span], lo: int, hi: int) -> list[Span]:
    """Tokens ``[lo, hi)`` of ``spans``."""
    out: list[Span] = []
    pos = 0
    for start, n, step in spans:
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            _append(out, (start + (a - pos) * step, b - a, step))
        pos += n
        if pos >= hi:
            break
    return out


def load(path: str | Path, page: int, share: float = 1.0, seed: int = 0,
         session_key: str | None = None) -> list[Request]:
    """Read, link sessions, sample ``share`` of them, give every kept request its token spans."""
    return prepare(read(path, session_key), page, share, seed, session_key)


def prepare(requests: list[Request], page: int, share: float = 1.0, seed: int = 0,
            session_key: str | None = None) -> list[Request]:
    """Link sessions, sample ``share`` of them, give every kept request its token spans."""
    link_sessions(requests, session_key)
    kept = sample_sessions(requests, share, seed)
    TokenBuilder(page).build(kept, {r.index: r for r in kept})
    return kept
