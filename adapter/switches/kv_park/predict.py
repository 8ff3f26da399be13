"""What ``python -m adapter check`` predicts for kv_park: beside HiCache (``--enable-hierarchical-cache``)
the park pool is carved out of HiCache's host pool, so the profile has one host-RAM total, HiCache's, and
``check`` says what the carve-out takes from HiCache's prefix capacity in tokens; without HiCache,
``DSV41_KV_PARK_GIB`` of host RAM page-locked at boot (CUDA), agreed across the TP ranks on the host."""

from __future__ import annotations

from adapter.core import api
from adapter.switches.kv_park import beside_hicache


def predict(profile: api.Profile) -> api.Prediction:
    if profile.status != "installed":
        return api.Prediction()
    budget = int(profile.values.get("DSV41_KV_PARK_GIB") or 8)
    host_pool = beside_hicache.from_flags(profile.server_args) if profile.server_args is not None else None
    if host_pool is None:
        note = (f"host RAM: DSV41_KV_PARK_GIB={budget} GiB per rank, page-locked once at boot, before the first "
                f"scheduler pass, on a CUDA KV pool; the TP ranks on a host book it together and refuse together "
                f"when the host cannot hold all of them (a boot that cannot lock it fails naming the size and the limit)")
        return api.Prediction(None, {"hicache": "off", "host_gib": budget}, notes=(note,))
    take = beside_hicache.carve_out_take(profile.server_args, budget)
    return api.Prediction(None, {"hicache": "on"}, notes=(beside_hicache.prediction_note(host_pool, budget, take),))
