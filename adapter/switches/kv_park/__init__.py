"""KV parking to host RAM (``DSV41_KV_PARK=ram``): a retracted row's pages are parked and restored
on re-admission instead of re-prefilled. Rollback: unset ``DSV41_KV_PARK``.

Map (per module: what it cares about; in -> out)

* :mod:`~adapter.switches.kv_park.switch`: the hooks only; ``release_req`` /
  ``get_next_batch_to_run`` / ``build_kv_cache`` (and the graph-capture and DSV4-offload wraps) ->
  a park, the pass's restores, the pool's boot. Its docstring says what the switch changes and why.
* :mod:`~adapter.switches.kv_park.park`: what a retraction frees past what the tree holds; a
  retracted row -> an offer to the store (queued on the device) or ``not_parked reason=..``.
* :mod:`~adapter.switches.kv_park.restore`: a waiting parked request -> pages allocated, bytes
  written, inserted and pinned, one named step per phase (entry checked, tree's part on the device,
  pages allocated, written and inserted); or ``dropped reason=..``.
* :mod:`~adapter.switches.kv_park.tree`: what the radix tree holds of a request (read-only
  matches) and the pins that keep a waiting request's pages until admission.
* :mod:`~adapter.switches.kv_park.state`: the process state (store, engines per pool, pins) and the
  CUDA streams whose work writes KV (what a copy follows, what waits for it).
* :mod:`~adapter.switches.kv_park.pool_boot`: the park pool at boot; the scheduler's KV cache ->
  a pinned pool (ranks agreed) or a carve-out of HiCache's, one timed ``kv_park pool`` line.
* :mod:`~adapter.switches.kv_park.regions`: which tensors of a pool make up a page; a KV pool ->
  one or two :class:`~adapter.switches.kv_park.page_format.PageLayout` (Full side, SWA side) or
  ``Unsupported`` with the reason.
* :mod:`~adapter.switches.kv_park.page_format`: the byte format of a parked entry; device tensors ->
  regions and a page layout (a page's bytes, in order), page ids checked on the host.
* :mod:`~adapter.switches.kv_park.engine`: the copy schedule; page ids + a layout -> host rows and
  back (staged, chunked, two streams on CUDA; events, never a host wait, into pinned rows).
* :mod:`~adapter.switches.kv_park.store`: the parked entries under one budget; offers -> entries
  (LRU eviction, refusals, the failure latch, device events queried to free pool rows).
* :mod:`~adapter.switches.kv_park.save_worker`: the store's background thread; a queued copy -> run
  off the caller's thread (what a dead or stopped worker left fails, never hangs).
* :mod:`~adapter.switches.kv_park.host_pool`: the pinned park pool; a size -> page-aligned chunks
  page-locked once, carved per entry; the host's room (``MemAvailable``, cgroup).
* :mod:`~adapter.switches.kv_park.host_ledger`: one verdict on host RAM for a server's TP ranks on
  a host; a rank's pool size -> pass or the group's refusal (a flock'd ledger file).
* :mod:`~adapter.switches.kv_park.beside_hicache`: one host budget with HiCache; HiCache's host
  pools -> the park pool carved out of them, and what ``check`` says it takes (tokens).
* :mod:`~adapter.switches.kv_park.capture`: CUDA graph captures vs copies; a global-mode capture ->
  copies held back until it ends.
* :mod:`~adapter.switches.kv_park.dsv4_offload`: SGLang's own DSV4 retraction offload (PD decode's
  ``cpu_tensor`` backup) through the copy engine.
* :mod:`~adapter.switches.kv_park.outcomes`: a log's kv_park lines -> retractions split by what
  kv_park did with each (parked / not parked and why / restored / resumed from the tree / dropped).
* :mod:`~adapter.switches.kv_park.predict`: a profile -> what ``python -m adapter check`` says
  (host RAM per rank, or the carve-out beside HiCache).

Importing this package imports neither SGLang nor the switch.
"""
