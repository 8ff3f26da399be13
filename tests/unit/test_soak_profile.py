"""The soak's profile per engine kit and its pass rule on receipts (no server)."""

from __future__ import annotations

from adapter.core import registry
from devkit import soak
from devkit.engine_kit.model_kits import KITS


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


def test_the_soak_times_a_streamed_requests_first_token_and_each_token_gap():
    tally = soak.Tally()
    # sent at 10.0; an empty first chunk, then tokens at 10.5 (1), 10.6 (2) and 10.9 (4: two at once)
    tally.timed(10.0, [(10.1, 0), (10.5, 1), (10.6, 2), (10.9, 4)])
    tally.timed(0.0, [(20.0, 1), (20.2, 2)], first=False)  # a decode stream: its gaps only
    lat = tally.latency()
    assert lat["requests_timed"] == 1 and lat["mean_ttft_ms"] == 500.0
    assert sorted(round(x * 1000) for x in tally.itl_s) == [100, 150, 200]
    assert lat["mean_itl_ms"] == 150.0 and lat["p99_itl_ms"] == 199.0  # numpy's linear percentile, as bench_serving
