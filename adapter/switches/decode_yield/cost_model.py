"""The decode-yield cost model: one integer formula, its coefficients in one place, no clock.

What it serves: ``DSV41_DECODE_YIELD_MODE=model`` (the open loop, the switch's previous behaviour and
its rollback), the first windows of a boot in the default measured mode (before the closed loop of
:mod:`adapter.switches.decode_yield.controller` has measured a step and a cycle), and the modelled
durations of ``bench decode-yield``.

Every input is replicated scheduler state (chunk tokens, prefix lengths, decode rows and their
context lengths), and every term is a Python ``int``, so every TP rank computes the same cost and
the same yield window. This module reads no clock and no environment: coefficients come from the
parsed ``DSV41_DECODE_YIELD_*`` keys (:func:`from_config`) or from :data:`DEFAULTS`.

The formula (costs in femtoseconds, so every coefficient keeps three or more significant digits
as an integer; one forward of the model)::

    pairs(c, p)      = c*p + c*(c+1)//2                  # causal (query, key) pairs of a c-token extend on prefix p
    topk_pairs(c, p) = sum_{j=p+1}^{p+c} min(j, K)       # the same with each query capped at K keys (sparse top-k)
    chunk_fs = (CHUNK_US + CHUNK_SCHED_US)*10**9 + sum over extend rows (c, p) of
               ( (TOKEN_NS + TOKEN_SCHED_NS)*10**6*c + PAIR_FS*pairs(c, p) + TOPK_PAIR_PS*1000*topk_pairs(c, p) )
    step_fs  = (STEP_US + STEP_SCHED_US)*10**9 + (ROW_NS + ROW_SCHED_NS)*10**6*B
               + KV_PS*1000*sum(L_i) + TOPK_KV_PS*1000*sum(min(L_i, K))
    window   = chunk_fs + SWITCH_US*10**9        # what one chunk-and-window cycle costs besides its N steps
    N        = max(floor, min(128, ceil((pct*window - carry) / ((100-pct)*step_fs))))
    carry    = the rounding surplus the previous windows of the same prompt gave (0 for the first;
               see :func:`yield_window`), so the prompt's total decode time tracks its share

``TOKEN_NS`` covers the dense and MoE GEMMs (linear in tokens); ``PAIR_FS`` attention or the
DSA-style indexer over the whole prefix; ``TOPK_PAIR_PS`` the sparse top-k attention (``K`` =
``TOPK`` keys per query; 0 turns the sparse terms off). ``STEP_US`` is the weight stream and graph
launch of a decode step, ``ROW_NS`` per-row work, ``KV_PS`` the per-KV-token read (indexer or dense
attention), ``TOPK_KV_PS`` the sparse top-k read. ``N`` decode steps then give running streams
``pct`` percent of the modelled time around one chunk.

The ``*_SCHED_*`` terms and ``SWITCH_US`` charge what an iteration costs besides its forward: the
scheduler pass, batch building and output processing (``_SCHED_``: per prefill / decode iteration,
per token / row), and the extra time of alternating between a chunk and decode steps that
back-to-back iterations of one kind do not pay (``SWITCH_US``: once per window). The forward terms
alone model the forward only; on a CPU engine an interleaved decode step costs milliseconds more
(measured on the CPU engine), which the prompt's TTFT and the streams' rate pay. ``fit-cost-model`` fits them from
the iteration wall times of a forward-pass-metrics log (``recv_time`` of
:mod:`devkit.engine_kit.fpm`); their defaults are 0 (the forward terms then stand for the whole
iteration, as the fleet placeholders did).

Defaults (:data:`DEFAULTS`) are placeholders shaped to the one fleet figure we have (
with one decode step per chunk, streams kept 8 % of their decode rate while a cold 500K-token
prompt prefilled in 8192-token chunks, i.e. a chunk costs about 11.5 decode steps of 16 streams,
DSV4-style attention with top-k 2048). They are not a measurement: fit your own with
``python -m adapter fit-cost-model LOG`` and put the printed line in the profile.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from adapter.core import api

MAX_YIELD_STEPS = 128  # the cap: a window never holds the prompt back longer than this
KEY_PREFIX = "DSV41_DECODE_YIELD_"


@dataclass(frozen=True)
class Coefficients:
    chunk_us: int  # fixed cost of a prefill forward [µs]
    token_ns: int  # per prefill token (dense + MoE GEMMs) [ns]
    pair_fs: int  # per causal (query, key) pair over the prefix (attention / indexer) [fs]
    topk_pair_ps: int  # per (query, top-k key) pair (sparse attention) [ps]
    step_us: int  # fixed cost of a decode step (weights, launch) [µs]
    row_ns: int  # per decode row [ns]
    kv_ps: int  # per KV token read by a decode row [ps]
    topk_kv_ps: int  # per top-k KV token read by a decode row [ps]
    topk: int  # K of the sparse attention (0: no sparse terms)
    chunk_sched_us: int = 0  # per prefill iteration besides its forward (scheduling, output) [µs]
    token_sched_ns: int = 0  # per prefill token besides the forward [ns]
    step_sched_us: int = 0  # per decode iteration besides its forward [µs]
    row_sched_ns: int = 0  # per decode row besides the forward [ns]
    switch_us: int = 0  # per window: alternating chunk and decode steps beyond back-to-back iterations [µs]
    source: str = "default"  # "default", "fit", or "env:<keys set>"

    def items(self) -> list[tuple[str, int]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self) if f.name != "source"]


# Placeholders (see the module docstring for their provenance); fit-cost-model replaces them.
DEFAULTS = Coefficients(
    chunk_us=40_000,
    token_ns=48_000,
    pair_fs=50_000,
    topk_pair_ps=2_000,
    step_us=40_000,
    row_ns=500_000,
    kv_ps=2_000,
    topk_kv_ps=20_000,
    topk=2048,
)

_UNITS = {
    "chunk_us": "µs per prefill forward",
    "token_ns": "ns per prefill token",
    "pair_fs": "fs per causal attention pair",
    "topk_pair_ps": "ps per top-k attention pair",
    "step_us": "µs per decode step",
    "row_ns": "ns per decode row",
    "kv_ps": "ps per KV token read in decode",
    "topk_kv_ps": "ps per top-k KV token read in decode",
    "topk": "keys per query of the sparse attention; 0 = dense",
    "chunk_sched_us": "µs per prefill iteration besides its forward",
    "token_sched_ns": "ns per prefill token besides the forward",
    "step_sched_us": "µs per decode iteration besides its forward",
    "row_sched_ns": "ns per decode row besides the forward",
    "switch_us": "µs per window of alternating chunk and decode steps",
}
FORWARD_TERMS = ("chunk_us", "token_ns", "pair_fs", "topk_pair_ps", "step_us", "row_ns", "kv_ps", "topk_kv_ps")
WALL_TERMS = ("chunk_sched_us", "token_sched_ns", "step_sched_us", "row_sched_ns", "switch_us")


def key_name(field_name: str) -> str:
    return KEY_PREFIX + field_name.upper()


def from_config(values: Mapping[str, Any]) -> Coefficients:
    """Coefficients from parsed config values (keys not set keep their default)."""
    chosen = {name: values.get(key_name(name), default) for name, default in DEFAULTS.items()}
    set_keys = [name for name, _ in DEFAULTS.items() if values.get(key_name(name)) is not None]
    source = "default" if not set_keys else "env:" + ",".join(set_keys)
    coef = Coefficients(**{k: int(v) for k, v in chosen.items()}, source=source)
    if coef.step_us == 0 and coef.row_ns == 0:
        raise api.ConfigError(
            key_name("step_us"), "0", "a decode step with a cost: STEP_US or ROW_NS must be > 0"
        )
    return coef


def pairs(c: int, p: int) -> int:
    """Causal (query, key) pairs of a ``c``-token extend on a ``p``-token prefix."""
    return c * p + c * (c + 1) // 2


def topk_pairs(c: int, p: int, k: int) -> int:
    """``sum_{j=p+1}^{p+c} min(j, k)``: the same pairs with each query capped at ``k`` keys."""
    if k <= 0 or c <= 0:
        return 0
    end = p + c
    below = max(0, min(end, k) - p)  # queries j in (p, min(end, k)]: j keys each
    lo = p + 1
    tri = (lo + lo + below - 1) * below // 2 if below else 0
    return tri + (c - below) * k


def chunk_cost(rows: Iterable[tuple[int, int]], coef: Coefficients = DEFAULTS) -> int:
    """Cost in fs of one prefill forward; ``rows`` are its ``(extend_len, prefix_len)`` pairs."""
    total = (coef.chunk_us + coef.chunk_sched_us) * 10**9
    per_token = (coef.token_ns + coef.token_sched_ns) * 10**6
    for c, p in rows:
        total += per_token * c + coef.pair_fs * pairs(c, p)
        if coef.topk:
            total += coef.topk_pair_ps * 1000 * topk_pairs(c, p, coef.topk)
    return total


def step_cost(context_lens: Iterable[int], coef: Coefficients = DEFAULTS) -> int:
    """Cost in fs of one decode step over rows with these context lengths."""
    lens = list(context_lens)
    return decode_cost(len(lens), sum(lens), sum(min(n, coef.topk) for n in lens) if coef.topk else 0, coef)


def decode_cost(rows: int, kv_tokens: int, topk_kv_tokens: int, coef: Coefficients = DEFAULTS) -> int:
    """Cost in fs of one decode step from its sums (what forward-pass metrics carry)."""
    total = ((coef.step_us + coef.step_sched_us) * 10**9 + (coef.row_ns + coef.row_sched_ns) * 10**6 * rows
             + coef.kv_ps * 1000 * kv_tokens)
    if coef.topk:
        total += coef.topk_kv_ps * 1000 * topk_kv_tokens
    return total


def window_cost(rows: Iterable[tuple[int, int]], coef: Coefficients = DEFAULTS) -> int:
    """What a chunk-and-window cycle costs besides its decode steps: the chunk and the alternation."""
    return chunk_cost(rows, coef) + coef.switch_us * 10**9


def yield_steps(pct: int, chunk: int, step: int, floor: int = 0, cap: int = MAX_YIELD_STEPS) -> int:
    """``N = max(floor, min(cap, ceil(pct*chunk / ((100-pct)*step))))``, integers only."""
    return yield_window(pct, chunk, step, floor, 0, cap)[0]


def yield_window(
    pct: int, chunk: int, step: int, floor: int = 0, carry: int = 0, cap: int = MAX_YIELD_STEPS,
    rode_along: int = 0,
) -> tuple[int, int]:
    """``(N, carry)`` for one window, with the previous window's rounding surplus ``carry``.

    ``N = max(floor, min(cap, ceil((pct*chunk - 100*rode_along*step - carry) / ((100-pct)*step))))``:
    the ceil of the window formula less the decode time earlier windows of the same prompt gave
    beyond their share (``carry``, in fs scaled by ``100-pct``). Rounding each window up on its own
    overshoots by up to one decode step per chunk (with 64 streams a step is ~1/7 of a chunk:
    +0.03..0.05 of share); carrying the surplus keeps the prompt's total at its share, never below
    it. The returned carry is clamped to ``[0, one step)``: it carries rounding only, never a debt
    from the floor or the cap. The first window of a prompt (``carry == 0``) is the plain formula.

    ``rode_along`` is the decode tokens each row already got inside the chunk (1 under
    ``--enable-mixed-chunk``). The share is the rows' token rate over their rate alone, so over a
    chunk and its window ``(rode_along + N) * step = pct/100 * (chunk + N*step)``: without the
    credit, pct 50 on a chunk worth two steps gives the rows 3 tokens in 4 steps' time, 0.75.
    """
    den = (100 - pct) * max(step, 1)
    owed = pct * chunk - 100 * rode_along * max(step, 1)
    need = max(0, -(-(owed - carry) // den))
    n = max(floor, min(cap, need))
    left = carry + den * n - owed
    return n, min(max(left, 0), den - 1)


def profile_line(coef: Coefficients) -> str:
    """The ``KEY=VALUE`` words that select these coefficients (one profile line)."""
    return " ".join(f"{key_name(name)}={value}" for name, value in coef.items())
