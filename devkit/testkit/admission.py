"""Admission scenarios on the real scheduler harness (:mod:`devkit.testkit.scheduler`).

Shared by the page-rounded admission tests and ``python -m adapter bench admission``. The truth
they measure against is page-exact and independent of any admission rule: a live request that
ends with ``prompt + max_new`` tokens stores ``prompt + max_new - 1`` KV slots (the last sampled
token is never written), in whole pages from what it holds now.

API::

    need = kv_need_to_finish(req, page)           # slots (whole pages) req still has to allocate
    over = overcommit_tokens(h)                   # live need - (free + evictable), >= 0
    case = boundary_case(page=64, rows=3, size="raw")   # the boundary reproduction, run to the end
    stats = run_workload(WorkloadSpec(kind="waves"))    # the bench workloads, run to the end
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from adapter import cost_model
from devkit.testkit.scheduler import SchedulerHarness, build_scheduler


def _ceil(tokens: int, page: int) -> int:
    return -(-tokens // page) * page


def kv_need_to_finish(req: Any, page: int) -> int:
    """KV slots, in whole pages, ``req`` still allocates before it finishes (ignore_eos)."""
    final = len(req.origin_input_ids) + req.sampling_params.max_new_tokens - 1
    held = req.kv.kv_allocated_len
    return max(0, _ceil(final, page) - _ceil(held, page))


def live_requests(h: SchedulerHarness) -> list[Any]:
    """Requests holding or owed KV: the running batch, the last extend batch, the chunked one."""
    s = h.scheduler
    seen: dict[int, Any] = {}
    pools = [s.running_batch.reqs if s.running_batch is not None else []]
    if s.last_batch is not None:
        pools.append(s.last_batch.reqs)
    if s.chunked_req is not None:
        pools.append([s.chunked_req])
    for reqs in pools:
        for r in reqs:
            if not r.finished() and not r.is_retracted:
                seen[id(r)] = r
    return list(seen.values())


def free_tokens(h: SchedulerHarness) -> int:
    s = h.scheduler
    return s.token_to_kv_pool_allocator.available_size() + s.tree_cache.evictable_size()


def overcommit_tokens(h: SchedulerHarness) -> int:
    """How far the KV that live requests still need exceeds what the pool can give them."""
    page = h.scheduler.page_size
    need = sum(kv_need_to_finish(r, page) for r in live_requests(h))
    return max(0, need - free_tokens(h))


@dataclass
class BoundaryCase:
    page: int
    rows: int
    admitted: bool  # the new request ran its prefill on the pass it arrived
    overcommit_pages: int  # right after that pass
    retractions: int  # while everything decoded to the end
    prompt: int  # the new request's prompt length
    finished: bool  # everyone finished within 20 * R passes (stock never admits some exact fits)


def boundary_case(*, page: int, rows: int, size: str = "raw") -> BoundaryCase:
    """The overcommit reproduction: ``rows`` ignore_eos rows on a page boundary with ``R = 2*page + 1``
    tokens to go, then one request that ends on the same step as the rows.

    ``size="raw"``: the largest prompt the stock raw check admits (``extend + max_new + page <
    remaining``); ``size="exact"``: the prompt whose page-exact need is exactly the pages left
    once the rows' page-exact need is set aside.
    """
    left = 2 * page + 1
    h = build_scheduler(page_size=page, pool_tokens=(rows * 3 + 12) * page, max_reqs=rows + 4,
                        chunked_prefill_size=(rows * 3 + 12) * page)
    row_reqs = [h.add_request(page, max_new_tokens=left + 1) for _ in range(rows)]
    h.step()  # prefill the rows: each holds one full page and has `left` tokens to decode
    assert all(len(r.output_ids) == 1 and r.kv.kv_allocated_len == page for r in row_reqs)
    max_new = left + 1
    free = free_tokens(h)
    if size == "raw":
        prompt = free - rows * left - max_new - page - 1
    elif size == "exact":
        prompt = free - rows * _ceil(left, page) - max_new
    else:
        raise ValueError(f"size={size!r}: expected 'raw' or 'exact'")
    new = h.add_request(prompt, max_new_tokens=max_new)
    step = h.step()
    admitted = step.kind == "prefill" and new.rid in step.rids
    over = overcommit_tokens(h)
    everyone = [*row_reqs, new]
    for _ in range(20 * left):
        if all(r.finished() for r in everyone):
            break
        h.step()
    return BoundaryCase(
        page, rows, admitted, -(-over // page), sum(r.retraction_count for r in everyone), prompt,
        all(r.finished() for r in everyone),
    )


# -- the benchmark workloads ------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadSpec:
    """A near-full pool, run until every request finished.

    ``kind="waves"`` (the boundary case at scale, closed loop): a wave of ``wave_rows`` short decode rows
    with page-aligned prompts (whole cached pages, e.g. resumed agent contexts) and one random
    ``max_new``, so they decode in lockstep; right after their prefill, ``fills`` prompts that end
    with the wave, sized to the budget the stock raw check reports (as in the original
    reproduction). The next wave arrives when the pool is idle. Sizes depend only on the spec.
    ``kind="mixed"`` (open loop): independent arrivals with random prompt and output lengths.
    """

    kind: str = "waves"
    page: int = 64
    pool_pages: int = 256
    seed: int = 0
    # waves
    waves: int = 12
    wave_rows: int = 24
    wave_prompt_pages: tuple[int, int] = (1, 8)
    wave_max_new: tuple[int, int] = (64, 192)
    fills: int = 1
    # mixed
    arrivals: int = 300
    arrival_every: int = 2
    prompt_tokens: tuple[int, int] = (64, 2000)
    max_new: tuple[int, int] = (16, 320)
    max_passes: int = 50_000


@dataclass
class WorkloadStats:
    passes: int = 0  # scheduler passes until every request finished
    forwards: int = 0  # passes that ran a batch
    admissions: int = 0  # prefill passes
    overcommit_pages: int = 0  # summed over prefill passes, measured right after each
    overcommit_events: int = 0  # prefill passes that left the pool overcommitted
    retractions: int = 0  # decode rows retracted ("KV cache pool is full")
    recomputed_tokens: int = 0  # prefill tokens of retracted requests run again
    useful_tokens: int = 0  # prompt + output tokens of the finished requests
    modelled_ps: int = 0  # forward time under adapter.cost_model's default coefficients

    @property
    def useful_tokens_per_forward(self) -> float:
        return self.useful_tokens / max(self.forwards, 1)

    @property
    def useful_tokens_per_modelled_second(self) -> float:
        return self.useful_tokens * 10**12 / max(self.modelled_ps, 1)


class _Run:
    def __init__(self, spec: WorkloadSpec):
        self.spec, self.page, self.pool = spec, spec.page, spec.pool_pages * spec.page
        self.h = build_scheduler(page_size=self.page, pool_tokens=self.pool, max_reqs=256,
                                 chunked_prefill_size=self.pool, max_context_len=self.pool)
        self.requests: list[Any] = []
        self.stats = WorkloadStats()

    def add(self, prompt: int, max_new: int) -> Any:
        req = self.h.add_request(prompt, max_new_tokens=max_new)
        self.requests.append(req)
        return req

    def idle(self) -> bool:
        return all(r.finished() for r in self.requests)

    def step(self) -> Any:
        stats, page = self.stats, self.page
        if stats.passes >= self.spec.max_passes:
            raise RuntimeError(f"run_workload: not done after {self.spec.max_passes} passes")
        stained = {r.rid for r in self.requests if r.retraction_count}
        step = self.h.step()
        stats.passes += 1
        stats.forwards += step.kind != "idle"
        batch = self.h.scheduler.last_batch
        if step.kind == "prefill":
            stats.modelled_ps += cost_model.chunk_cost(zip(step.extend_lens, step.prefix_lens))
        elif step.kind == "decode":
            stats.modelled_ps += cost_model.step_cost(len(r.origin_input_ids) + len(r.output_ids) for r in batch.reqs)
        if step.kind == "prefill":
            stats.admissions += 1
            stats.recomputed_tokens += sum(n for rid, n in zip(step.rids, step.extend_lens) if rid in stained)
            over = overcommit_tokens(self.h)
            stats.overcommit_pages += -(-over // page)
            stats.overcommit_events += over > 0
        return step

    def finish(self) -> WorkloadStats:
        self.stats.retractions = sum(r.retraction_count for r in self.requests)
        self.stats.useful_tokens = sum(len(r.origin_input_ids) + len(r.output_ids) for r in self.requests)
        return self.stats


def run_workload(spec: WorkloadSpec) -> WorkloadStats:
    """Drive the real scheduler through the workload to the end; count what admission did."""
    rng = random.Random(spec.seed)
    run = _Run(spec)
    page = spec.page
    if spec.kind == "waves":
        for _ in range(spec.waves):
            max_new = rng.randint(*spec.wave_max_new)
            rows = [run.add(rng.randint(*spec.wave_prompt_pages) * page, max_new) for _ in range(spec.wave_rows)]
            while not all(len(r.output_ids) for r in rows):
                run.step()  # the wave's prefill
            for _ in range(spec.fills):  # the stock raw budget: extend + max_new + page < remaining
                raw_left = free_tokens(run.h) - sum(max_new - len(r.output_ids) for r in rows)
                prompt = raw_left - max_new - page - 1
                if prompt > 0:
                    rows.append(run.add(prompt, max_new))
            while not run.idle():
                run.step()
    elif spec.kind == "mixed":
        pending = [(i * spec.arrival_every, rng.randint(*spec.prompt_tokens), rng.randint(*spec.max_new))
                   for i in range(spec.arrivals)]
        while pending or not run.idle():
            while pending and pending[0][0] <= run.stats.passes:
                run.add(*pending.pop(0)[1:])
            run.step()
    else:
        raise ValueError(f"kind={spec.kind!r}: expected 'waves' or 'mixed'")
    return run.finish()
