"""The integer cost model of a forward pass: one formula, its coefficients in one place, no clock.

Shared by decode yield (``DSV41_DECODE_YIELD_MODE=model``, the open loop, and a boot's first windows
in measured mode, before anything is measured), ``fit-cost-model`` (which fits its coefficients),
``simulate`` and the benches' modelled time; its keys are decode yield's. Every input is replicated scheduler state and every term a Python ``int``,
so every TP rank computes the same window. Costs in femtoseconds (one forward)::

    pairs(c, p)      = c*p + c*(c+1)//2             # causal (query, key) pairs of a c-token extend on prefix p
    topk_pairs(c, p) = sum_{j=p+1}^{p+c} min(j, K)  # each query capped at K keys (sparse top-k)
    chunk_fs = (CHUNK_US + CHUNK_SCHED_US)*10**9 + sum over extend rows (c, p) of
               ((TOKEN_NS + TOKEN_SCHED_NS)*10**6*c + PAIR_FS*pairs + TOPK_PAIR_PS*1000*topk_pairs)
    step_fs  = (STEP_US + STEP_SCHED_US)*10**9 + (ROW_NS + ROW_SCHED_NS)*10**6*B + KV_PS*1000*sum(L_i)
               + TOPK_KV_PS*1000*sum(min(L_i, K))
    N        = max(floor, min(128, ceil((pct*(chunk_fs + SWITCH_US*10**9) - carry) / ((100-pct)*step_fs))))

``*_SCHED_*`` and ``SWITCH_US`` (the alternation, once per window) are what an iteration costs besides
its forward; ``fit-cost-model`` fits all of them from forward-pass metrics. :data:`DEFAULTS` are
placeholders shaped to one fleet figure (an 8192-token chunk about 11.5 decode steps of 16 streams,
DSV4-style attention, top-k 2048), not a measurement.
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


DEFAULTS = Coefficients(chunk_us=40_000, token_ns=48_000, pair_fs=50_000, topk_pair_ps=2_000, step_us=40_000,
                        row_ns=500_000, kv_ps=2_000, topk_kv_ps=20_000, topk=2048)

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
    """``(N, carry)`` for one window: the ceil of the formula less ``carry``, the decode time the
    prompt's earlier windows gave beyond their share (fs scaled by ``100-pct``), so rounding each
    window up does not drift the share; the carry returned is clamped to ``[0, one step)``, rounding
    only, never a floor's or a cap's debt. ``rode_along``: decode tokens each row already got inside
    the chunk (1 under ``--enable-mixed-chunk``), credited at a step each."""
    den = (100 - pct) * max(step, 1)
    owed = pct * chunk - 100 * rode_along * max(step, 1)
    need = max(0, -(-(owed - carry) // den))
    n = max(floor, min(cap, need))
    left = carry + den * n - owed
    return n, min(max(left, 0), den - 1)


def profile_line(coef: Coefficients) -> str:
    """The ``KEY=VALUE`` words that select these coefficients (one profile line)."""
    return " ".join(f"{key_name(name)}={value}" for name, value in coef.items())
