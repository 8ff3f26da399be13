"""The gate's cache phases on an in-process real SGLang scheduler (devkit only).

:func:`devkit.engine_kit.workload.run_cache_phases` sends its requests through an ``api`` object;
:class:`SchedulerApi` is one over :mod:`devkit.testkit.scheduler` (real pools, real radix cache,
real admission; the forward is simulated, so the output tokens are the harness's and only the
cache figures mean anything). A pool geometry for the gate is found here first (seconds, not a
server boot), e.g. the DSV4 kit's: ``build_scheduler(page_size=256, dsv4=True, ...)``.

Each request runs alone to its end, as the gate's sequential requests do; ``cached_tokens`` is
the prefix the request's first prefill pass ran from (what SGLang's cache report says).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from devkit.testkit.scheduler import SchedulerHarness


@dataclass
class SchedulerApi:
    harness: SchedulerHarness

    def flush_cache(self, base_url: str) -> None:
        """What ``Scheduler.flush_cache`` empties on an idle scheduler: the tree (with HiCache, its host
        pools too), the request slots and the KV allocator (the harness has no grammar or metrics)."""
        s = self.harness.scheduler
        s.last_batch = None
        s.tree_cache.reset()
        s.req_to_token_pool.clear()
        s.token_to_kv_pool_allocator.clear()
        s.req_to_token_pool.reset_aux_cache_allocator()

    def generate(self, base_url: str, input_ids: list[int], max_new_tokens: int, timeout_s: float = 0.0,
                 logprobs: bool = False, rid: str | None = None) -> dict[str, Any]:
        h = self.harness
        req = h.make_request(len(input_ids), max_new_tokens, prompt_ids=input_ids, rid=rid)
        h.add_request(req)
        cached = None
        while not req.finished():
            step = h.step()
            if cached is None and step.kind == "prefill" and req.rid in step.rids:
                cached = step.prefix_lens[step.rids.index(req.rid)]
        h.drain()
        h.finish_in_flight()
        meta: dict[str, Any] = {"cached_tokens": cached or 0}
        if logprobs:
            meta["output_token_logprobs"] = []  # the simulated forward has none
        return {"output_ids": list(req.output_ids), "meta_info": meta}
