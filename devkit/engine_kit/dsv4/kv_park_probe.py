"""The DSV4 kit server with a probe on kv_park inside its scheduler (devkit only).

Run as ``python -m devkit.engine_kit.dsv4.kv_park_probe <launch_server args>`` with ``$KV_PARK_PROBE_DIR``
set (as :mod:`.cone_probe`: SGLang's ``spawn`` re-imports this main module in the scheduler, so the
probe is installed there too). It wraps ``adapter.switches.kv_park.switch._park`` and
``adapter.switches.kv_park.restore._restore_one`` and ``ModelRunner.forward`` and appends one JSON line per event to
``$KV_PARK_PROBE_DIR/probe.jsonl``:

* ``park``: before the stock release, the bytes of every region of ``regions.layouts_for(pool)``
  (Full side: C4 / C128 latents, C4 index keys by full page; SWA side: main cache pages and the C4
  attention / indexer compressor state rings by SWA page) of the row's pages are kept in memory.
* ``restore``: after a restore, the same regions at the pages the tree now serves for the restored
  prefix, compared with the parked bytes: ``diff[region] = [differing bytes per page]``; plus the
  request's tokens at re-admission (``fill``), so a test can send them again.
* ``extend``: every extend forward whose row's prefix is exactly a restored prefix (same length and
  the same slots): the row's next-token logits are saved (``extend-<k>.pt``) with its ``seq``; the
  first extend after a restore (the restored row) and a later stock prefix hit with the same tokens
  read the same pages, so their logits can be compared exactly. For the restored row it also
  records how its prefill-written SWA rows of ``[n, seq)`` differ from the decode-written rows the
  row had at retraction (``decode_vs_prefill``, dequantised).

Nothing here runs in production.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from devkit.engine_kit.dsv4 import probe_hook

ENV = "KV_PARK_PROBE_DIR"
PARKED: dict[Any, dict[str, Any]] = {}  # rid -> the last park's capture
RESTORED: list[dict[str, Any]] = []  # restored prefixes: n, slots, rid, capture
_COUNT = [0]


def _out(record: dict[str, Any]) -> None:
    with open(Path(os.environ[ENV]) / "probe.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def _swa_rows(pool: Any, swa_slots: Any) -> dict[str, Any]:
    from devkit.engine_kit.dsv4 import kernels

    return {f"swa.{i}": kernels.read_v4_rows(buf, swa_slots, int(pool.swa_page_size))
            for i, buf in enumerate(pool.swa_kv_pool.kv_buffer)}


def _capture_park(req: Any, req_to_token_pool: Any, allocator: Any) -> None:
    import torch

    from adapter.switches.kv_park import regions

    pool = allocator.get_kvcache()
    page = int(allocator.page_size)
    committed = int(req.kv.kv_committed_len)
    slots = req_to_token_pool.req_to_token[req.kv.req_pool_idx, :committed].to(torch.int64)
    swa_slots = allocator.full_to_swa_index_mapping[slots].to(torch.int64)
    full, swa = regions.layouts_for(pool)
    full_pages = torch.div(slots[::page], page, rounding_mode="floor")
    swa_pages = {start: int(swa_slots[start]) // page for start in range(0, committed, page)
                 if bool((swa_slots[start:start + page] != 0).all())}
    n = committed // page * page
    cap = {"committed": committed, "full": [r.rows[full_pages].clone() for r in full.regions],
           "swa": {start: [r.rows[p].clone() for r in swa.regions] for start, p in swa_pages.items()}}
    if committed > n and bool((swa_slots[n:] != 0).all()):
        cap["tail_from"], cap["tail"] = n, _swa_rows(pool, swa_slots[n:])
    PARKED[req.rid] = cap
    _out({"ev": "park", "rid": req.rid, "committed": committed, "full_pages": full_pages.tolist(),
          "swa_pages": swa_pages})


def _capture_restore(state: Any, scheduler: Any, req: Any, meta: dict[str, Any]) -> None:
    from array import array

    import torch
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from adapter.switches.kv_park import regions

    tree, allocator = scheduler.tree_cache, scheduler.token_to_kv_pool_allocator
    page = int(allocator.page_size)
    fill = list(req.origin_input_ids + req.output_ids)
    tokens = meta["tokens"]
    n = min(len(tokens), req._compute_max_prefix_len(len(fill))) // page * page
    match = tree.match_prefix(MatchPrefixParams(key=RadixKey(
        token_ids=array("q", tokens[:n]), extra_key=req.extra_key, cache_salt=req.cache_salt)))
    slots = tree.path_device_indices(match.last_device_node).to(torch.int64)[:n]
    swa_slots = allocator.full_to_swa_index_mapping[slots].to(torch.int64)
    full, swa = regions.layouts_for(allocator.get_kvcache())
    cap = PARKED[req.rid]
    diff: dict[str, list[int]] = {}
    full_pages = torch.div(slots[::page], page, rounding_mode="floor")
    for k, r in enumerate(full.regions):
        now, then = r.rows[full_pages], cap["full"][k][: n // page]
        diff[r.name] = [int((now[i] != then[i]).sum()) for i in range(now.shape[0])]
    swa_checked = []
    for start in range(0, n, page):
        live = swa_slots[start:start + page]
        if not bool((live != 0).all()):
            continue
        swa_checked.append(start)
        for k, r in enumerate(swa.regions):
            then = cap["swa"].get(start)
            diff.setdefault(r.name, []).append(-1 if then is None else int((r.rows[int(live[0]) // page] != then[k]).sum()))
    RESTORED.append({"rid": req.rid, "n": n, "slots": slots.clone(), "cap": cap, "extends": 0})
    _out({"ev": "restore", "rid": req.rid, "n": n, "matched": int(match.device_prefix_len), "fill": fill,
          "parked_at": cap["committed"], "swa_pages_checked": swa_checked, "diff": diff})


def _patch_switch() -> None:
    from adapter.switches.kv_park import restore as rs
    from adapter.switches.kv_park import switch as sw

    park, restore_one = sw._park, rs._restore_one

    def probed_park(state, req, req_to_token_pool, allocator, tree_cache):
        try:
            if req.kv.holds_kv and not req.finished():
                _capture_park(req, req_to_token_pool, allocator)
        except Exception as exc:  # a probe never breaks the server
            _out({"ev": "probe_error", "where": "park", "error": repr(exc)})
        return park(state, req, req_to_token_pool, allocator, tree_cache)

    def probed_restore_one(state, scheduler, req, *, may_evict):
        entry = state.store.peek(req.rid)
        meta = None if entry is None else dict(entry.meta)
        before = state.store.stats.restored
        ok = restore_one(state, scheduler, req, may_evict=may_evict)
        if meta is not None and state.store.stats.restored > before:
            try:
                _capture_restore(state, scheduler, req, meta)
            except Exception as exc:  # a probe never breaks the server
                _out({"ev": "probe_error", "where": "restore", "error": repr(exc)})
        return ok

    sw._park, rs._restore_one = probed_park, probed_restore_one  # where the hook and the pass look them up


def _after_extend(runner: Any, fb: Any, out: Any) -> None:
    import torch

    pool = runner.token_to_kv_pool
    r2t = runner.req_to_token_pool.req_to_token
    logits = getattr(getattr(out, "logits_output", None), "next_token_logits", None)
    for i, row in enumerate(fb.req_pool_indices.tolist()):
        prefix, seq = int(fb.extend_prefix_lens_cpu[i]), int(fb.seq_lens_cpu[i])
        for restored in RESTORED:
            n = restored["n"]
            if prefix != n or not torch.equal(r2t[row, :n].to(torch.int64), restored["slots"]):
                continue
            _COUNT[0] += 1
            record: dict[str, Any] = {"ev": "extend", "rid": restored["rid"], "k": _COUNT[0], "prefix": prefix,
                                      "seq": seq, "first": restored["extends"] == 0}
            if logits is not None:
                torch.save(logits[i].float().clone(), Path(os.environ[ENV]) / f"extend-{_COUNT[0]}.pt")
            cap = restored["cap"]
            if restored["extends"] == 0 and cap.get("tail_from") == n:
                hi = min(seq, cap["committed"])
                swa_slots = pool.translate_loc_from_full_to_swa(r2t[row, n:hi].to(torch.int64)).to(torch.int64)
                now, stats = _swa_rows(pool, swa_slots), {}
                for name, then in cap["tail"].items():
                    m = min(then.shape[0], now[name].shape[0])
                    a, b = then[:m], now[name][:m]
                    stats[name] = {"rows": m, "rows_differ": int((a != b).any(-1).sum()),
                                   "max_abs": float((a - b).abs().max()) if m else 0.0,
                                   "max_ref": float(a.abs().max()) if m else 0.0}
                record["decode_vs_prefill"] = stats
            restored["extends"] += 1
            _out(record)
            break


def _after_extend_guarded(runner: Any, fb: Any, out: Any) -> None:
    if not RESTORED:
        return
    try:
        _after_extend(runner, fb, out)
    except Exception as exc:  # a probe never breaks the server
        _out({"ev": "probe_error", "where": "extend", "error": repr(exc)})


def _patch_runner(module: Any) -> None:
    probe_hook.after_extend_forward(module, "_kv_park_probe", _after_extend_guarded)


def install() -> None:
    if ENV not in os.environ:
        return
    _patch_switch()
    probe_hook.after_import(_patch_runner)


def events(probe_dir: str | Path) -> list[dict[str, Any]]:
    """The probe's JSON lines, in order."""
    path = Path(probe_dir) / "probe.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


install()

if __name__ == "__main__":
    probe_hook.launch_server()
