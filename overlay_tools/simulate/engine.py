"""The replay: a trace's requests on one real cache, overlapping as they would on the engine.

What is SGLang's own: the ``UnifiedRadixCache`` (FULL + SWA), its allocators and pools, the match
(``match_kv_cache``), admission (a real ``PrefillAdder`` with the chunk tokens left in the batch and
the running batch, whose future decode tokens it reserves at the scheduler's ``new_token_ratio``:
SGLang's ``NewTokenRatioTracker`` at its defaults, decayed every decode step, reset when idle,
re-estimated after a retraction; with cone replay installed, its wrapped
``_select_prefill_admission``), every chunk checkpoint and the finished-turn release, eviction when a
pool runs short, the decode's capacity check (``check_decode_capacity``) and its sliding-window
release (``evict_sliding_windows`` at ``maybe_evict_swa``'s trigger: every ``SGLANG_SWA_EVICTION_INTERVAL``
tokens), the retracted request's release (``release_kv_cache`` without
insert, ``evict_from_tree_cache`` of its retract steps, ``reset_for_retract``), the eviction before an
allocation (``evict_from_tree_cache`` by SGLang's over-estimate: a prefill pass's extend plus a page per
request, a page per decoding request each decode step; :attr:`.cache_kit.CacheKit.alloc_headroom`),
and with HiCache attached its backups and the admission's load-back of host hits (:mod:`.cone_turn`'s
steps over :mod:`.cache_kit`). What is the simulation's: the clock and the batches.

The clock (a model, no forward runs): one iteration at a time, prefill first, as SGLang's scheduler
without mixed chunks or decode yield: a prefill batch continues the one chunked request, then
admits waiting requests in arrival order while chunk tokens are left (at most ``max_running``
requests hold rows); it costs ``cost_model.chunk_cost`` of its rows. With nothing to prefill,
decode steps run for every decoding request, ``cost_model.decode_cost`` each (steps between two
events are costed at their middle context length). Decode takes KV a page at a time as the
engine's paged decode allocation does: a request whose KV fills its last page needs a new one
before its next step; when the pool cannot give the step's pages after eviction, requests are
retracted in ``retract_decode``'s order (fewest output tokens first, then the longest prompt; one
always stays) and queued last (the scheduler's ``_add_request_to_queue`` appends them), to be
prefilled again (prompt + whole pages of their output). A turn of a session becomes ready when it
arrives and its parent has finished (an agent sends the next turn once it has the output). Running
requests hold their pages (the admission lock) while others arrive.
"""

from __future__ import annotations

import heapq
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from overlay_tools.simulate.cache_kit import OUTPUT_TOKEN
from overlay_tools.simulate.trace import Request, materialize

FS_PER_MS = 10**12

# What the replay's eviction before an allocation mirrors (SGLang's over-estimates) and calls, pinned
# like the overlay's own targets: a drifted one refuses the replay by name (:class:`ReplayRefused`).
PINS = {
    "sglang.srt.mem_cache.common:evict_from_tree_cache": (
        "7ce32fb173d53a7db266de99189248cdb067add9ca81474347c6bcaa6812fb58"),
    "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator.evict_to_free_tokens": (
        "5595cfa9461dca3f27a30623fcbd0ac281479a9ac922f9f3e2f113741c7a344a"),
    "sglang.srt.mem_cache.allocation:alloc_paged_token_slots_extend": (
        "bcc27737428c11af65bd57672ffd791b59b2c1c0078875ced8f99c06db359aa4"),
    "sglang.srt.mem_cache.allocation:alloc_paged_token_slots_decode": (
        "bc84c506c810373e2b1b78788fa98fd0d4d8992e2f86f14fbef21ab37059bfe3"),
    "sglang.srt.managers.schedule_batch:release_req": (
        "e9a690b5c7084bb5f69496e1b8e200a75a05db87a7232dc66bdbb5feba112c43"),
}


class ReplayRefused(RuntimeError):
    """Upstream code the replay mirrors drifted from its pin."""


def check_pins(pins: dict[str, str] | None = None) -> None:
    """Raise :class:`ReplayRefused` naming every drifted pin in ``pins`` (default :data:`PINS`)."""
    from adapter.core.pins import drifted

    found = drifted(PINS if pins is None else pins)
    if found:
        raise ReplayRefused(f"simulate's replay refused: {'; '.join(found)}")


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
    retractions: int = 0  # times the decode retracted it (the pool ran out)
    retracted_tokens: int = 0  # tokens its re-admissions prefilled again
    parked_tokens: int = 0  # with DSV41_KV_PARK: tokens its re-admissions restored from host instead

    @property
    def recomputed(self) -> int:
        return self.prompt - self.prefix

    @property
    def history_recomputed(self) -> int:
        return max(0, min(self.history, self.prompt) - self.prefix)


@dataclass
class Running:
    """A request admitted under the replay: its cone turn (``ct.req`` is the live ``Req``), the
    tokens it prefills (the prompt, plus whole pages of output after a retraction) and the output
    tokens it has sampled."""

    r: Request
    ct: Any
    turn: Turn
    prompt_len: int
    decoded: int
    readmitted: bool = False  # after a retraction
    page_end: int = 0  # the end of the row's pages (the prompt's, then one a page of decode)

    def __post_init__(self) -> None:
        self.page_end = self.page_end or self.prompt_len

    @property
    def left(self) -> int:
        """Decode steps left: the last output token is sampled, never run (prompt + output - 1 KV)."""
        return self.r.output_length - self.decoded

    @property
    def room(self) -> int:
        """Slots left in the row's last page past the committed KV (0: the next step needs a page).
        As SGLang's paged decode allocation: a page is taken at the boundary, its slots are used one
        a step (``kv_allocated_len`` stays the committed length)."""
        return self.page_end - self.ct.req.kv.kv_committed_len

    def sync_output(self) -> Any:
        """The live Req with its sampled tokens (what PrefillAdder's offset and the retraction order
        read), returned."""
        req = self.ct.req
        n = self.decoded - (self.prompt_len - self.r.prompt_len)
        if len(req.output_ids) != n:
            req.output_ids = array("q", [OUTPUT_TOKEN]) * n
        return req

    def step(self, steps: int) -> None:
        kv = self.ct.req.kv
        self.decoded += steps
        kv.kv_committed_len += steps
        kv.kv_allocated_len = kv.kv_committed_len


class Replay:
    """Runs ``requests`` on ``kit``; ``run()`` returns one :class:`Turn` per request (trace order)."""

    def __init__(self, kit: Any, requests: list[Request], *, chunk: int, max_running: int, coef: Any,
                 time_scale: float = 1.0, progress: Callable[[int], None] | None = None, kv_park: bool = False):
        check_pins()
        self.kit, self.requests, self.chunk, self.max_running = kit, requests, chunk, max_running
        self.coef, self.time_scale, self.progress = coef, time_scale, progress or (lambda n: None)
        self.by_index = {r.index: r for r in requests}
        self.kv_park = kv_park  # a retracted request's KV is parked on host and restored, not recomputed
        self.page = kit.geometry.page
        from sglang.srt.environ import envs
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker

        # The scheduler's new_token_ratio: SGLang's tracker at its defaults (conservativeness 1.0).
        init = min(envs.SGLANG_INIT_NEW_TOKEN_RATIO.get(), 1.0)
        low = min(init * envs.SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR.get(), 1.0)
        self.ratio = NewTokenRatioTracker(init=init, min=low, decay=(init - low) / envs.SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS.get(),
                                          current=init)
        self.retractions = 0
        self.events: list[dict[str, Any]] = []  # one a retraction: who, when (tokens decoded), the pool
        self.retracted: dict[int, tuple[int, Turn]] = {}  # trace index -> (output tokens kept, its turn)
        self.busy_fs = 0  # modelled time the instance computed (prefill passes and decode steps)
        self.prefill_busy_fs = 0  # ... of it, prefill passes
        arrivals = [self._arrival_fs(r) for r in requests]
        self.span_fs = max(arrivals) - min(arrivals) if arrivals else 0  # the trace's arrival span

    def _arrival_fs(self, r: Request) -> int:
        return int(r.arrival_ms * self.time_scale * FS_PER_MS)

    def run(self) -> list[Turn]:
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        from adapter.switches.decode_yield import cost_model
        from overlay_tools.simulate import cone_turn as cone

        kit = self.kit
        turns: dict[int, Turn] = {}
        ready: list[tuple[int, int]] = []  # (ready time, trace index)
        for r in self.requests:
            if r.parent not in self.by_index:
                heapq.heappush(ready, (self._arrival_fs(r), r.index))
        waiting: deque[tuple[int, Request]] = deque()
        chunked: Running | None = None
        decoding: list[Running] = []
        t, done = 0, 0

        def finished(r: Request, at: int) -> None:
            nonlocal done
            done += 1
            self.progress(done)
            for child in r.children:
                c = self.by_index.get(child)
                if c is not None:
                    heapq.heappush(ready, (max(at, self._arrival_fs(c)), c.index))

        while ready or waiting or chunked or decoding:
            # HiCache: the copies the last pass queued have landed (the scheduler's
            # check_hicache_events each pass); a node stays locked while its backup is in flight.
            kit.sync_hicache()
            while ready and ready[0][0] <= t:
                at, i = heapq.heappop(ready)
                waiting.append((at, self.by_index[i]))
            if not (waiting or chunked or decoding):
                self.ratio.reset()  # the scheduler's idle pass
                t = ready[0][0]
                continue
            rows: list[tuple[int, int]] = []
            budget = self.chunk
            pending_done: list[Running] = []
            # Eviction before each allocation of this pass as SGLang's alloc_paged_token_slots_extend
            # over-estimates it: the pass's extend plus a page for each of its requests so far.
            kit.alloc_headroom = self.page
            # The pass's chunks are published (checkpointed) after its admissions, as the scheduler
            # inserts them after the forward: a request admitted now never matches them.
            checkpoints: list[Callable[[], None]] = []
            if chunked is not None:
                x = chunked
                start = x.ct.pos
                end = min(x.prompt_len, start + budget)
                cone.prefill_pass(kit, x.ct, end, defer=checkpoints)
                rows.append((end - start, start))
                x.turn.prefill_fs += cost_model.chunk_cost([(end - start, start)], self.coef)
                budget -= end - start
                if x.ct.pos >= x.prompt_len:
                    chunked = None
                    pending_done.append(x)
            while waiting and budget > 0 and chunked is None and len(decoding) + len(pending_done) < self.max_running:
                at, r = waiting[0]
                again = self.retracted.get(r.index)  # (decoded tokens kept, the turn) of a retracted request
                decoded = again[0] if again else 0
                tokens = materialize(r.prompt)
                if decoded:
                    tokens.extend([OUTPUT_TOKEN] * decoded)
                probe = self._probe(r, tokens) if again is None else (False, False)
                loaded_before = kit.loaded_from_host
                # The running batch's future decode tokens are reserved (PrefillAdder's offset at
                # the scheduler's new_token_ratio): the decoding requests, and those admitted or
                # chunked in this pass (they join the running batch after it).
                batch = [y.sync_output() for y in (*decoding, *pending_done)]
                kit.alloc_headroom = (len(pending_done) + (chunked is not None) + 1) * self.page
                ct = cone.start_turn(kit, tokens, r.output_length - decoded, self.chunk, budget=budget,
                                     rid=f"t{r.index}" + (f"r{self.retractions}" if again else ""),
                                     running_batch=ScheduleBatch(reqs=batch), new_token_ratio=self.ratio.current,
                                     defer=checkpoints)
                if ct is None:
                    if decoding or pending_done or rows:
                        break  # memory: wait for running requests to finish
                    waiting.popleft()  # nothing runs and it still does not fit: it never will
                    if again is None:
                        turns[r.index] = self._turn(r, None, at, skipped=True)
                    else:
                        again[1].skipped = True
                    finished(r, t)
                    continue
                waiting.popleft()
                first = ct.pos - ct.prefix_len
                if again is None:
                    turn = turns[r.index] = self._turn(r, ct, at)
                    turn.full_lost, turn.window_lost = probe
                    turn.loaded = kit.loaded_from_host - loaded_before
                else:
                    del self.retracted[r.index]
                    turn = again[1]
                    if self.kv_park:  # restored from host: its pages are back, nothing is prefilled
                        turn.parked_tokens += len(tokens) - ct.prefix_len
                    else:
                        turn.retracted_tokens += len(tokens) - ct.prefix_len  # the re-prefill
                if again is None or not self.kv_park:
                    rows.append((first, ct.prefix_len))
                    turn.prefill_fs += cost_model.chunk_cost([(first, ct.prefix_len)], self.coef)
                budget -= first
                x = Running(r, ct, turn, len(tokens), decoded, readmitted=again is not None)
                if again is not None and self.kv_park:  # the restore puts every page back at once
                    while ct.pos < len(tokens):
                        cone.prefill_pass(kit, ct, min(len(tokens), ct.pos + self.chunk), defer=checkpoints)
                if ct.pos < len(tokens):
                    chunked = x
                else:
                    pending_done.append(x)
            kit.alloc_headroom = 0
            for publish in checkpoints:
                publish()
            if rows or pending_done:
                cost = cost_model.chunk_cost(rows, self.coef) if rows else 0
                t += cost
                self.busy_fs += cost
                self.prefill_busy_fs += cost
                for x in pending_done:
                    if not x.readmitted:
                        x.turn.first_token_fs = t
                    x.decoded += 1  # the prefill samples a token
                    decoding.append(x)
                self._finish_ready(decoding, finished, t)
                continue
            if not decoding:
                # A waiting request that cannot be admitted while nothing runs was skipped above;
                # with a chunked request the loop always prefills. Nothing else can stall here.
                raise RuntimeError("simulate: no progress (waiting requests but no batch)")
            for x in self._grow(decoding):  # a page for each request at a page boundary, or retraction
                waiting.append((x.turn.ready_fs, x.r))  # behind the waiting, as _add_request_to_queue does
            steps = min(min(x.left for x in decoding), min(x.room for x in decoding),
                        min(self._swa_due_in(x) for x in decoding))
            step_fs = self._step_fs(decoding, 0)
            if ready and not waiting:
                steps = min(steps, max(1, -(-(ready[0][0] - t) // max(step_fs, 1))))
            steps = max(1, steps)
            if steps > 1:  # the steps after a page step evict again for the batch (alloc_for_decode)
                kit.reserve(len(decoding) * self.page)
            cost = steps * self._step_fs(decoding, steps // 2)
            t += cost
            self.busy_fs += cost
            for x in decoding:
                x.step(steps)
            for _ in range(steps):
                self.ratio.decay_step()
            self._finish_ready(decoding, finished, t)
        out = [turns[r.index] for r in self.requests]
        return out

    def _grow(self, decoding: list[Running]) -> list[Running]:
        """Before a decode step: every request whose KV fills its last page gets a new one (SGLang's
        ``new_tokens_required_next_decode``); when the pool cannot give them after eviction
        (``check_decode_capacity``), requests are retracted in ``retract_decode``'s order (fewest
        output tokens first, then the longest prompt; at least one stays) and released as
        ``release_req`` does (no insert), and ``new_token_ratio`` is re-estimated from those left.
        Returns the retracted, in ``retract_decode``'s order, to be queued last. Out-of-window SWA
        of the running requests is released as ``maybe_evict_swa`` does."""
        from sglang.srt.environ import envs
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker
        from sglang.srt.mem_cache.common import release_kv_cache

        kit, page = self.kit, self.page
        due = self._swa_trigger()
        for x in decoding:
            x.sync_output()
            if due(x.ct.req):
                kit.cache.evict_sliding_windows(x.ct.req, x.ct.req.seqlen - 1, eviction_interval=1)
        retracted: list[Running] = []

        def need(batch: list[Running]) -> int:
            return page * sum(x.room == 0 for x in batch)

        if need(decoding) and not kit.allocator.check_decode_capacity(num_tokens=need(decoding), tree_cache=kit.cache):
            order = sorted(decoding, key=lambda x: (len(x.ct.req.output_ids), -len(x.ct.req.origin_input_ids)),
                           reverse=True)
            while len(order) > 1 and not kit.allocator.check_decode_capacity(num_tokens=need(order),
                                                                                tree_cache=kit.cache):
                demand = need(order)
                x = order.pop()
                self.events.append({"retracted": x.r.index, "decoded": x.decoded, "need": demand,
                                    "free": kit.allocator.full_available_size(),
                                    "running": {y.r.index: y.decoded for y in order}})
                req = x.ct.req
                release_kv_cache(req, kit.cache, checkpoint=False)
                kit.reserve(len(order) * envs.SGLANG_RETRACT_DECODE_STEPS.get())  # release_req's eviction
                req.reset_for_retract()
                x.ct.req = None
                self.retractions += 1
                x.turn.retractions += 1
                kept = x.decoded // page * page  # re-prefilled as prompt + whole pages of output
                self.retracted[x.r.index] = (kept, x.turn)
                retracted.append(x)
            decoding[:] = [x for x in decoding if x.ct.req is not None]
            self.ratio.current = NewTokenRatioTracker.estimate_new_token_ratio_after_retract(
                [x.ct.req for x in decoding])
        kit.reserve(len(decoding) * page)  # alloc_for_decode: a page for every request, over-estimated
        for x in decoding:
            if x.room == 0:
                req = x.ct.req
                kit.pool.write((req.kv.req_pool_idx, slice(x.page_end, x.page_end + page)), kit.alloc_pages(page))
                x.page_end += page
        return retracted

    def _swa_trigger(self) -> Callable[[Any], bool]:
        """``maybe_evict_swa``'s per-request trigger (SGLang's own): a decoding request's
        out-of-window SWA is freed once ``SGLANG_SWA_EVICTION_INTERVAL`` tokens have slid out."""
        from sglang.srt.environ import envs
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        interval = max(1, envs.SGLANG_SWA_EVICTION_INTERVAL.get())
        return ScheduleBatch._swa_eviction_trigger(None, self.kit.cache.swa_retain_window, interval)

    def _swa_due_in(self, x: Running) -> int:
        """Decode steps until the trigger fires for ``x`` (a batch of steps stops there)."""
        from sglang.srt.environ import envs
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

        req = x.ct.req
        interval = max(1, envs.SGLANG_SWA_EVICTION_INTERVAL.get())
        fires_at = req.kv.get_evicted_seqlen(ComponentType.SWA) + interval + self.kit.cache.swa_retain_window + 1
        return fires_at - req.seqlen

    def _finish_ready(self, decoding: list[Running], finished: Callable[[Request, int], None], t: int) -> None:
        from overlay_tools.simulate import cone_turn as cone

        still = []
        for x in decoding:
            if x.left <= 0:
                req = x.ct.req
                # What the tree gets: prompt + output - 1 tokens of KV (the last sampled token never ran)
                req.output_ids = array("q", [OUTPUT_TOKEN]) * (x.r.output_length - (x.prompt_len - x.r.prompt_len))
                cone.finish(self.kit, req)
                x.ct.req = None
                finished(x.r, t)
            else:
                still.append(x)
        decoding[:] = still

    def _step_fs(self, decoding: list[Running], ahead: int) -> int:
        from adapter.switches.decode_yield import cost_model

        k = self.coef.topk
        lens = [x.ct.req.kv.kv_committed_len + ahead for x in decoding]
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

    from overlay_tools.simulate.cache_kit import OUTPUT_TOKEN

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
