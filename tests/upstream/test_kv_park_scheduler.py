"""``DSV41_KV_PARK=ram`` on the real SGLang scheduler (CPU): retraction parks, re-admission restores.

Every test builds a real ``Scheduler`` with real pools, radix tree and retraction paths
(:mod:`devkit.testkit.scheduler`); only the model forward is simulated, and it writes no KV, so
the pool bytes are set by the test: random bytes before the requests run, zeros in every free
page after the retraction (what other traffic would leave there). A request that comes back with
its old bytes can only have got them from the parked copy.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import threading

import pytest
import torch

from adapter.core import boot
from adapter.switches.kv_park import engine as engine_mod
from adapter.switches.kv_park import page_format as format_mod
from adapter.switches.kv_park import regions

# Imported first, so that boot.install() in each test installs the switch at once.
importlib.import_module("sglang.srt.managers.scheduler")
from devkit.testkit.scheduler import build_scheduler  # noqa: E402

PAGE = 16
ON = {"DSV41_KV_PARK": "ram"}


def _switch():
    return importlib.import_module("adapter.switches.kv_park.switch")


def _install(environ: dict[str, str] | None = None) -> object:
    state = boot.install(dict(ON if environ is None else environ))
    if "DSV41_KV_PARK" in (environ if environ is not None else ON):
        assert state.outcomes["kv_park"].status == "installed", state.outcomes["kv_park"].reason
    return state


def _build(pool: str = "full", *, overlap: bool = False, page_size: int = PAGE):
    if pool == "swa":  # SWAKVPool + SWATokenToKVPoolAllocator, a FULL+SWA tree, 32-token window
        return build_scheduler(
            page_size=page_size, pool_tokens=1024, max_reqs=8, chunked_prefill_size=256, overlap=overlap,
            hybrid_swa=True, swa_pool_tokens=512, sliding_window=32,
        )
    return build_scheduler(page_size=page_size, pool_tokens=1024, max_reqs=8, chunked_prefill_size=256, overlap=overlap)


def _sides(h) -> list[tuple[list[torch.Tensor], object]]:
    """(buffers, allocator of their pages) per side: the MHA pool, or both sides of a SWAKVPool."""
    alloc = h.scheduler.token_to_kv_pool_allocator
    kv = alloc.get_kvcache()
    if hasattr(kv, "swa_kv_pool"):
        full, swa = kv.full_kv_pool, kv.swa_kv_pool
        return [
            ([*full.k_buffer, *full.v_buffer], alloc.full_attn_allocator),
            ([*swa.k_buffer, *swa.v_buffer], alloc.swa_attn_allocator),
        ]
    return [([*kv.k_buffer, *kv.v_buffer], alloc)]


def _randomize_pool(h, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for buffers, _ in _sides(h):
        for buf in buffers:
            raw = buf.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def _kv_bytes(h, req, n: int) -> torch.Tensor:
    """The full-attention bytes of the request's first ``n`` tokens, as its req_to_token row addresses them."""
    s = h.scheduler
    slots = s.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].long()
    return torch.cat([b[slots].view(torch.uint8).reshape(n, -1) for b in _sides(h)[0][0]], dim=1)


def _swa_bytes(h, req, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(live mask, SWA bytes) of the request's first ``n`` tokens; dead positions read as slot 0."""
    s = h.scheduler
    slots = s.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].long()
    swa_slots = s.token_to_kv_pool_allocator.full_to_swa_index_mapping[slots].long()
    return swa_slots != 0, torch.cat([b[swa_slots].view(torch.uint8).reshape(n, -1) for b in _sides(h)[1][0]], dim=1)


def _evict_tree_and_zero_free_pages(h) -> None:
    """Other traffic: the tree loses every unlocked node and every free page is overwritten."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    h.scheduler.tree_cache.evict(EvictParams(num_tokens=1 << 30))
    _zero_free_pages(h)


def _zero_free_pages(h) -> None:
    """Other traffic overwrote every free page (the tree keeps what it holds)."""
    s = h.scheduler
    state = _switch().STATE
    if state is not None:
        state.store.fence()  # the test writes pages directly: no copy may still read them
    for buffers, alloc in _sides(h):
        free = alloc.get_all_free_pages().long()
        for buf in buffers:
            buf.view(-1, s.page_size, *buf.shape[1:])[free] = 0


def _run_two_rows(h, decode_steps: int = 30):
    a = h.add_request(100, max_new_tokens=200)
    b = h.add_request(70, max_new_tokens=200)
    _randomize_pool(h)
    h.run(1 + decode_steps)
    return a, b


@pytest.fixture
def harness():
    return _build()


@pytest.mark.parametrize(
    ("pool", "overlap", "parked", "page"),
    [
        ("full", False, True, PAGE),
        ("full", True, True, PAGE),
        ("swa", False, True, PAGE),
        ("swa", False, True, 1),
        ("full", False, False, PAGE),
        ("swa", False, False, PAGE),
    ],
    ids=["mha", "mha-overlap", "swa", "swa-page1", "mha-stock", "swa-stock"],
)
def test_a_retracted_request_resumes_from_ram_with_the_kv_bytes_it_had(pool, overlap, parked, page):
    """With the switch the re-admission is a prefix hit over every whole page the request had
    computed, and those pages hold its old bytes (full side, and the SWA window of a SWAKVPool):
    the tree's prompt pages stayed in the tree, the decode tail past them (freed by the retraction,
    then overwritten) came back from RAM; stock finds the prompt in the tree and prefills the
    decode tail again."""
    if parked:
        _install()
    h = _build(pool, overlap=overlap, page_size=page)
    a, b = _run_two_rows(h)
    # Every slot the rows hold (in the overlap order the last result is still in flight; the
    # pause processes it, which commits one more token's slot).
    held = {r.rid: int(r.kv.kv_allocated_len) for r in (a, b)}
    before = {r.rid: _kv_bytes(h, r, held[r.rid]) for r in (a, b)}
    before_swa = {r.rid: _swa_bytes(h, r, held[r.rid]) for r in (a, b)} if pool == "swa" else {}

    retracted = h.retract_all()  # the real pause_generation(mode="retract") -> retract_all -> release_req
    assert {r.rid for r in retracted} == {"r1", "r2"}
    committed = {r.rid: len(r.origin_input_ids) + len(r.output_ids) - 1 for r in (a, b)}
    whole = {rid: n // page * page for rid, n in committed.items()}
    _zero_free_pages(h)
    step = h.step()
    assert step.kind == "prefill" and set(step.rids) == {"r1", "r2"}
    prefix = dict(zip(step.rids, step.prefix_lens))
    extend = dict(zip(step.rids, step.extend_lens))
    for r in (a, b):
        w = whole[r.rid]
        if not parked:
            assert prefix[r.rid] <= len(r.origin_input_ids) < w, "stock recomputes the decode tail"
            assert prefix[r.rid] + extend[r.rid] == committed[r.rid] + 1
            continue
        assert prefix[r.rid] == w, "the parked pages were not found as a cached prefix"
        assert extend[r.rid] == committed[r.rid] + 1 - w <= page
        assert torch.equal(_kv_bytes(h, r, w), before[r.rid][:w]), f"{r.rid}: other full-attention bytes"
        if pool == "swa":
            live, now = _swa_bytes(h, r, w)
            _, then = before_swa[r.rid]
            assert int(live[w - 32 : w].sum()) == 32, "the sliding window before the resume point is not live"
            assert torch.equal(now[live], then[:w][live]), f"{r.rid}: other SWA bytes in the window"
    if parked:
        stats = _switch().STATE.store.stats
        entries = 4 if pool == "swa" else 2  # a SWA pool parks its window pages as a second entry
        assert stats.queued + stats.sync_saves == entries and stats.restored == entries and stats.failed == 0
    h.run_until(lambda: a.finished() and b.finished(), max_passes=1000)
    _evict_tree_and_zero_free_pages(h)
    for _, alloc in _sides(h):  # nothing leaked on either side
        assert alloc.available_size() == alloc.size


def test_decode_retraction_in_update_running_batch_parks_and_the_row_finishes(harness, monkeypatch):
    """The memory-pressure path: update_running_batch -> retract_decode -> release_req."""
    _install()
    sched_mod = importlib.import_module("sglang.srt.managers.scheduler")
    h = harness
    a, b = _run_two_rows(h, decode_steps=20)
    whole = {r.rid: int(r.kv.kv_committed_len) // PAGE * PAGE for r in (a, b)}
    before = {r.rid: _kv_bytes(h, r, whole[r.rid]) for r in (a, b)}
    # SGLang's own retraction test hook takes the same branch as a full KV pool.
    monkeypatch.setattr(sched_mod, "TEST_RETRACT", True)
    monkeypatch.setattr(sched_mod, "TEST_RETRACT_INTERVAL", 1)
    h.step()
    monkeypatch.setattr(sched_mod, "TEST_RETRACT", False)
    retracted = [r for r in (a, b) if r.retraction_count == 1]
    assert len(retracted) == 1, "retract_decode keeps one row and retracts the other"
    req = retracted[0]
    store = _switch().STATE.store
    assert req.rid in store
    _zero_free_pages(h)
    step = h.step()
    assert step.kind == "prefill" and step.rids == (req.rid,)
    assert step.prefix_lens == (whole[req.rid],)
    assert torch.equal(_kv_bytes(h, req, whole[req.rid]), before[req.rid])
    assert store.stats.restored == 1
    h.run_until(lambda: a.finished() and b.finished(), max_passes=500)
    # Nothing leaked: with both rows finished and the tree emptied, every page is free again.
    _evict_tree_and_zero_free_pages(h)
    assert h.scheduler.token_to_kv_pool_allocator.available_size() == 1024


class _CopyInFlight:
    """The device event of a copy still running (``query()`` False until the test ends it); a host
    wait on it (``synchronize``) is recorded."""

    def __init__(self, waits: list[str]):
        self.done = False
        self.waits = waits

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits.append("Event.synchronize")
        self.done = True


@contextlib.contextmanager
def _host_waits_recorded(monkeypatch):
    """Every call on this thread that would make the host wait for the device on a CUDA pool, made
    from kv_park's code: a read-back (``Tensor.cpu`` / ``tolist`` / ``item``), a store fence, a
    stream / event / device synchronize. Yields the list they are recorded in."""
    from adapter.switches.kv_park.store import ParkStore

    me, waits = threading.get_ident(), []

    def from_kv_park() -> bool:
        caller = sys._getframe(2).f_globals.get("__name__", "")
        return threading.get_ident() == me and caller.startswith("adapter.switches.kv_park")

    def recorded(name: str, real):
        def call(*args, **kwargs):
            if from_kv_park():
                waits.append(f"{name} from {sys._getframe(1).f_code.co_name}")
            return real(*args, **kwargs)

        return call

    with monkeypatch.context() as m:
        for name in ("cpu", "tolist", "item"):
            m.setattr(torch.Tensor, name, recorded(f"Tensor.{name}", getattr(torch.Tensor, name)))
        for name in ("fence", "fence_pages"):
            m.setattr(ParkStore, name, recorded(f"ParkStore.{name}", getattr(ParkStore, name)))
        m.setattr(torch.cuda, "synchronize", recorded("torch.cuda.synchronize", torch.cuda.synchronize))
        m.setattr(torch.cuda.Stream, "synchronize", recorded("Stream.synchronize", torch.cuda.Stream.synchronize))
        m.setattr(torch.cuda.Event, "synchronize", recorded("Event.synchronize", torch.cuda.Event.synchronize))
        yield waits


def test_a_park_and_the_next_pass_with_copies_in_flight_never_wait_on_the_scheduler_thread(harness, monkeypatch):
    """The call-site seams of the CUDA path on the real scheduler: each park's copy is left in
    flight (its device events report not done, as a CUDA copy queued on the copy stream would), and
    the retraction (``release_req`` -> ``_park``) and the next wrapped ``get_next_batch_to_run``,
    which restores both waiting requests, never read a tensor back, never fence the store and never
    synchronize; the restore is served (ordered after the save on the device, here the bytes are
    already there) and the store lets go of the copies only once their events say done. Putting
    back any of the former waits (``pages.cpu()`` in the park, ``.unique().cpu()`` on
    ``out_cache_loc`` while a copy is pending, the store fence at each pass beside HiCache or before
    the restores) fails it."""
    _install()
    made: list[_CopyInFlight] = []
    waits_on_events: list[str] = []
    real_save = engine_mod.CopyEngine.save

    def save_left_in_flight(self, page_ids, out=None, *, after=None, events=None):
        entry = real_save(self, page_ids, out=out, after=after)
        if events is not None:  # what a CUDA copy into pinned rows hands back
            pair = (_CopyInFlight(waits_on_events), _CopyInFlight(waits_on_events))
            made.extend(pair)
            events.append(pair)
        return entry

    monkeypatch.setattr(engine_mod.CopyEngine, "save", save_left_in_flight)
    h = harness
    a, b = _run_two_rows(h, decode_steps=20)
    whole = {r.rid: int(r.kv.kv_committed_len) // PAGE * PAGE for r in (a, b)}
    before = {r.rid: _kv_bytes(h, r, whole[r.rid]) for r in (a, b)}
    state = _switch().STATE
    store = state.store
    with _host_waits_recorded(monkeypatch) as waits:
        h.retract_all()
        assert store.pending() == 2, "both copies are still in flight after the retraction"
        state.beside_hicache = True  # the pass fenced every copy in flight there
        step = h.step()
    state.beside_hicache = False
    assert waits == [] and waits_on_events == [], f"the scheduler thread waited: {waits + waits_on_events}"
    assert step.kind == "prefill" and set(step.rids) == {a.rid, b.rid}
    for rid, prefix in zip(step.rids, step.prefix_lens):
        assert prefix == whole[rid], f"{rid} was not restored while its copy was in flight"
    for r in (a, b):
        assert torch.equal(_kv_bytes(h, r, whole[r.rid]), before[r.rid])
    assert store.stats.restored == 2 and len(made) == 4
    assert store.pending() == 2, "the store let go of copies whose events were not done"
    for event in made:
        event.done = True
    store.poll()
    assert store.pending() == 0
    h.run_until(lambda: a.finished() and b.finished(), max_passes=500)


def test_a_failed_copy_disables_parking_with_one_line_and_the_request_recomputes(harness, monkeypatch, records):
    _install()

    def broken(self, page_ids, out=None, *, after=None, events=None):
        raise RuntimeError("simulated copy failure")

    monkeypatch.setattr(engine_mod.CopyEngine, "save", broken)
    h = harness
    a, b = _run_two_rows(h)
    context = int(a.kv.kv_committed_len) + 1
    h.retract_all()
    _evict_tree_and_zero_free_pages(h)
    step = h.step()
    assert step.prefix_lens[step.rids.index(a.rid)] == 0 and step.extend_lens[step.rids.index(a.rid)] == context
    store = _switch().STATE.store
    assert store.disabled and store.stats.failed == 1
    warnings = [r.getMessage() for r in records if r.levelno >= logging.WARNING and "kv_park" in r.getMessage()]
    assert len(warnings) == 1 and "kv_park disabled reason=copy_of_r" in warnings[0]
    h.run_until(lambda: a.finished() and b.finished(), max_passes=500)


def test_under_speculative_decoding_a_retracted_request_is_not_parked_and_recomputes(harness, records):
    """A draft model keeps KV of its own that parking does not save: resuming the target from RAM
    would run the draft on stale pages, so the request recomputes as stock does."""
    from sglang.srt.runtime_context import get_spec

    _install()
    h = harness
    a, b = _run_two_rows(h)
    context = int(a.kv.kv_committed_len) + 1
    with get_spec().override(speculative_algorithm="EAGLE"):
        h.retract_all()
    store = _switch().STATE.store
    assert a.rid not in store and b.rid not in store and not store.disabled
    lines = [r.getMessage() for r in records if "kv_park unsupported" in r.getMessage()]
    assert len(lines) == 1 and "reason=speculative_decoding_draft_kv_not_parked" in lines[0]
    _evict_tree_and_zero_free_pages(h)
    step = h.step()
    assert step.prefix_lens[step.rids.index(a.rid)] == 0 and step.extend_lens[step.rids.index(a.rid)] == context
    h.run_until(lambda: a.finished() and b.finished(), max_passes=500)


def test_an_entry_over_the_budget_is_refused_and_the_request_recomputes(harness):
    _install({"DSV41_KV_PARK": "ram", "DSV41_KV_PARK_GIB": "1"})
    store = _switch().STATE.store
    store.budget = 512  # one 512-byte page (each tail is two); a 1 GiB floor is too large for a CPU test pool; the rule is the same
    h = harness
    a, _ = _run_two_rows(h)
    context = int(a.kv.kv_committed_len) + 1
    h.retract_all()
    assert store.stats.refused == 2 and not store.ready_keys()
    _evict_tree_and_zero_free_pages(h)
    step = h.step()
    assert step.extend_lens[step.rids.index(a.rid)] == context


def test_a_pool_without_a_page_layout_is_refused_with_a_reason():
    with pytest.raises(regions.Unsupported, match="no page layout for object"):
        regions.layouts_for(object())


def test_every_region_of_a_real_swa_pool_round_trips_byte_for_byte():
    """Both sides of a real ``SWAKVPool`` (full K/V and SWA K/V of every layer) through the engine."""
    h = build_scheduler(
        page_size=PAGE, pool_tokens=512, max_reqs=4, chunked_prefill_size=256,
        hybrid_swa=True, swa_pool_tokens=256, sliding_window=32,
    )
    pool = h.scheduler.token_to_kv_pool_allocator.get_kvcache()
    for layout, side in ((regions.swa_full_layout(pool), pool.full_kv_pool), (regions.swa_window_layout(pool), pool.swa_kv_pool)):
        assert [r.name for r in layout.regions] == [f"k.{i}" for i in range(side.layer_num)] + [
            f"v.{i}" for i in range(side.layer_num)
        ]
        g = torch.Generator().manual_seed(3)
        for r in layout.regions:
            r.rows.copy_(torch.randint(0, 256, r.rows.shape, dtype=torch.uint8, generator=g))
        eng = engine_mod.CopyEngine(layout, chunk_bytes=3 * layout.page_bytes, stage=True)
        src = torch.randperm(layout.num_pages, generator=g)[:9]
        entry = eng.save(src)
        assert torch.equal(entry, format_mod.per_view_save(layout, src.tolist(), torch.empty_like(entry)))
        dst = torch.randperm(layout.num_pages, generator=g)[:9]
        eng.restore(entry, dst)
        for r in layout.regions:
            assert torch.equal(r.rows[dst], entry[:, sum(x.row_bytes for x in layout.regions[: layout.regions.index(r)]) :][:, : r.row_bytes])
    full, swa = regions.layouts_for(pool)
    assert swa is not None and full.num_pages == 512 // PAGE + 1 and swa.num_pages == 256 // PAGE + 1


def test_every_buffer_of_a_real_deepseek_v4_pool_round_trips_byte_for_byte():
    """Main SWA cache, C4 and C128 compressed KV, indexer keys and the compressor states of a real
    ``DeepSeekV4TokenToKVPool``, each in its own page-id space, through the staged engine."""
    from devkit.testkit.dsv4_pool import build_dsv4_pool

    pool = build_dsv4_pool()
    layouts = regions.dsv4_layouts(pool)
    assert set(layouts) == {"swa", "c4", "c128", "c4_indexer", "c4_state", "c128_state", "c4_indexer_state"}
    assert layouts["swa"].regions[0].row_bytes == 149760  # 256 x 584 B, padded to 576 B
    assert [len(layouts[s].regions) for s in ("swa", "c4", "c128", "c4_indexer")] == [4, 2, 1, 2]
    g = torch.Generator().manual_seed(5)
    for space, layout in layouts.items():
        for r in layout.regions:
            r.rows.copy_(torch.randint(0, 256, r.rows.shape, dtype=torch.uint8, generator=g))
        eng = engine_mod.CopyEngine(layout, chunk_bytes=max(1, layout.page_bytes * 5 // 2), stage=True)
        n = min(7, layout.num_pages)
        src = torch.randperm(layout.num_pages, generator=g)[:n]
        entry = eng.save(src)
        assert torch.equal(entry, format_mod.per_view_save(layout, src.tolist(), torch.empty_like(entry))), space
        dst = torch.randperm(layout.num_pages, generator=g)[:n]
        eng.restore(entry, dst)
        assert torch.equal(eng.save(dst), entry), space
    full, _ = regions.layouts_for(pool)  # the retraction hook's two page-id spaces
    assert {r.rows.data_ptr() for r in full.regions} == {r.rows.data_ptr() for s in ("c4", "c128", "c4_indexer") for r in layouts[s].regions}


@pytest.mark.parametrize("pool", ["full", "swa"])
def test_a_failed_restore_gives_its_pages_back_disables_parking_and_the_request_recomputes(pool, monkeypatch, records):
    _install()

    def broken(self, entry, page_ids, *, first=0, fence=None, after=None):
        raise RuntimeError("simulated restore failure")

    monkeypatch.setattr(engine_mod.CopyEngine, "restore", broken)
    h = _build(pool)
    a, b = _run_two_rows(h)
    h.retract_all()
    _zero_free_pages(h)  # the tree keeps the prompts: the restores of the tails are attempted and fail
    step = h.step()
    assert step.kind == "prefill"
    for rid, prefix in zip(step.rids, step.prefix_lens):
        prompt = len((a if rid == a.rid else b).origin_input_ids)
        assert prefix <= prompt, "nothing past the tree's prompt may be served from a failed restore"
    assert _switch().STATE.store.disabled
    lines = [r.getMessage() for r in records if r.levelno >= logging.WARNING and "kv_park" in r.getMessage()]
    assert len(lines) == 1 and "restore_failed:_RuntimeError" in lines[0]
    h.run_until(lambda: a.finished() and b.finished(), max_passes=1000)
    _evict_tree_and_zero_free_pages(h)
    for _, alloc in _sides(h):
        assert alloc.available_size() == alloc.size, "the slots of the failed restore leaked"


def test_a_retraction_whose_servable_prefix_the_tree_holds_parks_nothing_and_resumes_from_the_tree(harness, records):
    """Retracted two tokens after its prefill, a row's servable prefix (whole pages before its last
    token) is all in the tree (its prompt, cached at the prefill): the retraction frees none of it,
    so nothing is copied (one ``not_parked reason=tree_holds_it`` line); at the re-admission pass
    the tree's pages are pinned (``resumed_from_tree``) and the admission hits them."""
    _install({"DSV41_KV_PARK": "ram", "DSV41_DEBUG_LOG": "1"})
    from adapter.switches.kv_park import outcomes

    h = harness
    a = h.add_request(100, max_new_tokens=50)
    h.run(3)
    n = (len(a.origin_input_ids) + len(a.output_ids) - 1) // PAGE * PAGE
    assert n == 96 and int(a.kv.cache_protected_len) >= n, "the tree holds the servable prefix"
    h.retract_all()
    store = _switch().STATE.store
    assert store.stats.queued + store.stats.sync_saves == 0, "the tree's pages were copied"
    step = h.step()
    assert step.kind == "prefill" and step.prefix_lens == (n,)
    split = outcomes.retraction_split(r.getMessage() for r in records)
    assert split == {"retractions": 1, "parked": 0, "not_parked": {"tree_holds_it": 1}, "restored": 0,
                     "resumed_from_tree": 1, "dropped": {}, "tokens_restored": 0, "tokens_resumed_from_tree": n}, split
    h.run_until(a.finished, max_passes=500)


def test_a_parked_tail_whose_prefix_the_tree_lost_is_dropped_and_the_request_recomputes(harness, records):
    """Only the tail past the tree's prompt is parked; when other traffic evicts the prompt before the
    re-admission, the tail cannot be served without it: ``dropped reason=prefix_gone_from_the_tree``,
    the request prefills from 0 (as stock), finishes, and nothing leaks."""
    _install({"DSV41_KV_PARK": "ram", "DSV41_DEBUG_LOG": "1"})
    from adapter.switches.kv_park import outcomes

    h = harness
    a, b = _run_two_rows(h)
    contexts = {r.rid: int(r.kv.kv_committed_len) + 1 for r in (a, b)}
    h.retract_all()
    _evict_tree_and_zero_free_pages(h)
    step = h.step()
    assert step.prefix_lens == (0, 0) and dict(zip(step.rids, step.extend_lens)) == contexts
    split = outcomes.retraction_split(r.getMessage() for r in records)
    assert split["parked"] == 2 and split["restored"] == 0, split
    assert split["dropped"] == {"prefix_gone_from_the_tree": 2}, split
    h.run_until(lambda: a.finished() and b.finished(), max_passes=1000)
    _evict_tree_and_zero_free_pages(h)
    assert h.scheduler.token_to_kv_pool_allocator.available_size() == 1024


def test_the_split_counts_the_tokens_a_restore_wrote_back_past_what_the_tree_held(harness, records):
    """Each restored row adds its restored tokens less what the tree still held at re-admission (the
    prompt's whole pages) to ``tokens_restored``: what the admission found cached and did not
    recompute because kv_park brought it back."""
    _install({"DSV41_KV_PARK": "ram", "DSV41_DEBUG_LOG": "1"})
    from adapter.switches.kv_park import outcomes

    h = harness
    a, b = _run_two_rows(h)
    h.retract_all()
    _zero_free_pages(h)
    step = h.step()
    prefix = dict(zip(step.rids, step.prefix_lens))
    held_by_tree = {r.rid: len(r.origin_input_ids) // PAGE * PAGE for r in (a, b)}
    split = outcomes.retraction_split(r.getMessage() for r in records)
    assert (split["parked"], split["restored"]) == (2, 2), split
    assert split["tokens_restored"] == sum(prefix[rid] - held_by_tree[rid] for rid in prefix) > 0, (split, prefix)
    h.run_until(lambda: a.finished() and b.finished(), max_passes=1000)
