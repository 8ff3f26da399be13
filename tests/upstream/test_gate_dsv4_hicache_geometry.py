"""The DSV4 kit's HiCache leg, found in-process: the exact requests of the gate's cache phases and host
phase (:mod:`devkit.engine_kit.workload`) for ``Dsv4Kit.workload`` with the datacenter profile's host
tier, on a real SGLang scheduler with a real ``DeepSeekV4TokenToKVPool`` and HiCache attached
(``devkit.testkit.scheduler``, ``dsv4=True``, ``hicache=``; the forward is simulated), at the kit's
Full / SWA pool sizes, running rows and chunk (``devkit.engine_kit.model_kits``).

The churn (:data:`~devkit.engine_kit.model_kits.DSV4_HICACHE_CHURN`) sits in a window one request wide:
one fewer and stock + HiCache keeps the idle session (brought back from host), one more and SWA thin
loses it too. These tests pin both edges, so a change in SGLang, the kit or the switches that moves
the window fails here, in seconds, before a 20-minute gate run does.

The testkit's DSV4 pool has four layers (C0/C4/C128/C4), so its cone bound is 1024 where the kit
model's three layers give 768: the cone replays 1024 tokens here (768 on the server)."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest

from adapter.switches import swa_thin
from devkit.engine_kit import model_kits
from devkit.engine_kit import workload as wl
from devkit.gate import hicache_leg

importlib.import_module("sglang.srt.managers.scheduler")
from devkit.testkit.gate_phases import SchedulerApi  # noqa: E402
from devkit.testkit.scheduler import build_scheduler  # noqa: E402

pytestmark = pytest.mark.slow  # in-process DSV4 pools, schedulers and HiCache, about a minute on 2 cores

ARGS = hicache_leg.launch_args()
RATIO, POLICY = hicache_leg.host_ratio(ARGS), hicache_leg.write_policy(ARGS)
W = model_kits.kit("dsv4").workload(True, RATIO, POLICY)
N = 1024  # the testkit pool's cone bound


def _phases(w: wl.Workload = W, host: bool = False) -> dict:
    from overlay_tools.simulate.cache_kit import HiCache

    h = build_scheduler(page_size=256, pool_tokens=model_kits.DSV4_MAX_TOTAL_TOKENS,
                        swa_pool_tokens=round(model_kits.DSV4_MAX_TOTAL_TOKENS * model_kits.DSV4_SWA_RATIO),
                        max_reqs=model_kits.DSV4_MAX_RUNNING, chunked_prefill_size=model_kits.DSV4_CHUNK,
                        sliding_window=128, dsv4=True, max_context_len=model_kits.DSV4_MAX_TOTAL_TOKENS,
                        hicache=HiCache(ratio=RATIO, write_policy=POLICY))
    api = SchedulerApi(h)
    out = wl.run_cache_phases("in-process", w, api)
    if host:
        out["host"] = wl.run_host_phase("in-process", w, api)
    return out


def _profile(records) -> None:
    from overlay_tools.simulate.cone_turn import install

    state = install(N, DSV41_SWA_THIN="1")
    importlib.import_module(swa_thin.SWITCH.module_of("checkpoint_into_tree"))
    assert state.outcomes["swa_thin"].status == "installed", state.outcomes["swa_thin"].reason


def _cone(records, rid: str, event: str) -> list[str]:
    return [r.getMessage() for r in records if f"DSV41_SWA_CONE {event} rid={rid} " in r.getMessage()]


def test_the_kits_churn_for_the_profiles_host_tier_stays_inside_the_full_pool():
    assert (RATIO, POLICY) == (2.0, "write_through")  # the datacenter profile's, as the table holds
    assert W.churn_requests == model_kits.DSV4_HICACHE_CHURN[(RATIO, POLICY)] == 4
    assert model_kits.cache_phases_held(W) <= model_kits.DSV4_MAX_TOTAL_TOKENS


def test_stock_beside_hicache_loses_the_idle_session_and_the_branch_at_the_kits_churn_not_one_request_earlier():
    out = _phases()
    assert out["resume_cached_tokens"] == 0
    assert out["cone_recomputed_tokens"] == W.cone_branch_at == 7 * 256
    fewer = _phases(replace(W, churn_requests=W.churn_requests - 1))
    assert fewer["resume_cached_tokens"] == W.session_tokens  # HiCache brought the session back from host
    assert fewer["cone_recomputed_tokens"] == 0


def test_swa_thin_keeps_the_idle_session_at_the_kits_churn_not_one_request_later_and_the_cone_resumes_the_branch(
        records):
    _profile(records)
    out = _phases()
    assert out["resume_cached_tokens"] == W.session_tokens
    # the branch's Full KV at F = 1792 is on device with its window gone: a cone of N from s = 768
    assert out["cone_cached_tokens"] == W.cone_branch_at - N
    assert not [r for r in records if "DSV41_SWA_CONE load" in r.getMessage()]  # no Full KV went to host
    assert _phases(replace(W, churn_requests=W.churn_requests + 1))["resume_cached_tokens"] == 0


def test_the_host_phase_sends_the_sessions_full_kv_to_host_and_only_the_cone_loads_it_back(records):
    stock = _phases(host=True)["host"]
    context = W.host_session_tokens + W.turn_tokens
    assert stock["context_tokens"] == context and stock["recomputed_tokens"] == context  # stock + HiCache re-prefills
    _profile(records)
    host = _phases(host=True)["host"]
    plans, loads = _cone(records, host["rid"], "plan"), _cone(records, host["rid"], "load")
    assert len(plans) == 1 and "F=1792 s=768 N=1024 " in plans[0] and " load=1792 " in plans[0], plans
    assert len(loads) == 1 and " tokens=1792 D=0 F=1792 s=768 " in loads[0], loads
    assert host["cached_tokens"] == 1792 - N and host["recomputed_tokens"] == context - 768
    assert not _cone(records, host["rid"], "fallback")


def test_a_one_chunk_host_session_finds_no_full_kv_on_host_so_the_cone_plans_nothing(records):
    """Why the kit's host session is two chunks (``DSV4_HOST_SESSION_TOKENS``)."""
    _profile(records)
    host = _phases(replace(W, host_session_tokens=model_kits.DSV4_CHUNK), host=True)["host"]
    assert host["recomputed_tokens"] == model_kits.DSV4_CHUNK + W.turn_tokens
    assert not _cone(records, host["rid"], "plan") and not _cone(records, host["rid"], "load")


def _boot(label: str, out: dict, profile: dict[str, str], records) -> object:
    from devkit.gate.record import Boot

    boot = Boot(label, profile, None)
    boot.cache, boot.host, boot.log_lines = out, out["host"], [r.getMessage() for r in records]
    records.clear()
    return boot


def test_the_gates_host_row_passes_on_the_cones_load_and_fails_when_the_profile_runs_without_the_cone(records):
    """The gate's verdict (:mod:`devkit.gate.verdict`) on these phases: stock + HiCache as both controls,
    the profile (thin and the cone), and the profile without ``DSV41_SWA_CONE_REPLAY`` (``--drop-key``):
    the host row passes only with the cone's load line, and thin's row passes either way."""
    from adapter.core import boot
    from devkit.gate import verdict

    stock = _boot("A", _phases(host=True), {}, records)
    boot.install({"DSV41_SWA_THIN": "1"})
    importlib.import_module(swa_thin.SWITCH.module_of("checkpoint_into_tree"))
    no_cone = _boot("B", _phases(host=True), {"DSV41_SWA_THIN": "1"}, records)
    boot.uninstall()
    _profile(records)
    records.clear()
    profile = _boot("B", _phases(host=True), {"DSV41_SWA_THIN": "1", "DSV41_SWA_CONE_TOKENS": str(N)}, records)
    context = W.host_session_tokens + W.turn_tokens
    row = verdict._cone_host_row("cone_replay", stock, profile, stock, True)
    assert row["status"] == "pass", row
    assert row["profile"] == f"{context - 768} tokens (load tokens=1792 D=0 F=1792 s=768)"
    assert row["stock"] == f"{context} / {context} tokens"
    dropped = verdict._cone_host_row("cone_replay", stock, no_cone, stock, True)
    assert dropped["status"].startswith("FAIL: no replay planned for the resume"), dropped
    assert "DSV41_SWA_CONE load" not in "\n".join(no_cone.log_lines) and dropped["profile"].endswith("(no load line)")
    for b in (profile, no_cone):
        assert verdict._thin_row("swa_thin", stock, b, stock, True)["status"] == "pass"
