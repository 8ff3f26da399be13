"""``simulate`` against the DSV4 kit server, request by request: a Mooncake-format trace slice with a
shared system prompt and multi-turn sessions, at the gate's DSV4 kit geometry (:class:`devkit.engine_kit.model_kits.Dsv4Kit`:
page 256, window 128, chunk 1024, 3 running rows, Full pool 64 pages, SWA pool 12 pages), through
SGLang's HTTP server serving the tiny DeepSeek-V4.1 (the real ``DeepSeekV4TokenToKVPool``) and
through ``overlay_tools.simulate`` (:func:`overlay_tools.simulate.run_policy`), stock and with the
profile's cache switches (SWA thin + cone replay at the kit's N = 768). The figure compared is the
prefix each request ran from: the server's ``cached_tokens``, simulate's ``Turn.prefix``.

The trace (:func:`write_trace`, 512-token ``hash_ids`` blocks): four requests extend a 4-block system
prompt with a short question (branching: none is a session), two sessions of three turns (each turn
is the previous prompt, its output and a new message; the first answer is 260 tokens, so a page of
output is history), and three 3072-token (three-chunk) prompts of other traffic that churn the
12-page SWA pool between them. Requests arrive 100 s apart and run one at a time on both sides
(greedy, ``ignore_eos``): the server's batching does not enter, and simulate's modelled clock
finishes each before the next arrives (asserted). Simulate gives every prompt its token ids (page-rounded
lengths, blocks as ids); the server gets the same prompts with each id mapped into the kit's
vocabulary and each parent's output replaced by the server's own output tokens.

What stock's agreement rests on (requests 4 and 5): before it allocates an extend, SGLang evicts for
the extend plus one page per request (``alloc_paged_token_slots_extend``'s conservative demand), and
so does simulate's replay (``CacheKit.alloc_headroom``). The first churn prompt (request 3) evicts that
page too, and LRU takes session A's leaf (its output page [1280, 1536), Full and SWA): request 4
resumes at 0. It then prefills its whole 2048-token prompt, and those passes evict the system
prompt's window at 2048: request 5 resumes at 0. A replay that evicted only the shortfall
(:func:`_shortfall_eviction_only`) would keep both windows (:data:`WITHOUT_HEADROOM`). Under thin +
cone every request agrees.

Slow and heavy: two boots (about 4 minutes here).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from devkit.engine_kit import client, model_kits
from overlay_tools import simulate
from overlay_tools.simulate import fleet, trace
from overlay_tools.simulate.cache_kit import OUTPUT_TOKEN

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

KIT = model_kits.Dsv4Kit()
PAGE, WINDOW = 256, 128
CONE_TOKENS = int(KIT.profile_overrides()["DSV41_SWA_CONE_TOKENS"])
PROFILES = {"stock": {}, "thin+cone": {"DSV41_SWA_THIN": "1", "DSV41_SWA_CONE_REPLAY": "1",
                                       "DSV41_SWA_CONE_TOKENS": str(CONE_TOKENS)}}
SPACING_MS = 100_000  # between arrivals: each request finishes before the next arrives
VOCAB = 1024  # the kit model's (devkit.engine_kit.dsv4.checkpoint); ids below 6 are its specials
SYSTEM = [10, 11, 12, 13]  # the shared system prompt: four 512-token blocks
CHURN = 3 * model_kits.DSV4_CHUNK  # other traffic: a three-chunk prompt (see devkit.engine_kit.model_kits on why three)
# (kind, input_length, output_length): "S" a question on the system prompt, "C" churn, "A"/"B" a session's turn
REQUESTS = [("S", 2048 + 200, 8), ("A", 1100, 260), ("S", 2048 + 100, 8), ("C", CHURN, 8), ("A", 1800, 8),
            ("S", 2048 + 300, 8), ("B", 1700, 8), ("C", CHURN, 8), ("S", 2048 + 50, 8), ("B", 2000, 8),
            ("A", 2200, 8), ("C", CHURN, 8), ("B", 2400, 8)]
FRESH_IDS = 1 << 16  # more than the slice's fresh token ids
PARENTS = {4: 1, 10: 4, 9: 6, 12: 9}  # session A: 1 -> 4 -> 10, session B: 6 -> 9 -> 12

# Stock: where a replay evicting only the shortfall would differ from the server (the module docstring).
WITHOUT_HEADROOM = {4: (1536, 0),  # session A's second turn: A's resume window was evicted by the churn
                    5: (2048, 0)}  # a question on the system prompt: its checkpoint window at 2048, likewise


def write_trace(path) -> None:
    """The trace slice, one Mooncake line a request (``hash_ids`` of 512-token blocks)."""
    fresh = iter(range(100, 10_000))
    last: dict[str, dict] = {}
    heads = {"A": [next(fresh) for _ in range(2)], "B": [next(fresh) for _ in range(3)]}
    lines = []
    for i, (kind, n, out) in enumerate(REQUESTS):
        blocks = -(-n // trace.BLOCK)
        if kind == "S":
            ids = [*SYSTEM, next(fresh)]
        elif kind == "C":
            ids = [next(fresh) for _ in range(blocks)]
        else:  # a turn: the previous turn's full blocks, then its own
            prev = last.get(kind)
            head = heads[kind] if prev is None else prev["hash_ids"][: prev["input_length"] // trace.BLOCK]
            ids = head + [next(fresh) for _ in range(blocks - len(head))]
        line = {"timestamp": i * SPACING_MS, "input_length": n, "output_length": out, "hash_ids": ids}
        last[kind] = line
        lines.append(json.dumps(line))
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "slice.jsonl"
    write_trace(path)
    return path


@pytest.fixture(scope="module")
def kit_model(tmp_path_factory):
    return KIT.build(tmp_path_factory.mktemp("dsv4") / "model")


@pytest.fixture(scope="module")
def engine(kit_model, trace_path, tmp_path_factory):
    """The server's cached tokens per request, one boot per profile (at most once each per module)."""
    runs: dict[str, list[int]] = {}

    def run(policy: str) -> list[int]:
        if policy not in runs:
            runs[policy] = _engine(kit_model, tmp_path_factory.mktemp("logs") / "server.log", PROFILES[policy],
                                   trace_path)
        return runs[policy]

    return run


def _engine(kit_model, log, profile, trace_path) -> list[int]:
    """Every request of the slice on the DSV4 kit server, one at a time, in trace order."""
    requests = trace.load(trace_path, PAGE)
    table = np.random.default_rng(0).integers(6, VOCAB, size=FRESH_IDS)  # a fresh id -> a kit token id
    sent: dict[int, tuple[list[int], list[int]]] = {}  # trace index -> (prompt, output ids)
    cached = []
    with KIT.server(kit_model, log, profile, []) as server:
        for r in requests:
            ids = list(trace.materialize(r.prompt))
            head: list[int] = []
            if r.parent is not None:  # the parent's prompt and its output on this server
                p = next(x for x in requests if x.index == r.parent)
                assert ids[p.prompt_len: p.history_len] == [OUTPUT_TOKEN] * p.out_tokens
                prompt, output = sent[p.index]
                head = (prompt + output[: p.out_tokens])[: len(ids)]
            tokens = head + [int(table[i - trace.FIRST_TOKEN]) for i in ids[len(head):]]
            out = client.generate(server.base_url, tokens, r.output_length)
            sent[r.index] = (tokens, out["output_ids"])
            cached.append(out["meta_info"]["cached_tokens"])
    return cached


def _simulate(trace_path, policy: str) -> list[int]:
    """The slice through ``simulate`` at the kit's geometry: the prefix each request ran from."""
    requests = trace.load(trace_path, PAGE)
    assert {r.index: r.parent for r in requests if r.parent is not None} == PARENTS  # no system-prompt "session"
    geo = fleet.Fleet(page=PAGE, window=WINDOW, chunk=model_kits.DSV4_CHUNK, max_running=model_kits.DSV4_MAX_RUNNING, tails=0,
                      swa_pool=round(model_kits.DSV4_SWA_RATIO * model_kits.DSV4_MAX_TOTAL_TOKENS),
                      full_tokens=model_kits.DSV4_MAX_TOTAL_TOKENS, full_source="the DSV4 kit's --max-total-tokens",
                      cone_tokens=CONE_TOKENS, cone_bound=0, model="dsv4 kit", profile="-")
    turns, row = simulate.run_policy(policy, geo, requests, progress=False)
    assert row["leak"] == 0
    fs = simulate.engine.FS_PER_MS
    for t in turns:  # one at a time: ready at its arrival (its parent done), first token before the next
        assert t.ready_fs == t.index * SPACING_MS * fs and t.first_token_fs < (t.index + 1) * SPACING_MS * fs
    return [t.prefix for t in turns]


def _shortfall_eviction_only(monkeypatch) -> None:
    """Simulate's replay without SGLang's over-estimate: ``CacheKit.reserve`` (its
    ``evict_from_tree_cache`` before an allocation) does nothing, so an allocation evicts only its
    shortfall."""
    from overlay_tools.simulate import cache_kit

    monkeypatch.setattr(cache_kit.CacheKit, "reserve", lambda self, num_tokens: None)


def test_stock_simulate_gives_the_server_prefix_on_every_request_as_it_evicts_sglangs_headroom(
        engine, trace_path, monkeypatch):
    """Stock: every request agrees, 4 and 5 because simulate evicts as SGLang over-estimates an
    extend; evicting only the shortfall, they would differ (:data:`WITHOUT_HEADROOM`)."""
    server = engine("stock")
    assert _simulate(trace_path, "stock") == server
    _shortfall_eviction_only(monkeypatch)
    plain = _simulate(trace_path, "stock")
    assert {i: (s, e) for i, (s, e) in enumerate(zip(plain, server)) if s != e} == WITHOUT_HEADROOM


def test_thin_and_cone_simulate_gives_the_server_prefix_on_every_request(engine, trace_path):
    """Thin + cone replay (the profile's cache switches at the kit's N): every request agrees; the
    slice separates the policies on the server (session turns and questions the churn cost stock,
    three cone resumes below the evicted window)."""
    server = engine("thin+cone")
    assert _simulate(trace_path, "thin+cone") == server
    stock = engine("stock")
    assert {i: (s, t) for i, (s, t) in enumerate(zip(stock, server)) if s != t} == {
        4: (0, 1536), 5: (0, 2048), 8: (0, 1280), 9: (0, 1792), 10: (0, 1024), 12: (0, 2048)}
