"""A real SGLang 0.5.23 ``Scheduler`` on CPU: real pools, cache, admission and result processing.

The scheduler is built with ``object.__new__`` and only the attributes its scheduling path reads;
everything that decides *what runs when* is upstream code: ``get_next_batch_to_run``,
``_should_defer_prefill``, ``get_new_batch_prefill`` with the real ``PrefillAdder``,
``update_running_batch`` (decode retraction), ``process_pending_chunked_abort``,
``pause_generation`` (retract mode), ``process_batch_result`` with the real
``SchedulerBatchResultProcessor``, and (in :meth:`SchedulerHarness.run_event_loop`) the real
``event_loop_normal`` / ``event_loop_overlap``. Only the model forward is simulated: every row of
a forward gets one token (``SIM_TOKEN``), non-final chunks get none (the real processor decides).
Collaborators with no CPU path (metrics sinks, load publishers, IO) are null stand-ins.

API (stable; add to it, never change it)::

    h = build_scheduler(page_size=64, pool_tokens=1 << 20, chunked_prefill_size=8192)
    streams = [h.add_request(4000, max_new_tokens=10_000) for _ in range(16)]
    h.drain()                                 # run until nothing waits and no chunk is in flight
    long = h.add_request(262_144, max_new_tokens=2)
    while not long.finished():
        step = h.step()                       # one scheduler pass, normal or overlap order
        step.kind, step.extend_lens, step.decode_rows
    h.on_forward = ScriptedClock(cost).forward  # scripted wall time per batch (clock.now: its ns)
    h.abort_chunked()                         # the real abort path of the chunked prompt
    h.retract_all()                           # the real pause_generation(mode="retract"), then resume
    h.run(8); h.run_until(predicate); h.trace  # every Step so far
    log = h.run_event_loop({0: reqs, 40: [req]}, until=req.finished)   # the real event loop

``Step`` (frozen): ``kind`` ("prefill" / "decode" / "idle"), ``rids``, ``extend_lens``,
``prefix_lens``, ``decode_rows`` and ``decode_context_lens`` (rows that decoded, mixed-chunk rows
included), ``remaining`` (``_prefill_decode_interval_remaining`` after the pass), ``chunk_of(rid)``.
Requests are greedy, ``ignore_eos``, with distinct token ids (``make_request(prompt_ids=...)`` to
share prefixes); decode retraction on a full pool goes through the real ``update_running_batch``.

``build_scheduler`` keywords: ``page_size``, ``pool_tokens`` (full KV pool size), ``max_reqs``,
``max_context_len``, ``chunked_prefill_size``, ``prefill_decode_interval``,
``prefill_decode_interval_min_bs``, ``mixed_chunk`` (``--enable-mixed-chunk``), ``overlap``
(step in the overlap loop's order), ``hybrid_swa`` (``SWAKVPool`` + ``SWATokenToKVPoolAllocator``
and a ``FULL``+``SWA`` cache; ``swa_pool_tokens`` and ``sliding_window`` size it),
``max_prefill_tokens`` and ``vocab_size``; ``dsv4`` (a real ``DeepSeekV4TokenToKVPool``, layers
C0/C4/C128/C4, with its ``SWATokenToKVPoolAllocator`` and a ``FULL``+``SWA`` cache; needs
``page_size=256``; ``pool_tokens``, ``swa_pool_tokens`` and ``sliding_window`` size it);
``hicache`` (a :class:`overlay_tools.simulate.cache_kit.HiCache`: its launch flags on the server args and
``init_hicache`` on the cache, with the engine kit's CPU routes; the scheduler polls its events).

Import cost: SGLang itself (~8 s, once per process). Building a 1M-token pool takes ~1 s.
"""

from __future__ import annotations

import types
import warnings
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

SIM_TOKEN = 7  # the token every simulated forward emits (ignore_eos requests never stop on it)


class _Null:
    """Absorbs attribute access, calls and ``+=``: a sink for metrics-only collaborators."""

    def __getattr__(self, name: str) -> _Null:
        return _Null()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __bool__(self) -> bool:
        return False

    def __add__(self, other: Any) -> Any:
        return other

    __radd__ = __add__


@dataclass(frozen=True)
class Step:
    """What one scheduler pass ran (read from the real batch before its result was processed)."""

    index: int
    kind: str  # "prefill" (an extend batch), "decode", or "idle" (no batch)
    rids: tuple[str, ...] = ()
    extend_lens: tuple[int, ...] = ()  # prefill only, one per row (mixed decode rows count 1)
    prefix_lens: tuple[int, ...] = ()
    decode_rows: int = 0  # rows that got a decode token in this forward (mixed chunk included)
    decode_context_tokens: int = 0  # sum of those rows' context lengths (prompt + output)
    remaining: int = 0  # scheduler._prefill_decode_interval_remaining after the pass
    decode_context_lens: tuple[int, ...] = ()  # per decoded row (for cost models)

    def chunk_of(self, rid: str) -> int:
        """Tokens this pass prefilled for request ``rid`` (0 when it is not in the batch)."""
        for r, n in zip(self.rids, self.extend_lens):
            if r == rid:
                return n
        return 0


@dataclass
class SchedulerHarness:
    scheduler: Any  # sglang.srt.managers.scheduler.Scheduler
    overlap: bool
    vocab_size: int
    trace: list[Step] = field(default_factory=list)
    streamed: list[int] = field(default_factory=list)  # batch sizes handed to the output streamer
    _next_rid: int = 0
    # called with each batch as it is run (before its result is processed): a ScriptedClock's forward
    on_forward: Callable[[Any], None] | None = None

    # -- requests ---------------------------------------------------------------------------
    def make_request(
        self,
        prompt_len: int,
        max_new_tokens: int,
        *,
        rid: str | None = None,
        seed: int | None = None,
        prompt_ids: Iterable[int] | None = None,
    ) -> Any:
        """A real ``Req`` (greedy, ``ignore_eos``) with distinct token ids unless ``prompt_ids`` given."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        self._next_rid += 1
        rid = rid or f"r{self._next_rid}"
        if prompt_ids is None:
            base = (self._next_rid if seed is None else seed) * 7919
            ids = array("q", ((base + i) % (self.vocab_size - 10) + 5 for i in range(prompt_len)))
        else:
            ids = array("q", prompt_ids)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        params.normalize(None)
        params.verify(self.vocab_size)
        return Req(rid, "", ids, params, vocab_size=self.vocab_size)

    def add_request(self, prompt_len_or_req: Any, max_new_tokens: int = 16, **kwargs: Any) -> Any:
        """Queue a request (a ``Req``, or a prompt length for :meth:`make_request`); returns it."""
        req = prompt_len_or_req
        if isinstance(req, int):
            req = self.make_request(req, max_new_tokens, **kwargs)
        self.scheduler.waiting_queue.append(req)
        return req

    # -- stepping ---------------------------------------------------------------------------
    def step(self) -> Step:
        """One scheduler pass in the order of the configured event loop (normal or overlap)."""
        s = self.scheduler
        plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
        s.running_batch = plan.running_batch
        batch = plan.batch_to_run
        record = Step(index=len(self.trace), **_record_fields(batch))
        if batch and self.on_forward is not None:
            self.on_forward(batch)
        if not self.overlap:
            if batch:
                s.process_batch_result(batch, simulated_forward(batch))
        else:
            # event_loop_overlap's order: schedule N+1, launch it, then process N's result.
            disable_overlap = s.is_disable_overlap_for_batch(batch, last_batch=s.last_batch)
            if disable_overlap:
                s.process_batch_result(*s.result_queue.popleft())
            if batch:
                s.result_queue.append((batch.copy(), simulated_forward(batch)))
            if s.last_batch and not disable_overlap:
                s.process_batch_result(*s.result_queue.popleft())
        s.last_batch = batch
        s.forward_ct += 1
        record = Step(**{**record.__dict__, "remaining": s._prefill_decode_interval_remaining})
        self.trace.append(record)
        return record

    def run(self, passes: int) -> list[Step]:
        return [self.step() for _ in range(passes)]

    def run_until(self, done: Callable[[], bool], max_passes: int = 100_000) -> list[Step]:
        """Step until ``done()``; raises if it takes more than ``max_passes`` passes."""
        steps: list[Step] = []
        while not done():
            if len(steps) >= max_passes:
                raise RuntimeError(f"run_until: not done after {max_passes} passes")
            steps.append(self.step())
        return steps

    def drain(self, max_passes: int = 100_000) -> list[Step]:
        """Step until nothing waits and no chunked prompt is in flight (admission finished)."""
        s = self.scheduler
        return self.run_until(lambda: not s.waiting_queue and s.chunked_req is None, max_passes)

    def finish_in_flight(self) -> None:
        """Overlap order: process the result still queued (the normal order has none)."""
        s = self.scheduler
        while s.result_queue:
            s.process_batch_result(*s.result_queue.popleft())

    # -- the real abort and retract paths ------------------------------------------------------
    def abort_chunked(self) -> Any:
        """Abort the chunked prompt through ``process_pending_chunked_abort`` on the next pass."""
        s = self.scheduler
        req = s.chunked_req
        if req is None:
            raise RuntimeError("abort_chunked: no chunked prompt in flight")
        s._pending_chunked_abort_req = req
        return req

    def retract_all(self) -> list[Any]:
        """The real ``pause_generation(mode="retract")`` (running rows and the chunked prompt go
        back to the waiting queue with their KV freed), then resume. Returns the retracted reqs."""
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        s = self.scheduler
        before = {id(r) for r in s.waiting_queue}
        s.pause_generation(PauseGenerationReqInput(mode="retract"))
        s._engine_paused = False
        s._pause_started_at = None
        return [r for r in s.waiting_queue if id(r) not in before]

    # -- the real event loops ----------------------------------------------------------------
    def run_event_loop(
        self,
        arrivals: dict[int, list[Any]],
        *,
        until: Callable[[], bool],
        max_iterations: int = 20_000,
        word: Callable[[Any], str] | None = None,
    ) -> list[str]:
        """Drive the real ``event_loop_normal`` / ``event_loop_overlap`` (per ``overlap``).

        ``arrivals`` maps a loop iteration to requests that arrive then. The loop exits after the
        iteration in which ``until()`` holds (checked from iteration ``max(arrivals)`` on).
        Returns one word per forward: ``P<tokens>`` for a prefill, ``d<rows>`` for a decode, or
        ``word(batch)`` when given.
        """
        s = self.scheduler
        log: list[str] = []
        iteration = [0]
        last_arrival = max(arrivals, default=0)

        def ingest_requests(stop_at_pause: bool = False) -> list[Any]:
            k = iteration[0]
            iteration[0] += 1
            s.waiting_queue.extend(arrivals.get(k, []))
            if k >= max_iterations or (k > last_arrival and until()):
                s.gracefully_exit = True
            return []

        def run_batch(batch: Any) -> Any:
            if word is not None:
                log.append(word(batch))
            elif batch.forward_mode.is_extend():
                log.append(f"P{sum(batch.extend_lens)}")
            else:
                log.append(f"d{batch.batch_size()}")
            if self.on_forward is not None:
                self.on_forward(batch)
            return simulated_forward(batch)

        s.gracefully_exit = False
        s.ingest_requests = ingest_requests
        s.run_batch = run_batch
        loop = s.event_loop_overlap if self.overlap else s.event_loop_normal
        loop()
        if iteration[0] > max_iterations:
            raise RuntimeError(f"run_event_loop: not done after {max_iterations} iterations")
        return log


class ScriptedClock:
    """A clock in ns that only the simulated forwards move: each batch the harness runs advances it
    by ``cost(step)`` (``step``: the batch's :class:`Step` fields), so code that times the scheduler's
    passes (decode yield's closed loop) sees scripted costs, the same on every run. Attach it with
    ``h.on_forward = clock.forward`` and hand ``clock.now`` to the code under test."""

    def __init__(self, cost: Callable[[Step], int]):
        self.cost, self.t, self.forwards = cost, 0, 0

    def now(self) -> int:
        return self.t

    def forward(self, batch: Any) -> None:
        self.t += int(self.cost(Step(index=self.forwards, **_record_fields(batch))))
        self.forwards += 1


def simulated_forward(batch: Any) -> Any:
    """The model forward's result: one ``SIM_TOKEN`` per row, no logits."""
    import torch
    from sglang.srt.managers.utils import GenerationBatchResult

    return GenerationBatchResult(
        logits_output=None,
        next_token_ids=torch.full((batch.batch_size(),), SIM_TOKEN, dtype=torch.int64),
        can_run_cuda_graph=False,
    )


def _context_len(req: Any) -> int:
    return len(req.origin_input_ids) + len(req.output_ids)


def _build_pools(
    server_args: Any,
    *,
    page_size: int,
    pool_tokens: int,
    max_reqs: int,
    max_context_len: int,
    chunked_prefill_size: int,
    hybrid_swa: bool,
    swa_pool_tokens: int,
    sliding_window: int,
    dsv4: bool = False,
    hicache: Any = None,
) -> tuple[Any, Any, Any]:
    import torch
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    r2t = ReqToTokenPool(size=max_reqs, max_context_len=max_context_len, device="cpu", enable_memory_saver=False)
    if dsv4:
        from devkit.testkit.dsv4_pool import build_dsv4_kv

        kv, allocator = build_dsv4_kv(
            full_tokens=pool_tokens, swa_tokens=swa_pool_tokens, req_slots=r2t.req_to_token.shape[0],
            max_reqs=max_reqs, page_size=page_size, sliding_window=sliding_window,
        )
        components = (ComponentType.FULL, ComponentType.SWA)
    elif hybrid_swa:
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        layers, full_ids = 4, (3,)
        kv = SWAKVPool(
            size=pool_tokens, size_swa=swa_pool_tokens, page_size=page_size, dtype=torch.bfloat16,
            head_num=1, head_dim=8, swa_attention_layer_ids=[i for i in range(layers) if i not in full_ids],
            full_attention_layer_ids=list(full_ids), device="cpu",
        )
        allocator = SWATokenToKVPoolAllocator(
            size=pool_tokens, size_swa=swa_pool_tokens, page_size=page_size, dtype=torch.bfloat16,
            device="cpu", kvcache=kv, need_sort=False,
        )
        components = (ComponentType.FULL, ComponentType.SWA)
    else:
        kv = MHATokenToKVPool(
            size=pool_tokens, page_size=page_size, dtype=torch.bfloat16, head_num=1, head_dim=8,
            layer_num=1, device="cpu", enable_memory_saver=False,
        )
        if page_size == 1:
            from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

            allocator = TokenToKVPoolAllocator(
                size=pool_tokens, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False
            )
        else:
            from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

            allocator = PagedTokenToKVPoolAllocator(
                size=pool_tokens, page_size=page_size, dtype=torch.bfloat16, device="cpu", kvcache=kv,
                need_sort=False,
            )
        components = (ComponentType.FULL,)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=r2t,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        tree_components=components,
        sliding_window_size=sliding_window if hybrid_swa or dsv4 else None,
        chunked_prefill_size=chunked_prefill_size,
    )
    cache = UnifiedRadixCache(params=params)
    if hicache is not None:  # create_unified_radix_cache's order: the cache, then init_hicache
        from overlay_tools.simulate.cache_kit import attach_hicache

        attach_hicache(cache, params, server_args)
    return cache, allocator, r2t


def build_scheduler(
    *,
    page_size: int = 64,
    pool_tokens: int = 1 << 18,
    max_reqs: int = 80,
    max_context_len: int | None = None,
    chunked_prefill_size: int = 8192,
    prefill_decode_interval: int = 0,
    prefill_decode_interval_min_bs: int = 0,
    mixed_chunk: bool = False,
    overlap: bool = False,
    hybrid_swa: bool = False,
    swa_pool_tokens: int = 1 << 14,
    sliding_window: int = 128,
    max_prefill_tokens: int | None = None,
    vocab_size: int = 32000,
    dsv4: bool = False,
    hicache: Any = None,
) -> SchedulerHarness:
    """A real ``Scheduler`` (``object.__new__``) on real CPU pools; see the module docstring."""
    from devkit.testkit.pins import check_builder_pins

    check_builder_pins()  # the attributes set below stand in for Scheduler.__init__ as pinned
    warnings.filterwarnings("ignore", module="sglang")
    import torch

    torch.set_num_threads(1)  # 2-core boxes: multi-threaded torch gives 30-80 ms outliers per step
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    from sglang.srt.managers.scheduler_components.logprob_result_processor import SchedulerLogprobResultProcessor
    from sglang.srt.runtime_context import get_schedule
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    max_context_len = max_context_len or pool_tokens
    extra: dict[str, Any] = {}
    if max_prefill_tokens is not None:
        extra["max_prefill_tokens"] = max_prefill_tokens
    server_args = ServerArgs(
        model_path="dummy",
        page_size=page_size,
        chunked_prefill_size=chunked_prefill_size,
        prefill_decode_interval=prefill_decode_interval,
        prefill_decode_interval_min_bs=prefill_decode_interval_min_bs,
        enable_mixed_chunk=mixed_chunk,
        pp_max_micro_batch_size=max_reqs,  # left None, get_num_allocatable_reqs raises a TypeError
        max_running_requests=max_reqs,
        **extra,
        **({} if hicache is None else hicache.flags()),
    )
    set_global_server_args_for_scheduler(server_args)  # publishes get_schedule() / get_exec() / ...
    cache, allocator, r2t = _build_pools(
        server_args, page_size=page_size, pool_tokens=pool_tokens, max_reqs=max_reqs,
        max_context_len=max_context_len, chunked_prefill_size=chunked_prefill_size,
        hybrid_swa=hybrid_swa, swa_pool_tokens=swa_pool_tokens, sliding_window=sliding_window, dsv4=dsv4,
        hicache=hicache,
    )

    s = object.__new__(Scheduler)
    s.server_args = server_args
    s.scheduler_stage_metrics = None
    s.device = "cpu"
    s.page_size = page_size
    s.tree_cache, s.token_to_kv_pool_allocator, s.req_to_token_pool = cache, allocator, r2t
    s.model_config = types.SimpleNamespace(
        vocab_size=vocab_size, is_multimodal=False, is_encoder_decoder=False, hf_eos_token_id=None,
        self_opened_think_start_ids=None, think_end_ids=None,
    )
    # What init_chunked_prefill sets (it also resolves the model impl, which needs a real model).
    schedule = get_schedule()
    s.chunked_prefill_size = schedule.chunked_prefill_size
    s.prefill_decode_interval = schedule.prefill_decode_interval or 0
    s._prefill_decode_interval_remaining = 0
    s.prefill_decode_interval_min_bs = schedule.prefill_decode_interval_min_bs
    s.chunked_req = None
    s._pending_chunked_abort_req = None
    s.is_mixed_chunk = bool(mixed_chunk)
    s.dynamic_chunk_sizer = None
    s.schedule_policy = schedule.schedule_policy
    s.enable_hierarchical_cache = hicache is not None  # get_next_batch_to_run then polls check_hicache_events
    s.enable_priority_scheduling = False
    s.schedule_low_priority_values_first = False
    s.abort_on_priority_when_disabled = False
    s.metrics_reporter = _Null()
    s.init_schedule_policy()  # real SchedulePolicy, NewTokenRatioTracker, prefill-bs tracker
    s.priority_scheduling_preemption_threshold = 0
    s.max_prefill_tokens = schedule.max_prefill_tokens
    s.max_running_requests = max_reqs
    s.max_queued_requests = None
    s.truncation_align_size = None
    s.processed_tokens_counter = 0
    s.dllm_config = None
    s.enable_hisparse = False
    s.hisparse_coordinator = None
    s.require_mlp_sync = False
    s.spec_algorithm = SpeculativeAlgorithm.NONE
    s.enable_overlap = overlap
    s.enable_overlap_mlx = False
    s.enable_skip_finishing_decode = overlap
    s.result_queue = deque()
    s.enable_hicache_storage = s.enable_lmcache = False
    s.enable_unified_cache_external_linker = False
    s.enable_unified_memory = False
    s.enable_lora = False
    s.lora_drainer = None
    s.is_hybrid_swa = hybrid_swa or dsv4
    s.min_free_slots_delayer = None
    s.disaggregation_mode = DisaggregationMode.NULL
    s.decode_offload_manager = None
    s.forward_ct = 0
    s.waiting_queue = []
    s.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
    s.last_batch = None
    s.cur_batch_for_debug = None
    s.future_map = None
    s.pool_stats_observer = None
    s.is_generation = True
    s.gracefully_exit = False
    s._engine_paused = False
    s._pause_started_at = None
    s._sched_idled = False
    s.enable_fpm = False
    s._war_barrier_enabled = False
    # Collaborators with trivial behaviour on a single, non-DP rank (no CPU path or pure IO).
    s.grammar_manager = types.SimpleNamespace(has_waiting_grammars=lambda: False)
    s.dp_attn_adapter = types.SimpleNamespace(
        maybe_prepare_mlp_sync_batch=lambda b, need_sync=True: b,
        maybe_convert_decode_to_extend=lambda b: b,
    )
    s.ngram_embedding_manager = types.SimpleNamespace(prepare_for_forward=lambda b, chunked_req=None: b)
    s.load_inquirer = types.SimpleNamespace(
        _get_num_pending_tokens=lambda chunk_deduct=0: 0, get_loads=lambda *a, **k: None
    )
    s.load_publisher = types.SimpleNamespace(publish_load_stat=lambda *a, **k: None)
    s.publish_load_snapshot = lambda force=False: None
    s._record_step_counters = lambda batch, result: None
    s.maybe_send_health_check_signal = lambda: None
    s._maybe_clear_mm_inputs = lambda batch: None
    s.on_idle = lambda: None
    s.launch_batch_sample_if_needed = lambda result, batch: None
    s.kv_events_publisher = _Null()
    s.tp_worker = types.SimpleNamespace(
        model_runner=types.SimpleNamespace(attn_backend=object(), prefill_aware_swa=False)
    )
    s.send_abort_output = lambda *a, **k: None
    s._release_aborted_request = lambda req: None
    s._prefetch_kvcache = lambda req: None

    harness = SchedulerHarness(scheduler=s, overlap=overlap, vocab_size=vocab_size)
    s.output_streamer = types.SimpleNamespace(
        stream_output=lambda reqs, *a, **k: harness.streamed.append(len(reqs))
    )
    beam = types.SimpleNamespace(
        pending_member_rows=lambda b: 0, commit_decode=lambda b: set(),
        commit_prefill=lambda *a, **k: None, retire_group=lambda req: None,
    )
    s.beam_coordinator = beam
    s.batch_result_processor = SchedulerBatchResultProcessor(
        is_generation=True, disaggregation_mode=DisaggregationMode.NULL,
        enable_overlap=overlap, enable_overlap_mlx=False, model_config=s.model_config,
        token_to_kv_pool_allocator=allocator, tree_cache=cache, hisparse_coordinator=None,
        req_to_token_pool=r2t, decode_offload_manager=None, metrics_collector=_Null(),
        metrics_reporter=_Null(), draft_worker=None, model_worker=_Null(),
        logprob_result_processor=SchedulerLogprobResultProcessor(model_config=s.model_config),
        output_streamer=s.output_streamer, beam_coordinator=beam, abort_request=lambda *a, **k: None,
    )
    return harness


def _record_fields(batch: Any) -> dict[str, Any]:
    if batch is None:
        return {"kind": "idle"}
    rids = tuple(r.rid for r in batch.reqs)
    if batch.forward_mode.is_extend():
        rows = list(batch.decoding_reqs or [])
        return {
            "kind": "prefill", "rids": rids, "extend_lens": tuple(batch.extend_lens),
            "prefix_lens": tuple(batch.prefix_lens), "decode_rows": len(rows),
            "decode_context_tokens": sum(_context_len(r) for r in rows),
            "decode_context_lens": tuple(_context_len(r) for r in rows),
        }
    return {
        "kind": "decode", "rids": rids, "decode_rows": batch.batch_size(),
        "decode_context_tokens": sum(_context_len(r) for r in batch.reqs),
        "decode_context_lens": tuple(_context_len(r) for r in batch.reqs),
    }
