"""What ``python -m adapter check`` predicts for kv_park: the refusal at the first scheduler pass when
the launch line turns HiCache on (``--enable-hierarchical-cache``)."""

from __future__ import annotations

from adapter.core import api
from adapter.switches.kv_park import beside_hicache


def predict(profile: api.Profile) -> api.Prediction:
    host_pool = beside_hicache.from_flags(profile.server_args) if profile.server_args is not None else None
    if profile.status != "installed" or host_pool is None:
        return api.Prediction()
    budget = int(profile.values.get("DSV41_KV_PARK_GIB") or 0)
    return api.Prediction(f"refused: {beside_hicache.reason(host_pool, budget)}", {"hicache": "on"})
