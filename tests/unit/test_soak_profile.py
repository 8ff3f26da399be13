"""The soak's profile per engine kit and its pass rule on receipts (no server)."""

from __future__ import annotations

from adapter.core import registry
from devkit import soak
from devkit.gate.kits import KITS


def test_the_dsv4_soak_profile_takes_the_kits_cone_depth_so_cone_replay_can_install():
    dsv4, mellum = soak.soak_profile("dsv4"), soak.soak_profile("mellum")
    assert dsv4["DSV41_SWA_CONE_TOKENS"] == KITS["dsv4"].profile_overrides()["DSV41_SWA_CONE_TOKENS"]
    # A multiple of the DSV4 page, at least the kit model's bound (768, logged at cache build); the
    # Mellum value 64 was refused there.
    assert int(dsv4["DSV41_SWA_CONE_TOKENS"]) % 256 == 0 and int(dsv4["DSV41_SWA_CONE_TOKENS"]) >= 768
    assert mellum["DSV41_SWA_CONE_TOKENS"] == "64"
    assert {k: v for k, v in dsv4.items() if k != "DSV41_SWA_CONE_TOKENS"} == {
        k: v for k, v in mellum.items() if k != "DSV41_SWA_CONE_TOKENS"}
    assert registry.resolve(dsv4).errors == []


def test_a_leg_whose_receipts_show_a_gap_is_not_clean():
    figures = {"failed": 0, "leak_reports": 0, "log_errors": 0, "probes_stable": True, "alive_at_end": True}
    assert soak.Leg("profile", {}, 1.0, {**figures, "receipt_gaps": []}).clean
    gap = "cone_replay refused on tp0: DSV41_SWA_CONE_TOKENS=64 is not a multiple of the page size 256"
    assert not soak.Leg("profile", {}, 1.0, {**figures, "receipt_gaps": [gap]}).clean
