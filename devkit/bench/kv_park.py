"""``python -m adapter bench kv-park [--quick] [--device cuda]``: page-major parking copies.

A DSV4-like pool (one tensor per layer and region, like SGLang's ``kv_buffer`` lists: C4 KV
pages of 64 x 584 B padded to 37440 B, C4 indexer 8448 B, C128 KV 1728 B, a 2048 B compressor
state row, 20 layers each: 993,280 B and 80 views per 256-token page). The full run parks 782
pages (740.7 MiB, a 200k-token request); ``--quick`` parks 96.

Measured side by side, interleaved in each repetition (A/B), median of the repetitions:

* ``per-view save``: the stock pattern, one copy per (page, layer, region) view (62,560 copies);
* ``page-major save``: :class:`adapter.switches.kv_park.engine.CopyEngine` (one ``index_select`` per
  region per <= 32 MiB chunk, one copy per chunk into pageable memory; on CPU straight into the
  entry with the regions split over the engine's copy threads, ``copy_threads`` in the JSON);
* ``memcpy``: one copy of the same number of contiguous bytes (the physical limit), split over
  the same number of threads as the engine, so the ratios compare like with like;
* on CPU also the 1-thread figures (engine and memcpy) and the per-view save split over the
  same threads (it stays GIL-bound: tens of thousands of tiny copies), so the thread gain is
  visible on its own;
* the two restores (per-view copies back; page-major ``index_copy_``) into shuffled free pages;
* on CPU also the staged schedule the CUDA path uses (for reference; the figures in the JSON are
  the engine's default schedule: straight into the host entry on CPU, staged on CUDA).

On ``--device cuda`` the pool and the staging buffers are on the GPU, the entries in pageable
host memory, every timed step ends with ``torch.cuda.synchronize``, and the memcpy limit is a
device-to-host copy (save) and a host-to-device copy (restore) of the entry's bytes into and out
of pageable memory (the same kind of memory the engine writes). On CUDA also, for reference:

* ``per-view save, pinned per save``: the stock retraction pattern of the bench_park probe, a
  ``pin_memory=True`` entry allocated for every save (PyTorch's caching host allocator keeps the
  block, rounded up to a power of two, so after the first save it pays no page-locking but holds
  the pinned RAM: ``pinned_held_mib`` in the JSON), then the per-view copies into it;
* ``stock get_cpu_copy``: SGLang's ``cpu_tensor`` retraction backup, one gather per region tensor
  and ``.to("cpu", non_blocking=True)`` (pinned, from the caching host allocator);
* ``memcpy into pinned``: the device-to-host copy of the same bytes into pinned memory (the link's
  ceiling, which the pageable engine does not aim at);
* ``pin_alloc_ms``: one fresh ``pin_memory=True`` allocation of the entry's size after emptying
  the host cache (the page-locking a pinned-per-save pattern pays whenever the cache misses).

``targets`` in the JSON holds each target with its value, limit and ``met``.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable

import torch

from adapter.switches.kv_park.engine import CopyEngine
from adapter.switches.kv_park.host_pool import CudaHostRegister, HostPool
from adapter.switches.kv_park.page_format import PageLayout, Region, per_view_restore, per_view_save

MiB = 1 << 20
# (region, layers, bytes per page per layer)
DSV4_LIKE = (("c4_kv", 20, 37440), ("c4_index", 20, 8448), ("c128_kv", 20, 1728), ("c4_state", 20, 2048))
# CPU (pageable entries, the CPU pools' path): ratios of times.
TARGETS = {"save_speedup_vs_perview": 4.0, "save_vs_memcpy": 2.5, "restore_vs_memcpy": 3.0, "restore_vs_perview": 1.0}
TARGET_OPS = {
    "save_speedup_vs_perview": ">=",
    "save_vs_memcpy": "<=",
    "restore_vs_memcpy": "<=",
    "restore_vs_perview": "<=",
}
# CUDA (the pinned park pool): the save and the restore each at least 0.8x the speed of a pinned
# memcpy of the same bytes in the same run (memcpy time / engine time), and the save no slower than
# SGLang's stock ``get_cpu_copy`` (engine time / stock time).
CUDA_TARGETS = {"pool_save_speed_vs_pinned_memcpy": 0.8, "pool_restore_speed_vs_pinned_memcpy": 0.8,
                "pool_save_vs_stock_get_cpu_copy": 1.0}
CUDA_TARGET_OPS = {"pool_save_speed_vs_pinned_memcpy": ">=", "pool_restore_speed_vs_pinned_memcpy": ">=",
                   "pool_save_vs_stock_get_cpu_copy": "<="}


def dsv4_like_layout(pool_pages: int, device: torch.device, seed: int = 0) -> PageLayout:
    """Random bytes in one ``[pool_pages, row_bytes]`` tensor per (region, layer)."""
    g = torch.Generator().manual_seed(seed)
    regions = []
    for name, layers, row in DSV4_LIKE:
        for layer in range(layers):
            rows = torch.randint(0, 256, (pool_pages, row), dtype=torch.uint8, generator=g)
            regions.append(Region(f"{name}.{layer}", rows.to(device)))
    return PageLayout(tuple(regions))


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    step = -(-n // parts)
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def _on_threads(jobs: list[Callable[[], object]]) -> None:
    """Run ``jobs`` at once: the first on this thread, the others on threads joined here."""
    threads = [threading.Thread(target=job, daemon=True) for job in jobs[1:]]
    for t in threads:
        t.start()
    jobs[0]()
    for t in threads:
        t.join()


def _memcpy(dst: torch.Tensor, src: torch.Tensor, parts: int) -> Callable[[], object]:
    if parts <= 1:
        return lambda: dst.copy_(src)
    spans = _split(dst.numel(), parts)
    return lambda: _on_threads([lambda lo=lo, hi=hi: dst[lo:hi].copy_(src[lo:hi]) for lo, hi in spans])


def _per_view_threads(layout: PageLayout, ids: list[int], out: torch.Tensor, parts: int) -> Callable[[], object]:
    spans = _split(len(ids), parts)
    return lambda: _on_threads([lambda lo=lo, hi=hi: per_view_save(layout, ids[lo:hi], out[lo:hi]) for lo, hi in spans])


def _timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _pinned_held_bytes() -> int:
    """Bytes of pinned blocks PyTorch's caching host allocator holds (0 where it cannot tell)."""
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})()
    return int(stats.get("allocated_bytes.current", 0) or 0)


def _empty_host_cache() -> None:
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def _fresh_pin_ms(nbytes: int, reps: int = 3) -> float:
    """Median time of one fresh pinned allocation of ``nbytes`` (host cache emptied before each)."""
    times = []
    for _ in range(reps):
        _empty_host_cache()
        start = time.perf_counter()
        block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        times.append(time.perf_counter() - start)
        del block
    _empty_host_cache()
    return statistics.median(times)


def _target_table(figures: dict) -> dict[str, dict]:
    cuda = figures["device"] == "cuda"
    targets, ops = (CUDA_TARGETS, CUDA_TARGET_OPS) if cuda else (TARGETS, TARGET_OPS)
    table = {}
    for name, limit in targets.items():
        value = figures[name]
        met = value >= limit if ops[name] == ">=" else value <= limit
        table[name] = {"value": value, "op": ops[name], "limit": limit, "met": bool(met)}
    return table


def run(quick: bool = False, device: str = "cpu") -> dict:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("kv-park bench: --device cuda asked for, but torch sees no CUDA device")
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    pages, reps = (96, 5) if quick else (782, 5)
    pool_pages = pages + 18
    layout = dsv4_like_layout(pool_pages, dev)
    engine = CopyEngine(layout)
    g = torch.Generator().manual_seed(1)
    src_ids = torch.randperm(pool_pages, generator=g)[:pages]
    dst_ids = torch.randperm(pool_pages, generator=g)[:pages]
    src_list, dst_list = src_ids.tolist(), dst_ids.tolist()
    entry_bytes = pages * layout.page_bytes

    pv_entry = engine.new_entry(pages)
    pm_entry = engine.new_entry(pages)
    flat_dev = torch.empty(entry_bytes, dtype=torch.uint8, device=dev)  # memcpy source/target
    threads = engine.threads
    cases: dict[str, Callable[[], object]] = {
        "per-view save": lambda: per_view_save(layout, src_list, pv_entry),
        "page-major save": lambda: engine.save(src_ids, out=pm_entry),
        "memcpy (save direction)": _memcpy(pv_entry.view(-1), flat_dev, threads),
        "per-view restore": lambda: per_view_restore(layout, pv_entry, dst_list),
        "page-major restore": lambda: engine.restore(pm_entry, dst_ids),
    }
    # The park pool: on CUDA page-locked once (cudaHostRegister in 1 GiB chunks), on CPU the same
    # class over ordinary memory. Two segments, so the carving path is the one measured.
    half = -(-pages // 2) * -(-layout.page_bytes // 4096) * 4096
    pool = HostPool.allocate(2 * half, chunk_bytes=half, locker=CudaHostRegister() if dev.type == "cuda" else None)
    carving = pool.carve(pages, layout.page_bytes)
    assert carving is not None
    rows = carving.segments
    cases["pool save"] = lambda: engine.save(src_ids, out=rows)
    cases["pool restore"] = lambda: engine.restore(rows, dst_ids)
    if dev.type == "cuda":
        cases["memcpy (restore direction)"] = lambda: flat_dev.copy_(pm_entry.view(-1))
        pinned_dst = torch.empty(entry_bytes, dtype=torch.uint8, pin_memory=True)
        dev_src_ids = src_ids.to(dev)
        pinned_before = _pinned_held_bytes()  # the memcpy baseline's own pinned buffer
        cases["memcpy into pinned"] = lambda: pinned_dst.copy_(flat_dev)
        cases["memcpy from pinned"] = lambda: flat_dev.copy_(pinned_dst)
        cases["per-view save, pinned per save"] = lambda: per_view_save(
            layout, src_list, torch.empty((pages, layout.page_bytes), dtype=torch.uint8, pin_memory=True)
        )
        cases["stock get_cpu_copy"] = lambda: [
            r.rows.index_select(0, dev_src_ids).to("cpu", non_blocking=True) for r in layout.regions
        ]
    else:  # the CUDA schedule (2 x 32 MiB staging, one copy per chunk) costed on CPU, for reference
        staged = CopyEngine(layout, stage=True)
        st_entry = staged.new_entry(pages)
        cases["page-major save, staged"] = lambda: staged.save(src_ids, out=st_entry)
        cases["page-major restore, staged"] = lambda: staged.restore(st_entry, dst_ids)
        if threads > 1:  # the same schedules on one thread, and per-view on as many threads
            single = CopyEngine(layout, threads=1)
            cases["page-major save, 1 thread"] = lambda: single.save(src_ids, out=pm_entry)
            cases["page-major restore, 1 thread"] = lambda: single.restore(pm_entry, dst_ids)
            cases["memcpy, 1 thread"] = _memcpy(pv_entry.view(-1), flat_dev, 1)
            cases[f"per-view save, {threads} threads"] = _per_view_threads(layout, src_list, pv_entry, threads)
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for name in names:  # warm-up: first touch of every buffer, allocator, CUDA context
        _timed(cases[name], sync)
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]  # rotate to spread drift
        for name in order:
            times[name].append(_timed(cases[name], sync))
    med = {name: statistics.median(ts) for name, ts in times.items()}

    # Byte identity: page-major entry == per-view entry of the same pages, and a round trip
    # through the page-major restore puts the same bytes in the destination pages.
    per_view_save(layout, src_list, pv_entry)
    engine.save(src_ids, out=pm_entry)
    identical = torch.equal(pv_entry, pm_entry)
    engine.restore(pm_entry, dst_ids)
    identical = identical and torch.equal(engine.save(dst_ids), pm_entry)
    # The same through the pool's rows: saved bytes == per-view bytes, restored pages read back equal.
    per_view_save(layout, src_list, pv_entry)  # the restore above rewrote the src pages it shares with dst
    engine.save(src_ids, out=rows)
    pool_identical = torch.equal(torch.cat(rows), pv_entry)
    engine.restore(rows, dst_ids)
    pool_identical = pool_identical and torch.equal(engine.save(dst_ids), pv_entry)
    identical = identical and pool_identical
    pool_pinned = all(r.is_pinned() for r in rows) if dev.type == "cuda" else False
    pool_pin_ms = pool.lock_ms
    carving.release()
    pool.close()

    # Pinned RAM the stock patterns left in the host cache (the page-major engine pins nothing).
    pinned_held = _pinned_held_bytes() - pinned_before if dev.type == "cuda" else 0
    pin_alloc = _fresh_pin_ms(entry_bytes) if dev.type == "cuda" else None

    memcpy_save = med["memcpy (save direction)"]
    memcpy_restore = med.get("memcpy (restore direction)", memcpy_save)
    figures = {
        "device": dev.type,
        "pages": pages,
        "entry_mib": round(entry_bytes / MiB, 1),
        "views": pages * len(layout.regions),
        "staged_chunk_pages": engine.chunk_pages,
        "staged": engine.stage,
        "reps": reps,
        "per_view_save_ms": round(med["per-view save"] * 1e3, 1),
        "save_ms": round(med["page-major save"] * 1e3, 1),
        "memcpy_ms": round(memcpy_save * 1e3, 1),
        "per_view_restore_ms": round(med["per-view restore"] * 1e3, 1),
        "restore_ms": round(med["page-major restore"] * 1e3, 1),
        "save_speedup_vs_perview": round(med["per-view save"] / med["page-major save"], 2),
        "save_vs_memcpy": round(med["page-major save"] / memcpy_save, 2),
        "restore_vs_memcpy": round(med["page-major restore"] / memcpy_restore, 2),
        "restore_vs_perview": round(med["page-major restore"] / med["per-view restore"], 2),
        "bytes_identical": bool(identical),
        "copy_threads": threads,
        "pool_save_ms": round(med["pool save"] * 1e3, 1),
        "pool_restore_ms": round(med["pool restore"] * 1e3, 1),
        "pool_pinned": pool_pinned,
        "pool_pin_ms": round(pool_pin_ms, 1),
    }

    def gbps(seconds: float) -> float:
        return round(entry_bytes / seconds / 1e9, 2)

    figures.update(
        save_gbps=gbps(med["page-major save"]),
        per_view_save_gbps=gbps(med["per-view save"]),
        memcpy_gbps=gbps(memcpy_save),
        restore_gbps=gbps(med["page-major restore"]),
        per_view_restore_gbps=gbps(med["per-view restore"]),
        memcpy_restore_ms=round(memcpy_restore * 1e3, 1),
        memcpy_restore_gbps=gbps(memcpy_restore),
    )
    if dev.type == "cuda":
        figures.update(
            per_view_pinned_save_ms=round(med["per-view save, pinned per save"] * 1e3, 1),
            per_view_pinned_save_gbps=gbps(med["per-view save, pinned per save"]),
            save_speedup_vs_perview_pinned=round(med["per-view save, pinned per save"] / med["page-major save"], 2),
            stock_get_cpu_copy_ms=round(med["stock get_cpu_copy"] * 1e3, 1),
            stock_get_cpu_copy_gbps=gbps(med["stock get_cpu_copy"]),
            memcpy_pinned_ms=round(med["memcpy into pinned"] * 1e3, 1),
            memcpy_pinned_gbps=gbps(med["memcpy into pinned"]),
            save_vs_memcpy_pinned=round(med["page-major save"] / med["memcpy into pinned"], 2),
            pin_alloc_ms=round(pin_alloc * 1e3, 1) if pin_alloc is not None else None,
            pinned_held_mib=round(pinned_held / MiB, 1),
            entry_pinned=bool(pm_entry.is_pinned()),
            memcpy_from_pinned_ms=round(med["memcpy from pinned"] * 1e3, 1),
            memcpy_from_pinned_gbps=gbps(med["memcpy from pinned"]),
            pool_save_gbps=gbps(med["pool save"]),
            pool_restore_gbps=gbps(med["pool restore"]),
            pool_save_speed_vs_pinned_memcpy=round(med["memcpy into pinned"] / med["pool save"], 2),
            pool_restore_speed_vs_pinned_memcpy=round(med["memcpy from pinned"] / med["pool restore"], 2),
            pool_save_vs_stock_get_cpu_copy=round(med["pool save"] / med["stock get_cpu_copy"], 2),
        )
    if f"per-view save, {threads} threads" in med:
        figures["per_view_save_threads_ms"] = round(med[f"per-view save, {threads} threads"] * 1e3, 1)
        figures["save_1thread_ms"] = round(med["page-major save, 1 thread"] * 1e3, 1)
        figures["restore_1thread_ms"] = round(med["page-major restore, 1 thread"] * 1e3, 1)
        figures["memcpy_1thread_ms"] = round(med["memcpy, 1 thread"] * 1e3, 1)
        figures["save_speedup_vs_perview_1thread"] = round(med["per-view save"] / med["page-major save, 1 thread"], 2)
    figures["targets"] = _target_table(figures)
    figures["targets_met"] = bool(identical and all(t["met"] for t in figures["targets"].values()))

    print(
        f"kv-park: {pages} pages x {layout.page_bytes} B = {entry_bytes / MiB:.1f} MiB, "
        f"{len(layout.regions)} region tensors, device {dev.type}, "
        + (f"staged in {engine.chunk_pages}-page chunks" if engine.stage else "gathered straight into the host entry")
        + f", {threads} copy thread(s), median of {reps} interleaved reps"
    )
    base = {name: memcpy_save for name in names if "save" in name or "get_cpu_copy" in name or "into pinned" in name}
    if dev.type == "cuda":  # the pinned pool against the pinned link, each direction
        base.update({"pool save": med["memcpy into pinned"], "stock get_cpu_copy": med["memcpy into pinned"],
                     "pool restore": med["memcpy from pinned"]})
    if "memcpy, 1 thread" in med:  # 1-thread schedules against the 1-thread memcpy
        base.update({name: med["memcpy, 1 thread"] for name in names if "1 thread" in name})
    print(f"{'schedule':30s} {'median ms':>10s} {'GiB/s':>7s} {'x memcpy':>9s}  (pool rows on CUDA: x the pinned memcpy)")
    for name in names:
        ref = base.get(name, memcpy_restore)
        print(f"{name:30s} {med[name] * 1e3:10.1f} {entry_bytes / med[name] / 2**30:7.2f} {med[name] / ref:9.2f}")
    if dev.type == "cuda":
        print(
            f"pool save {figures['pool_save_speed_vs_pinned_memcpy']}x the pinned memcpy's speed (target >= 0.8), "
            f"{figures['pool_save_vs_stock_get_cpu_copy']}x stock get_cpu_copy's time (target <= 1); pool restore "
            f"{figures['pool_restore_speed_vs_pinned_memcpy']}x the pinned memcpy's speed (target >= 0.8); "
            f"pool pinned in {figures['pool_pin_ms']} ms; bytes identical: {identical}"
        )
        return figures
    print(
        f"save {figures['save_speedup_vs_perview']}x faster than per-view (target >= 4), "
        f"{figures['save_vs_memcpy']}x memcpy (target <= 2.5); restore {figures['restore_vs_memcpy']}x memcpy "
        f"(target <= 3), {figures['restore_vs_perview']}x per-view (target <= 1); bytes identical: {identical}"
    )
    return figures
