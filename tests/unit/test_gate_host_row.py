"""The HiCache leg's host-phase row (no server): the cone's log lines of the host phase's resume in,
the row's verdict out. It passes only when a ``load`` line says the session's Full KV came back from
host for that resume and the replay stayed at N; the lines are recorded from ``gate --quick --hicache``
(Mellum kit, profile boot)."""

import pytest

from devkit import gate
from devkit.engine_kit.workload import HOST_RESUME_RID
from devkit.gate import verdict

RID = HOST_RESUME_RID
PLAN = f"[dsv41] cone_replay DSV41_SWA_CONE plan rid={RID} F=1024 s=960 N=64 P=0 B=0 load=1024 rank=tp0"
LOAD = f"[dsv41] cone_replay DSV41_SWA_CONE load rid={RID} tokens=1024 D=0 F=1024 s=960 rank=tp0"
COPY = f"[dsv41] cone_replay DSV41_SWA_CONE copy rid={RID} pages=64 bytes=32768 rank=tp0"
OTHER = "[dsv41] cone_replay DSV41_SWA_CONE plan rid=a72e8015 F=480 s=416 N=64 P=64 B=64 rank=tp0"  # the branch


@pytest.mark.parametrize(("lines", "cached", "gaps"), [
    ([OTHER, PLAN, LOAD, COPY], 960, []),
    # the resume planned with its Full KV on device: nothing came back from host
    ([PLAN.replace(" load=1024", ""), COPY], 960, [
        "the plan had no host load: the resume's Full KV was on device",
        "no load line for F=1024 s=960: the Full KV did not come back from host through the cone"]),
    ([PLAN, COPY], 960, ["no load line for F=1024 s=960: the Full KV did not come back from host through the cone"]),
    ([PLAN, LOAD.replace("tokens=1024", "tokens=0")], 960, ["the load line brought 0 tokens back from host"]),
    # a load line of another request, or of another F / s, is not this resume's
    ([PLAN, LOAD.replace(RID, "other")], 960, [
        "no load line for F=1024 s=960: the Full KV did not come back from host through the cone"]),
    ([PLAN, LOAD.replace("s=960", "s=896")], 960, [
        "no load line for F=1024 s=960: the Full KV did not come back from host through the cone"]),
    # the replay did not stay at N: deeper than the profile's, or the server started below s
    ([PLAN.replace("s=960 N=64", "s=896 N=128"), LOAD.replace("s=960", "s=896")], 896, [
        "the plan replays N=128 (F=1024 s=896), not the profile's N=64"]),
    ([PLAN, LOAD], 0, ["the server reported 0 tokens cached, not the plan's s=960"]),
    # no cone at all (--drop-key DSV41_SWA_CONE_REPLAY), or a fallback
    ([OTHER], 0, ["no replay planned for the resume"]),
    ([f"[dsv41] cone_replay DSV41_SWA_CONE fallback rid={RID} reason=load_back_budget F=1024 P=0 B=0 rank=tp0"], 0,
     ["the cone fell back (load_back_budget)", "no replay planned for the resume"]),
], ids=["loaded", "on-device", "no-load", "zero-load", "other-rid", "other-s", "deeper-replay", "cached-below-s",
        "no-cone", "fallback"])
def test_the_host_phase_passes_only_on_a_load_line_of_its_resume_and_a_replay_of_n(lines, cached, gaps):
    assert verdict.host_load_gaps(lines, RID, 64, cached) == gaps


def _boots(stock=1032, profile=72, lines=(PLAN, LOAD), cached=960, context=1032, n=64):
    boots = []
    for label, recomputed in (("A1", stock), ("B", profile), ("A2", stock)):
        boot = gate.Boot(label, {}, None)
        boot.host = {"rid": RID, "recomputed_tokens": recomputed, "cached_tokens": context - recomputed, "outputs": {}}
        boots.append(boot)
    boots[1].profile, boots[1].log_lines, boots[1].host["cached_tokens"] = {"DSV41_SWA_CONE_TOKENS": str(n)}, list(lines), cached
    return boots


def test_the_host_row_passes_with_the_load_line_and_fails_naming_what_is_missing():
    a1, b, a2 = _boots()
    row = verdict._cone_host_row("cone_replay", a1, b, a2, True)
    assert row["status"] == "pass" and row["switch"] == verdict.HOST_ROW
    assert row["profile"] == "72 tokens (load tokens=1024 D=0 F=1024 s=960)" and row["stock"] == "1032 / 1032 tokens"
    # recorded with --drop-key DSV41_SWA_CONE_REPLAY: the profile boot re-prefilled the session as stock did
    a1, b, a2 = _boots(profile=1032, lines=(), cached=0)
    assert verdict._cone_host_row("cone_replay", a1, b, a2, True)["status"] == (
        "FAIL: no replay planned for the resume; 1032 tokens recomputed, not fewer than the controls' 1032")


# Recorded from `gate --quick --hicache --model dsv4` (profile boot): the two-chunk session's Full KV
# came back from host to a page short of its prompt and the cone replayed N = 768 from s = 1024.
DSV4_PLAN = f"[dsv41] cone_replay DSV41_SWA_CONE plan rid={RID} F=1792 s=1024 N=768 P=0 B=0 load=1792 rank=tp0"
DSV4_LOAD = f"[dsv41] cone_replay DSV41_SWA_CONE load rid={RID} tokens=1792 D=0 F=1792 s=1024 rank=tp0"


def test_on_the_dsv4_kit_the_host_row_passes_with_the_load_line_and_fails_without_it_or_without_the_cone():
    dsv4 = dict(stock=2056, profile=1032, cached=1024, context=2056, n=768)
    a1, b, a2 = _boots(**dsv4, lines=(DSV4_PLAN, DSV4_LOAD))
    row = verdict._cone_host_row("cone_replay", a1, b, a2, True)
    assert row["status"] == "pass" and row["profile"] == "1032 tokens (load tokens=1792 D=0 F=1792 s=1024)"
    a1, b, a2 = _boots(**dsv4, lines=(DSV4_PLAN,))
    assert verdict._cone_host_row("cone_replay", a1, b, a2, True)["status"] == (
        "FAIL: no load line for F=1792 s=1024: the Full KV did not come back from host through the cone")
    a1, b, a2 = _boots(**{**dsv4, "profile": 2056, "cached": 0}, lines=())  # --drop-key DSV41_SWA_CONE_REPLAY
    assert verdict._cone_host_row("cone_replay", a1, b, a2, True)["status"] == (
        "FAIL: no replay planned for the resume; 2056 tokens recomputed, not fewer than the controls' 2056")


def test_the_host_row_cannot_act_where_hicache_alone_brought_the_session_back():
    a1, b, a2 = _boots(stock=40)
    assert verdict._cone_host_row("cone_replay", a1, b, a2, True)["status"].startswith(
        gate.CANNOT_ACT + "the controls recomputed 40 of the session's tokens, no more than the replay's N = 64")


def test_the_table_gets_the_host_row_only_with_a_host_phase_and_it_follows_the_cone_row_when_left_out():
    a1, b, a2 = _boots()
    for boot in (a1, b, a2):
        boot.cache = {"resume_cached_frac": 0.0, "cone_recomputed_tokens": 480, "outputs": {}}
        boot.yield_ = {"decode_share": 0.1, "outputs": {}}
    table = {r["switch"]: r["status"] for r in gate.rows(a1, b, a2, [], True)}
    assert table[verdict.HOST_ROW] == "pass"
    left_out = {r["switch"]: r["status"] for r in gate.rows(a1, b, a2, [], True, without=("cone_replay",))}
    assert left_out[verdict.HOST_ROW] == left_out["cone_replay"] == "not in this run: left out with --without"
    b.host = {}
    assert verdict.HOST_ROW not in {r["switch"] for r in gate.rows(a1, b, a2, [], True)}


def test_the_branchs_cone_row_counts_the_branchs_plans_not_the_host_phases():
    """As on the HiCache leg's profile boot: the cone planned the branch and the host phase's resume;
    the branch's row counts 1 plan, and none where only the resume planned."""
    a1, b, a2 = _boots()
    for boot, cone in ((a1, 480), (b, 64), (a2, 480)):
        boot.cache = {"cone_recomputed_tokens": cone, "cone_branch_logprobs": [-0.5]}
    b.log_lines = [OTHER, PLAN, LOAD]
    assert "64 tokens (1 plans," in verdict._cone_row("cone_replay", a1, b, a2, True)["profile"]
    b.log_lines = [PLAN, LOAD]  # the host phase's plan alone: the branch planned nothing
    assert verdict._cone_row("cone_replay", a1, b, a2, True)["status"] == "FAIL: no replay planned"
