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
admits waiting requests in arrival order while chunk tokens and ``--max-prefill-tokens`` (the
adder's ``rem_input_tokens``: no request is admitted once the pass's extends reach it) are left (at
most ``max_running`` requests hold rows); it costs ``cost_model.chunk_cost`` of its rows. With nothing to prefill,
decode steps run for every decoding request, ``cost_model.decode_cost`` each (steps between two
events are costed at their middle context length). Decode takes KV a page at a time as the
engine's paged decode allocation does: a request whose KV fills its last page needs a new one
before its next step; when the pool cannot give the step's pages after eviction, requests are
retracted in ``retract_decode``'s order (fewest output tokens first, then the longest prompt; one
always stays) and queued last, as the scheduler's ``_add_request_to_queue`` appends them, to be prefilled again (prompt + whole pages of their output). A
turn of a session becomes ready when it arrives and its parent has finished (an agent sends the
next turn once it has the output). Running requests hold their pages (the admission lock) while
others arrive.
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
    "sglang.srt.managers.scheduler:Scheduler.init_req_max_new_tokens": (
        "ea5d8cf1e6bf45ac74c991156882153117a19c9ddb2e97466eed48ec91cfe6a8"),
    "sglang.srt.mem_cache.allocator.base:BaseTokenToKVPoolAllocator.max_new_tokens_for_memory": (
        "69701e5fec1eb452aee8cc95f4cb6d01a3e39d1407d66adb80f0d3ae92432187"),
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
    out_len: int  # the output it decodes: the trace's, clipped as the scheduler clips max_new_tokens
    readmitted: bool = False  # after a retraction
    page_end: int = 0  # the end of the row's pages (the prompt's, then one a page of decode)

    def __post_init__(self) -> None:
        self.page_end = self.page_end or self.prompt_len

    @property
    def left(self) -> int:
        """Decode steps left: the last output token is sampled, never run (prompt + output - 1 KV)."""
        return self.out_len - self.decoded

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
                 time_scale: float = 1.0, progress: Callable[[int], None] | None = None, kv_park: bool = False,
                 max_prefill_tokens: int = 1 << 30, context_len: int | None = None):
        check_pins()
        self.max_prefill_tokens = max_prefill_tokens  # a pass admits no request once its extends reach it
        self.out_len = {r.index: self._max_new_tokens(kit, r, context_len) for r in requests}
        self.clipped = sum(self.out_len[r.index] < r.output_length for r in requests)
        # --enable-session-radix-cache: each session's id, and its turns not finished yet (the
        # client closes a session once its last turn in the trace has finished)
        self.sessions = kit.cache.enable_session_radix_cache
        self.open_turns: dict[int, int] = {}
        for r in requests:
            self.open_turns[r.session] = self.open_turns.get(r.session, 0) + 1
        self.closed_sessions = 0
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

    @staticmethod
    def _max_new_tokens(kit: Any, r: Request, context_len: int | None) -> int:
        """The output a request decodes: its ``output_length``, clipped as the scheduler's
        ``init_req_max_new_tokens`` clips ``max_new_tokens`` (within ``max_req_len`` = the context
        length and the Full pool, each less one, then the allocator's
        ``max_new_tokens_for_memory`` on an empty pool). A request the pool cannot hold at all stays
        at its length (the adder then never admits it: skipped)."""
        full = kit.geometry.full_tokens
        max_req_len = min(full, context_len or full) - 1
        wanted = max(0, min(r.output_length, max_req_len - r.prompt_len - 1))
        clipped = kit.allocator.max_new_tokens_for_memory(r.prompt_len, wanted, token_capacity=full,
                                                          sliding_window_size=kit.geometry.window,
                                                          chunk_size=kit.geometry.chunk)
        return clipped or r.output_length  # 0 or None: SGLang aborts it; at its length the adder never admits it

    def _arrival_fs(self, r: Request) -> int:
        return int(r.arrival_ms * self.time_scale * FS_PER_MS)

    def run(self) -> list[Turn]:
        """The whole replay: every first turn arrives on the trace's clock, every later turn when it
        has arrived and its parent has finished."""
        self.start(external=False)
        while self.busy():
            self.step()
        return [self.turns[r.index] for r in self.requests]

    def start(self, external: bool = False) -> None:
        """Reset the run's state. ``external``: requests arrive only by :meth:`submit` (a router in
        front), and finished ones are listed in :attr:`finished_log` instead of readying children."""
        self.external = external
        self.turns: dict[int, Turn] = {}
        self.ready: list[tuple[int, int]] = []  # (ready time, trace index)
        self.waiting: deque[tuple[int, Request]] = deque()
        self.chunked: Running | None = None
        self.decoding: list[Running] = []
        self.t, self.done = 0, 0
        self.decoded_tokens = 0  # output tokens sampled so far (the instance's generation counter)
        self.finished_log: list[tuple[int, int]] = []  # (trace index, finish time): external runs
        if not external:
            for r in self.requests:
                if r.parent not in self.by_index:
                    heapq.heappush(self.ready, (self._arrival_fs(r), r.index))

    def submit(self, r: Request, at_fs: int) -> None:
        """A request routed to this instance at ``at_fs`` (external runs): it is ready then."""
        heapq.heappush(self.ready, (at_fs, r.index))
        if not (self.waiting or self.chunked or self.decoding) and self.t < at_fs:
            self.t = at_fs

    def busy(self) -> bool:
        return bool(self.ready or self.waiting or self.chunked or self.decoding)

    def _finished(self, r: Request, at: int) -> None:
        self.done += 1
        self.progress(self.done)
        self.open_turns[r.session] -= 1
        if self.sessions and not self.open_turns[r.session]:  # close: the session is only dereferenced
            self.kit.cache.release_radix_session(session_id(r))
            self.closed_sessions += 1
        if self.external:
            self.finished_log.append((r.index, at))
            return
        for child in r.children:
            c = self.by_index.get(child)
            if c is not None:
                heapq.heappush(self.ready, (max(at, self._arrival_fs(c)), c.index))

    def step(self, horizon: int | None = None) -> None:
        """One scheduler iteration: a prefill pass, or decode steps up to the next ready request (or
        ``horizon``, the router's next event, in an external run); idle, a jump to the next ready one."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        from adapter import cost_model
        from overlay_tools.simulate import cone_turn as cone

        kit, turns, ready, waiting, decoding = self.kit, self.turns, self.ready, self.waiting, self.decoding
        finished = self._finished
        # HiCache: the copies the last pass queued have landed (the scheduler's
        # check_hicache_events each pass); a node stays locked while its backup is in flight.
        kit.sync_hicache()
        while ready and ready[0][0] <= self.t:
            at, i = heapq.heappop(ready)
            waiting.append((at, self.by_index[i]))
        if not (waiting or self.chunked or decoding):
            self.ratio.reset()  # the scheduler's idle pass
            if ready:
                self.t = ready[0][0]
            return
        chunked, t = self.chunked, self.t

        rows: list[tuple[int, int]] = []
        budget = self.chunk
        input_left = self.max_prefill_tokens  # PrefillAdder's rem_input_tokens (--max-prefill-tokens)
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
            input_left -= -(-(end - start) // self.page) * self.page  # add_chunked_req: the page-ceiled extend
            if x.ct.pos >= x.prompt_len:
                chunked = None
                pending_done.append(x)
        while (waiting and budget > 0 and input_left > 0 and chunked is None
               and len(decoding) + len(pending_done) < self.max_running):
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
            ct = cone.start_turn(kit, tokens, self.out_len[r.index] - decoded, self.chunk, budget=budget,
                                 rid=f"t{r.index}" + (f"r{self.retractions}" if again else ""),
                                 running_batch=ScheduleBatch(reqs=batch), new_token_ratio=self.ratio.current,
                                 input_budget=input_left,
                                 session_id=session_id(r) if self.sessions else None, defer=checkpoints)
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
            input_left = ct.rem_input_tokens
            x = Running(r, ct, turn, len(tokens), decoded, self.out_len[r.index], readmitted=again is not None)
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
            self.chunked, self.t = chunked, t
            return
        if not decoding:
            # A waiting request that cannot be admitted while nothing runs was skipped above;
            # with a chunked request the loop always prefills. Nothing else can stall here.
            raise RuntimeError("simulate: no progress (waiting requests but no batch)")
        for x in self._grow(decoding):  # a page for each request at a page boundary, or retraction
            waiting.append((x.turn.ready_fs, x.r))  # behind the waiting, as _add_request_to_queue does
        steps = min(min(x.left for x in decoding), min(x.room for x in decoding),
                    min(self._swa_due_in(x) for x in decoding))
        step_fs = self._step_fs(decoding, 0)
        until = [] if horizon is None else [horizon]  # decode no further than the next arrival or event
        if ready and not waiting:
            until.append(ready[0][0])
        if until:
            steps = min(steps, max(1, -(-(min(until) - t) // max(step_fs, 1))))
        steps = max(1, steps)
        if steps > 1:  # the steps after a page step evict again for the batch (alloc_for_decode)
            kit.reserve(len(decoding) * self.page)
        cost = steps * self._step_fs(decoding, steps // 2)
        t += cost
        self.busy_fs += cost
        self.decoded_tokens += steps * len(decoding)
        for x in decoding:
            x.step(steps)
        for _ in range(steps):
            self.ratio.decay_step()
        self._finish_ready(decoding, finished, t)
        self.chunked, self.t = chunked, t

    def _grow(self, decoding: list[Running]) -> list[Running]:
        """Before a decode step: every request whose KV fills its last page gets a new one (SGLang's
        ``new_tokens_required_next_decode``); when the pool cannot give them after eviction
        (``check_decode_capacity``), requests are retracted in ``retract_decode``'s order (fewest
        output tokens first, then the longest prompt; at least one stays) and released as
        ``release_req`` does (no insert), and ``new_token_ratio`` is re-estimated from those left.
        Returns the retracted, in ``retract_decode``'s order, to be queued last. Out-of-window SWA of the running requests is
        released as ``maybe_evict_swa`` does."""
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
                req.output_ids = array("q", [OUTPUT_TOKEN]) * (x.out_len - (x.prompt_len - x.r.prompt_len))
                cone.finish(self.kit, req)
                x.ct.req = None
                finished(x.r, t)
            else:
                still.append(x)
        decoding[:] = still

    def _step_fs(self, decoding: list[Running], ahead: int) -> int:
        from adapter import cost_model

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
        history = r.inherited
        return min(history // self.page * self.page, (r.prompt_len - 1) // self.page * self.page)

    def _turn(self, r: Request, ct: Any, ready_fs: int, skipped: bool = False) -> Turn:
        parent = self.by_index.get(r.parent) if r.parent is not None else None
        history = r.inherited if parent is not None else 0  # the parent's history the prompt starts with
        resume_at = self._resume_at(r, parent) if parent is not None else 0
        if ct is None:
            return Turn(r.index, parent is not None, r.prompt_len, history, resume_at, 0, 0, False, ready_fs=ready_fs,
                        skipped=skipped)
        return Turn(r.index, parent is not None, r.prompt_len, history, resume_at, ct.stock_prefix, ct.prefix_len,
                    ct.plan is not None, ready_fs=ready_fs)


def session_id(r: Request) -> str:
    """The id a client sends for ``r``'s session (one per session the trace or the linking rule made)."""
    return f"s{r.session}"


def ideal_prefixes(requests: list[Request], page: int) -> dict[int, int]:
    """The prefix each request would match in an infinite cache holding every earlier request's
    prompt and output (trace order), capped like a real match (one token must run). Pages are
    keyed by a hash chain over their token bytes. A history is kept only as deep as the longest
    prompt: no match reaches past it, so a turn's output costs at most that many pages, whatever
    its ``output_length`` claims."""
    from array import array

    from overlay_tools.simulate.cache_kit import OUTPUT_TOKEN

    out_page = array("q", [OUTPUT_TOKEN] * page).tobytes()
    deepest = max((r.prompt_len // page for r in requests), default=0)
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
        for _ in range(min(r.out_tokens // page, deepest - len(keys))):  # the output extends the history
            key = hash((key, out_page))
            seen.add(key)
    return out


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    return fn(), time.perf_counter() - start
