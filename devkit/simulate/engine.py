"""The replay: a trace's requests on one real cache, overlapping as they would on the engine.

What is SGLang's own: the ``UnifiedRadixCache`` (FULL + SWA), its allocators and pools, the match
(``match_kv_cache``), admission (a real ``PrefillAdder`` with the chunk tokens left in the batch;
with cone replay installed, its wrapped ``_select_prefill_admission``), every chunk checkpoint and
the finished-turn release, eviction when a pool runs short, and with HiCache attached its backups
and the admission's load-back of host hits (``devkit.testkit.cone``'s turn steps over
``devkit.testkit.radix_cache``). What is the simulation's: the clock and the batches.

The clock (a model, no forward runs): one iteration at a time, prefill first, as SGLang's scheduler
without mixed chunks or decode yield: a prefill batch continues the one chunked request, then
admits waiting requests in arrival order while chunk tokens are left (at most ``max_running``
requests hold rows); it costs ``cost_model.chunk_cost`` of its rows. With nothing to prefill,
decode steps run for every decoding request, ``cost_model.decode_cost`` each (steps between two
events are costed at their middle context length). A turn of a session becomes ready when it
arrives and its parent has finished (an agent sends the next turn once it has the output).
Running requests hold their pages (the admission lock) while others arrive; the output's KV is
written when the request finishes.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from devkit.simulate.trace import Request, materialize

FS_PER_MS = 10**12


@dataclass
class Turn:
    """One request's figures under one policy."""

    index: int
    continuation: bool
    prompt: int  # page-rounded prompt tokens
    history: int  # the parent's history (prompt + output) this prompt starts with; 0 for a first turn
    resume_at: int  # the parent's resume point: page_floor(history), at most the longest match allowed
    stock_prefix: int  # P: what the match gave before any cone
    prefix: int  # the prefix the turn ran from (s on a cone)
    cone: bool  # a cone plan was admitted
    full_lost: bool = False  # at admission, the Full KV of [0, resume_at) was no longer all resident
    window_lost: bool = False  # ... it was, but the SWA window before resume_at had holes (what a cone can replay)
    loaded: int = 0  # HiCache: prefix tokens the admission loaded back from host (part of ``prefix``)
    ready_fs: int = 0
    first_token_fs: int = 0
    prefill_fs: int = 0  # modelled cost of this request's own rows (each pass priced alone)
    skipped: bool = False  # the pool cannot hold it even with nothing running

    @property
    def recomputed(self) -> int:
        return self.prompt - self.prefix

    @property
    def history_recomputed(self) -> int:
        return max(0, min(self.history, self.prompt) - self.prefix)


class Replay:
    """Runs ``requests`` on ``kit``; ``run()`` returns one :class:`Turn` per request (trace order)."""

    def __init__(self, kit: Any, requests: list[Request], *, chunk: int, max_running: int, coef: Any,
                 time_scale: float = 1.0, progress: Callable[[int], None] | None = None):
        self.kit, self.requests, self.chunk, self.max_running = kit, requests, chunk, max_running
        self.coef, self.time_scale, self.progress = coef, time_scale, progress or (lambda n: None)
        self.by_index = {r.index: r for r in requests}
        self.page = kit.geometry.page
        self.busy_fs = 0  # modelled time the instance computed (prefill passes and decode steps)
        self.prefill_busy_fs = 0  # ... of it, prefill passes
        arrivals = [self._arrival_fs(r) for r in requests]
        self.span_fs = max(arrivals) - min(arrivals) if arrivals else 0  # the trace's arrival span

    def _arrival_fs(self, r: Request) -> int:
        return int(r.arrival_ms * self.time_scale * FS_PER_MS)

    def run(self) -> list[Turn]:
        from adapter.switches.decode_yield import cost_model
        from devkit.testkit import cone

        kit = self.kit
        turns: dict[int, Turn] = {}
        ready: list[tuple[int, int]] = []  # (ready time, trace index)
        for r in self.requests:
            if r.parent not in self.by_index:
                heapq.heappush(ready, (self._arrival_fs(r), r.index))
        waiting: deque[tuple[int, Request]] = deque()
        chunked: tuple[Request, Any, Turn] | None = None
        decoding: list[list[Any]] = []  # [request, cone turn, steps left, context length]
        t, done = 0, 0

        def finished(r: Request, at: int) -> None:
            nonlocal done
            done += 1
            self.progress(done)
            for child in r.children:
                c = self.by_index.get(child)
                if c is not None:
                    heapq.heappush(ready, (max(at, self._arrival_fs(c)), c.index))

        def prefilled(r: Request, ct: Any, turn: Turn) -> None:
            turn.first_token_fs = t
            decoding.append([r, ct, max(0, r.output_length - 1), r.prompt_len])

        while ready or waiting or chunked or decoding:
            # HiCache: the copies the last pass queued have landed (the scheduler's
            # check_hicache_events each pass); a node stays locked while its backup is in flight.
            kit.sync_hicache()
            while ready and ready[0][0] <= t:
                at, i = heapq.heappop(ready)
                waiting.append((at, self.by_index[i]))
            if not (waiting or chunked or decoding):
                t = ready[0][0]
                continue
            rows: list[tuple[int, int]] = []
            budget = self.chunk
            if chunked is not None:
                r, ct, turn = chunked
                start = ct.pos
                end = min(r.prompt_len, start + budget)
                cone.prefill_pass(kit, ct, end)
                rows.append((end - start, start))
                turn.prefill_fs += cost_model.chunk_cost([(end - start, start)], self.coef)
                budget -= end - start
                if ct.pos >= r.prompt_len:
                    chunked = None
                    pending_done = [(r, ct, turn)]
                else:
                    pending_done = []
            else:
                pending_done = []
            while waiting and budget > 0 and chunked is None and len(decoding) + len(pending_done) < self.max_running:
                at, r = waiting[0]
                tokens = materialize(r.prompt)
                probe = self._probe(r, tokens)
                loaded_before = kit.loaded_from_host
                ct = cone.start_turn(kit, tokens, r.output_length, self.chunk, budget=budget, rid=f"t{r.index}")
                if ct is None:
                    if decoding or pending_done or rows:
                        break  # memory: wait for running requests to finish
                    waiting.popleft()  # nothing runs and it still does not fit: it never will
                    turns[r.index] = self._turn(r, None, at, skipped=True)
                    finished(r, t)
                    continue
                waiting.popleft()
                turn = turns[r.index] = self._turn(r, ct, at)
                turn.full_lost, turn.window_lost = probe
                turn.loaded = kit.loaded_from_host - loaded_before
                first = ct.pos - ct.prefix_len
                rows.append((first, ct.prefix_len))
                turn.prefill_fs += cost_model.chunk_cost([(first, ct.prefix_len)], self.coef)
                budget -= first
                if ct.pos < r.prompt_len:
                    chunked = (r, ct, turn)
                else:
                    pending_done.append((r, ct, turn))
            if rows:
                cost = cost_model.chunk_cost(rows, self.coef)
                t += cost
                self.busy_fs += cost
                self.prefill_busy_fs += cost
                for r, ct, turn in pending_done:
                    prefilled(r, ct, turn)
                self._finish_ready(decoding, finished, t)
                continue
            if not decoding:
                # A waiting request that cannot be admitted while nothing runs was skipped above;
                # with a chunked request the loop always prefills. Nothing else can stall here.
                raise RuntimeError("simulate: no progress (waiting requests but no batch)")
            steps = min(d[2] for d in decoding)
            step_fs = self._step_fs(decoding, 0)
            if ready and not waiting:
                steps = min(steps, max(1, -(-(ready[0][0] - t) // max(step_fs, 1))))
            steps = max(1, steps)
            cost = steps * self._step_fs(decoding, steps // 2)
            t += cost
            self.busy_fs += cost
            for d in decoding:
                d[2] -= steps
                d[3] += steps
            self._finish_ready(decoding, finished, t)
        out = [turns[r.index] for r in self.requests]
        return out

    def _finish_ready(self, decoding: list[list[Any]], finished: Callable[[Request, int], None], t: int) -> None:
        from devkit.testkit import cone

        still = []
        for d in decoding:
            if d[2] <= 0:
                cone.end_turn(self.kit, d[1], d[0].out_tokens, history=False)
                finished(d[0], t)
            else:
                still.append(d)
        decoding[:] = still

    def _step_fs(self, decoding: list[list[Any]], ahead: int) -> int:
        from adapter.switches.decode_yield import cost_model

        k = self.coef.topk
        lens = [d[3] + ahead for d in decoding]
        return cost_model.decode_cost(len(lens), sum(lens), sum(min(n, k) for n in lens) if k else 0, self.coef)

    def _probe(self, r: Request, tokens: Any) -> tuple[bool, bool]:
        """(Full KV lost, only the window lost) at the parent's resume point, read-only (no LRU touch)."""
        parent = self.by_index.get(r.parent) if r.parent is not None else None
        if parent is None:
            return False, False
        resume_at = self._resume_at(r, parent)
        if resume_at == 0:
            return False, False
        state = self.kit.resume_state(tokens[:resume_at])
        full_lost = state["full_resident"] < resume_at
        return full_lost, not full_lost and bool(state["swa_window_holes"])

    def _resume_at(self, r: Request, parent: Request) -> int:
        # The match never covers a whole prompt (one token must run): the resume point is at most
        # the page floor of prompt - 1.
        history = min(parent.history_len, r.prompt_len)
        return min(history // self.page * self.page, (r.prompt_len - 1) // self.page * self.page)

    def _turn(self, r: Request, ct: Any, ready_fs: int, skipped: bool = False) -> Turn:
        parent = self.by_index.get(r.parent) if r.parent is not None else None
        history = min(parent.history_len, r.prompt_len) if parent is not None else 0
        resume_at = self._resume_at(r, parent) if parent is not None else 0
        if ct is None:
            return Turn(r.index, parent is not None, r.prompt_len, history, resume_at, 0, 0, False, ready_fs=ready_fs,
                        skipped=skipped)
        return Turn(r.index, parent is not None, r.prompt_len, history, resume_at, ct.stock_prefix, ct.prefix_len,
                    ct.plan is not None, ready_fs=ready_fs)


def ideal_prefixes(requests: list[Request], page: int) -> dict[int, int]:
    """The prefix each request would match in an infinite cache holding every earlier request's
    prompt and output (trace order), capped like a real match (one token must run). Pages are
    keyed by a hash chain over their token bytes."""
    from array import array

    from devkit.testkit.radix_cache import OUTPUT_TOKEN

    out_page = array("q", [OUTPUT_TOKEN] * page).tobytes()
    seen: set[int] = set()
    out: dict[int, int] = {}
    for r in requests:
        tokens = materialize(r.prompt)
        limit = (len(tokens) - 1) // page
        key, matched = 0, 0
        keys = []
        for p in range(len(tokens) // page):
            key = hash((key, tokens[p * page:(p + 1) * page].tobytes()))
            keys.append(key)
            if matched == p and p < limit and key in seen:
                matched = p + 1
        out[r.index] = matched * page
        seen.update(keys)
        for _ in range(r.out_tokens // page):  # the output extends the history the next turn starts with
            key = hash((key, out_page))
            seen.add(key)
    return out


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    return fn(), time.perf_counter() - start
