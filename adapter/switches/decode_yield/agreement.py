"""Every tensor-parallel rank takes rank 0's window: one int64 broadcast per window on the CPU group,
and a second for a window whose rest is planned again after its first half.

The closed loop (:mod:`adapter.switches.decode_yield.controller`) reads a clock, and no two ranks
measure the same wall times, so ranks deciding alone would defer different passes: rank 1 would
run a decode step while rank 0 runs the chunk, and their collectives would pair the wrong forwards.
Agreeing on identical inputs instead would mean sharing every sample (one collective per pass);
rank 0 deciding and broadcasting its ``N`` costs one collective per *window*, at the one point
every rank reaches alike: arming is decided on replicated scheduler state (the batch holds the
non-final chunk, the running rows), so every rank calls :func:`agree` on the same pass. The
re-plan of a window's second half is reached alike too: it comes after a count of the window's
steps derived from the agreed ``N``, and the engine's deferral counter is the same on every rank.

The group is SGLang's own gloo group of the scheduler's TP ranks, ``Scheduler.tp_cpu_group``
(set by ``Scheduler.init_model_worker`` from ``get_parallel().tp_group.cpu_group``; the scheduler
already broadcasts request batches on the same kind of group), so the broadcast never touches the
device stream. ``group_src=0`` is the group's first rank, whatever its global rank.
"""

from __future__ import annotations

from typing import Any


def ranks(scheduler: Any) -> int:
    """The scheduler's TP size (1: nothing to agree on)."""
    return int(getattr(scheduler, "tp_size", 1) or 1)


def agree(scheduler: Any, n: int) -> int:
    """Rank 0's ``n`` on every TP rank of ``scheduler`` (``n`` itself without TP)."""
    if ranks(scheduler) <= 1:
        return n
    import torch
    import torch.distributed as dist

    value = torch.tensor([n], dtype=torch.int64)
    dist.broadcast(value, group=scheduler.tp_cpu_group, group_src=0)
    return int(value.item())
