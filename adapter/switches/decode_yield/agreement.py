"""Every tensor-parallel rank takes rank 0's window: one int64 broadcast per window.

The decision reads a clock, and no two ranks measure the same wall times; ranks deciding alone
would defer different passes and pair the wrong forwards in their collectives. Arming is decided
on replicated scheduler state (the batch holds the non-final chunk, the running rows), so every
rank reaches :func:`agree` on the same pass. The group is SGLang's gloo group of the scheduler's TP
ranks, ``Scheduler.tp_cpu_group`` (set by ``Scheduler.init_model_worker``), so the broadcast never
touches the device stream; ``group_src=0`` is the group's first rank, whatever its global rank.
"""

from __future__ import annotations

from typing import Any


def agree(scheduler: Any, n: int) -> int:
    """Rank 0's ``n`` on every TP rank of ``scheduler`` (``n`` itself without TP)."""
    if int(getattr(scheduler, "tp_size", 1) or 1) <= 1:
        return n
    import torch
    import torch.distributed as dist

    value = torch.tensor([n], dtype=torch.int64)
    dist.broadcast(value, group=scheduler.tp_cpu_group, group_src=0)
    return int(value.item())
