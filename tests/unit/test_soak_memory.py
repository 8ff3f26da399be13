"""The soak's memory judgement (``devkit.soak.memory``), table-driven on RSS series: a leak fails
whatever the warm-up, a warm-up that levels off passes whatever its size."""

from __future__ import annotations

import random

import pytest

from devkit.soak import memory

MIB = 1024  # KiB


def series(minutes: float, per_min: float, base_mib: float, *, warm_mib: float = 0.0, warm_min: float = 3.0,
           leak_kib: float = 0.0, noise_mib: float = 0.0, peaks_mib: float = 0.0, wander_mib: float = 0.0,
           drop_mib: float = 0.0, drop_at: int = 0, seed: int = 0) -> list[tuple]:
    """A scheduler's RSS every 2 s: ``base`` plus a warm-up of ``warm_mib`` that levels off over
    ``warm_min`` minutes, ``leak_kib`` per request served, noise, a transient peak (a big
    prefill's temporaries) on one sample in ten, a floor that wanders by up to ``wander_mib``
    every 30 s (the allocator keeping or giving back what a burst took), and ``drop_mib`` handed
    back at once from the ``drop_at``-th request on (what both DSV4 boots did near minute 8)."""
    rng = random.Random(seed)
    rows = []
    level = 0.0
    for i in range(int(minutes * 30) + 1):
        t = i * 2.0
        served = int(t / 60 * per_min)
        warm = warm_mib * min(1.0, t / 60 / warm_min) ** 0.5
        if wander_mib and i % 15 == 0:  # drawn only then: the other series keep their draws
            level = rng.uniform(-wander_mib, wander_mib)
        drop = drop_mib if drop_mib and served >= drop_at else 0.0
        kib = (base_mib + warm + level - drop + rng.uniform(-noise_mib, noise_mib)) * MIB + leak_kib * served
        if peaks_mib and rng.random() < 0.1:
            kib += rng.uniform(0, peaks_mib) * MIB
        rows.append((t, served, int(kib)))
    return rows


# A DSV4 kit soak on an unloaded machine: stock grew 25 % in its first 3 minutes, the profile 18 % over 10
# (warm 1,703 MiB, peak 2,335, final 2,015) at about 53 requests a minute.
DSV4_STOCK = series(3, 53, 1400, warm_mib=350, noise_mib=20, peaks_mib=300, seed=1)
DSV4_PROFILE = series(10, 53, 1400, warm_mib=600, warm_min=5, noise_mib=20, peaks_mib=600, seed=2)

CASES = [
    # (name, profile series, stock series, verdict, rule)
    ("dsv4_warm_up_that_levels_off", DSV4_PROFILE, DSV4_STOCK, "pass", "plateau"),
    ("dsv4_warm_up_and_a_leak_of_256_kib_a_request",
     series(10, 53, 1400, warm_mib=600, noise_mib=20, peaks_mib=600, leak_kib=256, seed=2), DSV4_STOCK, "leak", "plateau"),
    ("mellum_flat_30_minutes", series(30, 200, 1130, noise_mib=5, seed=3), [], "pass", "plateau"),
    ("mellum_a_leak_of_150_kib_a_request", series(10, 75, 1130, noise_mib=5, leak_kib=150, seed=4), [], "leak", "plateau"),
    ("still_warming_at_half_time_but_levelling", series(10, 53, 1400, warm_mib=600, warm_min=6, noise_mib=10, seed=5),
     [], "pass", "plateau"),
    ("short_run_growing_as_its_control", series(1.5, 53, 1400, warm_mib=350, noise_mib=10, seed=6),
     series(1, 53, 1400, warm_mib=350, noise_mib=10, seed=7), "pass", "control"),
    ("short_run_growing_past_its_control", series(1.5, 53, 1400, warm_mib=350, noise_mib=10, leak_kib=4096, seed=6),
     series(1, 53, 1400, warm_mib=350, noise_mib=10, seed=7), "leak", "control"),
    ("a_warm_up_past_half_time_cancels_against_a_control_as_long",
     series(10, 53, 1400, warm_mib=600, warm_min=12, noise_mib=20, peaks_mib=600, seed=9),
     series(10, 53, 1400, warm_mib=600, warm_min=12, noise_mib=20, peaks_mib=600, seed=10), "pass", "paired"),
    ("the_same_warm_up_alone_reads_as_growth",
     series(10, 53, 1400, warm_mib=600, warm_min=12, noise_mib=20, peaks_mib=600, seed=9), [], "leak", "plateau"),
    ("a_leak_past_a_control_as_long",
     series(10, 53, 1400, warm_mib=600, warm_min=12, noise_mib=20, peaks_mib=600, leak_kib=256, seed=9),
     series(10, 53, 1400, warm_mib=600, warm_min=12, noise_mib=20, peaks_mib=600, seed=10), "leak", "paired"),
    ("a_thin_run_whose_floor_wanders_more_than_the_limit_resolves",
     series(10, 20, 1400, wander_mib=40, noise_mib=10, seed=11), [], "inconclusive", "plateau"),
    ("the_same_thin_run_with_a_leak_past_its_resolution", series(10, 20, 1400, wander_mib=40, noise_mib=10,
                                                                   leak_kib=16384, seed=11), [], "leak", "plateau"),
    ("a_short_run_whose_floor_wanders_past_the_control_margin",
     series(4, 30, 1400, wander_mib=80, noise_mib=10, seed=12), series(3, 30, 1400, wander_mib=80, seed=112),
     "inconclusive", "control"),
    ("short_run_without_a_control", series(1.5, 53, 1400, noise_mib=10, seed=8), [], "unjudged", None),
    ("no_samples", [], [], "unjudged", None),
]


@pytest.mark.parametrize("profile, stock, verdict, rule", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_soak_judges_memory_by_its_second_half_or_its_stock_control(profile, stock, verdict, rule):
    judged = memory.judge(profile, stock)
    assert (judged.verdict, judged.rule) == (verdict, rule), judged.reason


def test_the_old_absolute_rule_would_have_failed_the_levelling_dsv4_warm_up():
    """The case the judgement exists for: growth from the sample at 20 % of the run is far over the
    old 5 % limit, yet the second half is flat."""
    warm = next(s for s in DSV4_PROFILE if s[0] >= DSV4_PROFILE[-1][0] * 0.2)
    assert (DSV4_PROFILE[-1][2] - warm[2]) / warm[2] * 100 > 5
    judged = memory.judge(DSV4_PROFILE, DSV4_STOCK)
    assert judged.verdict == "pass" and abs(judged.mib_per_1000_requests) < memory.LEAK_MIB_PER_1000


def test_the_plateau_rate_is_the_planted_leak_per_request():
    """A leak of K KiB a request reads as K * 1000 / 1024 MiB per 1,000 requests, noise aside."""
    judged = memory.judge(series(10, 60, 1200, leak_kib=200), [])
    assert judged.mib_per_1000_requests == pytest.approx(200 * 1000 / 1024, rel=0.05)


_SEAM_PROBE = """
import sys
from pathlib import Path
import planted_leak
from sglang.srt.managers.scheduler import Scheduler

def rss():
    return int(next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:")).split()[1])

before = rss()
for _ in range(20):
    try:
        Scheduler.handle_generate_request(None, None)  # the wrapper keeps its KiB, then stock fails on None
    except Exception:
        pass
print(len(planted_leak.KEPT), rss() - before)
"""


@pytest.mark.spawns
def test_the_planted_leak_keeps_its_kib_in_the_scheduler_for_every_generate_request(tmp_path):
    """The seam ``soak --plant-leak-kib`` uses: with its folder first on ``PYTHONPATH``, SGLang's
    ``Scheduler.handle_generate_request`` keeps K KiB a call, resident (RSS grows by about K per call)."""
    import os
    import subprocess
    import sys

    from devkit.engine_kit import launcher

    env = launcher.with_seams({k: v for k, v in os.environ.items() if not k.startswith("DSV41_")},
                              "planted_leak", SOAK_PLANTED_LEAK_KIB="1024")
    out = subprocess.run([sys.executable, "-c", _SEAM_PROBE], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    kept, grew_kib = map(int, out.stdout.split()[-2:])
    assert kept == 20 and 20 * 1024 * 0.9 <= grew_kib <= 20 * 1024 * 1.5, (kept, grew_kib)


def _recorded(leg: str) -> list[list[float]]:
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parent / "soak_rss" / f"dsv4_10min_{leg}.json").read_text())["t_s_served_kib"]


def _planted(rows: list[list[float]], kib_per_request: int) -> list[tuple]:
    return [(t, served, kib + kib_per_request * served) for t, served, kib in rows]


def test_a_leak_planted_on_a_recorded_dsv4_soak_fails_it_by_the_rule_that_applies():
    """The DSV4 kit's 10-minute soak on the loaded machine (recorded): 135 requests, 38 between the
    second half's quarters, too few for the plateau, so the stock control (3 minutes) judges it.
    The same series with 1 MiB kept a request fails by that rule; with 256 KiB kept a request and
    the served counts four times higher (an unloaded machine's throughput) the plateau judges it."""
    profile, stock = _recorded("profile"), _recorded("stock")
    recorded = memory.judge(profile, stock)
    assert recorded.rule == "control" and recorded.requests_between is None
    leaked = memory.judge(_planted(profile, 1024), stock)
    assert (leaked.rule, leaked.verdict) == ("control", "leak"), leaked.reason
    assert leaked.profile_growth_pct > recorded.profile_growth_pct
    busier = [(t, 4 * served, kib) for t, served, kib in profile]
    assert memory.judge(_planted(busier, 256), stock).verdict == "leak"
    rate = memory.judge(_planted(busier, 256), stock).mib_per_1000_requests
    base = memory.judge(busier, stock).mib_per_1000_requests
    assert rate - base == pytest.approx(256 * 1000 / 1024, rel=0.15)  # the planted amount, read back (floors: noise)


def test_a_real_soak_with_the_planted_leak_fails_on_it_and_passes_with_it_taken_back_out():
    """Recorded: the Mellum kit's profile boot with the ``planted_leak`` seam keeping 4096 KiB per
    generate request (5 minutes, 412 requests). The plateau reads about the planted 4,000 MiB per
    1,000 requests and fails it; the same series less 4096 KiB per served request is flat and passes."""
    import json
    from pathlib import Path

    rows = json.loads((Path(__file__).parent / "soak_rss" / "mellum_5min_planted_4096kib_profile.json").read_text())
    planted = rows["t_s_served_kib"]
    judged = memory.judge(planted, [])
    assert (judged.verdict, judged.rule) == ("leak", "plateau"), judged.reason
    assert judged.mib_per_1000_requests == pytest.approx(4096 * 1000 / 1024, rel=0.15)
    taken_out = [(t, served, kib - 4096 * served) for t, served, kib in planted]
    assert memory.judge(taken_out, []).verdict == "pass"


def test_a_rule_passes_only_with_a_resolution_finer_than_its_limit():
    """The plateau's resolution shrinks with the requests between its quarters: the same wandering
    floor is inconclusive over 50 requests and passes over 1,250."""
    thin = memory.judge(series(10, 20, 1400, wander_mib=40, noise_mib=10, seed=11), [])
    busy = memory.judge(series(10, 500, 1400, wander_mib=40, noise_mib=10, seed=11), [])
    assert thin.verdict == "inconclusive" and thin.resolution > memory.LEAK_MIB_PER_1000, thin.reason
    assert busy.verdict == "pass" and busy.resolution < memory.LEAK_MIB_PER_1000, busy.reason
    assert busy.resolution == pytest.approx(thin.resolution * thin.requests_between / busy.requests_between, rel=0.01)


@pytest.mark.parametrize("passed, memory_verdict, verdict", [
    (True, "pass", "PASS"), (True, "inconclusive", "INCONCLUSIVE"), (True, "unjudged", "INCONCLUSIVE"),
    (False, "pass", "FAIL"), (False, "inconclusive", "FAIL"), (False, "leak", "FAIL"),
])
def test_the_soak_passes_only_on_a_judged_memory_and_is_inconclusive_without_one(passed, memory_verdict, verdict):
    from devkit import soak

    assert soak.soak_verdict(passed, memory_verdict) == verdict


def test_a_dsv4_soak_gets_a_stock_control_as_long_as_its_profile_unless_told():
    """The DSV4 kit's warm-up outlasts half a 10-minute run (its stock boot climbs as the profile's):
    only a control as long takes it out of the plateau; Mellum's flattens in its first minute."""
    from devkit import soak

    assert soak.default_stock_minutes("dsv4", 10.0) == 10.0
    assert soak.default_stock_minutes("mellum", 10.0) == 1.0


def _recorded_equal_control(leg: str) -> list:
    import json
    from pathlib import Path

    path = Path(__file__).parent / "soak_rss" / f"dsv4_10min_equal_control_{leg}.json"
    return json.loads(path.read_text())["t_s_served_kib"]


def test_a_recorded_dsv4_soak_passes_its_kits_limit_and_cannot_resolve_mellums():
    """Recorded: ``soak --model dsv4 --minutes 10 --stock-minutes 10`` on the loaded machine (247 /
    244 requests). Stock's floor climbs as the profile's (about 1,330 to 1,790 MiB over the first
    six minutes), both drop about 300 MiB near minute 8, at about the same request. Paired at the
    same requests, that cancels: the run resolves about 450 MiB per 1,000 requests, under the DSV4
    kit's 1 MiB a request (a pass that says so) and over Mellum's 100 KiB (inconclusive). A leak
    of twice the DSV4 limit planted on it fails; the plateau alone (no pairing) resolves over four
    times coarser."""
    profile, stock = _recorded_equal_control("profile"), _recorded_equal_control("stock")
    dsv4 = memory.judge(profile, stock, memory.limit_for("dsv4"))
    assert (dsv4.verdict, dsv4.rule) == ("pass", "paired"), dsv4.reason
    assert "no leak above 1,024 KiB a request" in dsv4.reason
    assert memory.LEAK_MIB_PER_1000 < dsv4.resolution < memory.limit_for("dsv4")
    assert memory.judge(profile, stock).verdict == "inconclusive"
    alone = memory.plateau(memory.samples_of(profile))
    assert alone.resolution > 4 * dsv4.resolution, (alone.reason, dsv4.reason)
    for kib in (2048, 8192):
        leaked = memory.judge(_planted(profile, kib), stock, memory.limit_for("dsv4"))
        assert (leaked.verdict, leaked.rule) == ("leak", "paired"), leaked.reason


# A DSV4-like soak against a control as long (25 requests a minute, a warm-up past half time, the
# floor wandering by 20 MiB every 30 s, 300 MiB handed back at the 210th request on both boots).
_DSV4_LIKE = dict(warm_mib=500, warm_min=12, noise_mib=5, peaks_mib=300, wander_mib=20, drop_mib=300, drop_at=210)
DSV4_LIMIT = memory.limit_for("dsv4")
PAIRED_CASES = [
    # (name, profile, stock, limit, verdict)
    ("warm_up_and_a_shared_step_then_flat_passes_the_dsv4_limit",
     series(10, 25, 1200, **_DSV4_LIKE, seed=21), series(10, 25, 1200, **_DSV4_LIKE, seed=22), DSV4_LIMIT, "pass"),
    ("a_leak_of_4_mib_a_request_beside_it_fails",
     series(10, 25, 1200, **_DSV4_LIKE, leak_kib=4096, seed=21), series(10, 25, 1200, **_DSV4_LIKE, seed=22),
     DSV4_LIMIT, "leak"),
    ("the_same_flat_run_cannot_resolve_100_kib_a_request",
     series(10, 25, 1200, **_DSV4_LIKE, seed=21), series(10, 25, 1200, **_DSV4_LIKE, seed=22),
     memory.LEAK_MIB_PER_1000, "inconclusive"),
    ("floors_that_wander_by_150_mib_apart_cannot_resolve_the_dsv4_limit",
     series(10, 25, 1200, wander_mib=150, noise_mib=5, seed=23), series(10, 25, 1200, wander_mib=150, seed=24),
     DSV4_LIMIT, "inconclusive"),
    ("a_busy_flat_mellum_like_pair_resolves_100_kib",
     series(10, 200, 1130, noise_mib=3, seed=25), series(10, 200, 1130, noise_mib=3, seed=26),
     memory.LEAK_MIB_PER_1000, "pass"),
]


@pytest.mark.parametrize("profile, stock, limit, verdict", [c[1:] for c in PAIRED_CASES],
                         ids=[c[0] for c in PAIRED_CASES])
def test_a_control_as_long_judges_the_profiles_floor_above_stocks_at_the_same_requests(profile, stock, limit,
                                                                                          verdict):
    judged = memory.judge(profile, stock, limit)
    assert (judged.verdict, judged.rule) == (verdict, "paired"), judged.reason


def test_the_paired_rate_reads_back_a_planted_leak_and_the_shared_warm_up_and_step_alone_read_as_growth():
    """The pairing is what takes the warm-up and the step out: the same profile judged by the plateau
    alone is not a pass; a leak planted on the profile reads back as its size above stock's."""
    profile, stock = series(10, 25, 1200, **_DSV4_LIKE, seed=21), series(10, 25, 1200, **_DSV4_LIKE, seed=22)
    assert memory.plateau(memory.samples_of(profile), DSV4_LIMIT).verdict != "pass"
    base = memory.judge(profile, stock, DSV4_LIMIT).mib_per_1000_requests
    leaked = memory.judge(_planted(profile, 4096), stock, DSV4_LIMIT).mib_per_1000_requests
    assert leaked - base == pytest.approx(4096 * 1000 / 1024, rel=0.02)


def test_each_kit_has_a_leak_limit_and_a_pass_names_it():
    from devkit import soak

    assert set(memory.LEAK_KIB_PER_REQUEST) == set(soak.MODELS)
    assert memory.limit_for("mellum") == memory.LEAK_MIB_PER_1000
    assert memory.limit_for("dsv4") == pytest.approx(1000.0)
    judged = memory.judge(series(30, 200, 1130, noise_mib=5, seed=3), [], memory.limit_for("mellum"))
    assert judged.verdict == "pass" and "no leak above 100 KiB a request" in judged.reason, judged.reason


def test_the_recorded_10_minute_dsv4_soak_on_a_quiet_machine_passes_and_a_leak_of_twice_its_limit_fails():
    """Recorded: ``soak --model dsv4 --minutes 10`` (a control as long by default) on a quiet
    machine, 467 / 557 requests. Both floors climb by about 700 MiB over the run (stock's too); paired
    at the same requests the profile's is flat, and 187 requests across the second half resolve
    about 110 MiB per 1,000 requests: a pass with no leak above 1 MiB a request. The unpaired rule
    this replaced (each boot's second-half rate, stock's subtracted) read the same run as growing
    over 300 MiB per 1,000 requests on each boot and could not pass it. 2 MiB a request planted on
    the profile fails; 256 KiB, under the limit, is not called a leak."""
    import json
    from pathlib import Path

    def rows(leg: str) -> list:
        return json.loads((Path(__file__).parent / "soak_rss" / f"dsv4_10min_paired_{leg}.json").read_text())[
            "t_s_served_kib"]

    profile, stock = rows("profile"), rows("stock")
    judged = memory.judge(profile, stock, memory.limit_for("dsv4"))
    assert (judged.verdict, judged.rule) == ("pass", "paired"), judged.reason
    assert judged.resolution < 2 * memory.LEAK_MIB_PER_1000 and abs(judged.mib_per_1000_requests) < judged.resolution
    assert memory.plateau(memory.samples_of(profile)).mib_per_1000_requests > 3 * memory.LEAK_MIB_PER_1000
    leaked = memory.judge(_planted(profile, 2048), stock, memory.limit_for("dsv4"))
    assert (leaked.verdict, leaked.rule) == ("leak", "paired"), leaked.reason
    assert leaked.mib_per_1000_requests - judged.mib_per_1000_requests == pytest.approx(2000, rel=0.1)
    assert memory.judge(_planted(profile, 256), stock, memory.limit_for("dsv4")).verdict == "pass"


def test_a_recorded_dsv4_soak_with_a_planted_leak_fails_and_passes_with_it_taken_back_out():
    """Recorded: ``soak --model dsv4 --minutes 4 --stock-minutes 4 --plant-leak-kib 8192`` (219 /
    243 requests, FAIL). Paired, the profile's floor reads about the planted 8,000 MiB per 1,000
    requests above stock's, eight times the DSV4 limit, well past the run's resolution; the same
    series less 8192 KiB per served request passes."""
    import json
    from pathlib import Path

    def rows(leg: str) -> list:
        path = Path(__file__).parent / "soak_rss" / f"dsv4_4min_planted_8192kib_{leg}.json"
        return json.loads(path.read_text())["t_s_served_kib"]

    profile, stock = rows("profile"), rows("stock")
    judged = memory.judge(profile, stock, memory.limit_for("dsv4"))
    assert (judged.verdict, judged.rule) == ("leak", "paired"), judged.reason
    assert judged.mib_per_1000_requests == pytest.approx(8192 * 1000 / 1024, rel=0.1)
    assert judged.mib_per_1000_requests > 5 * max(judged.limit, judged.resolution)
    taken_out = [(t, served, kib - 8192 * served) for t, served, kib in profile]
    assert memory.judge(taken_out, stock, memory.limit_for("dsv4")).verdict == "pass"
