"""The DSV4 gate leg's pool geometry and cache phases on a real SGLang scheduler with a real
``DeepSeekV4TokenToKVPool`` (``devkit.testkit.scheduler``, ``dsv4=True``; the forward is simulated):
the exact requests of :func:`devkit.engine_kit.workload.run_cache_phases` for the DSV4 kit's quick
workload, on the kit's Full / SWA pool sizes, running rows and chunk (``devkit.engine_kit.model_kits``).

The testkit's DSV4 pool has four layers (C0/C4/C128/C4), so its cone bound is 1024 where the kit
model's three layers give 768: the cone test replays 1024 tokens (s = F - 1024)."""

from __future__ import annotations

import importlib

import pytest

from adapter.switches import swa_thin
from devkit.engine_kit import model_kits
from devkit.engine_kit import workload as wl

importlib.import_module("sglang.srt.managers.scheduler")
from devkit.testkit.gate_phases import SchedulerApi  # noqa: E402
from devkit.testkit.scheduler import build_scheduler  # noqa: E402

pytestmark = pytest.mark.slow  # three in-process DSV4 pools and schedulers, about a minute on 2 cores

W = model_kits.kit("dsv4").workload(True)


def _phases() -> dict:
    h = build_scheduler(page_size=256, pool_tokens=model_kits.DSV4_MAX_TOTAL_TOKENS,
                        swa_pool_tokens=round(model_kits.DSV4_MAX_TOTAL_TOKENS * model_kits.DSV4_SWA_RATIO),
                        max_reqs=model_kits.DSV4_MAX_RUNNING, chunked_prefill_size=model_kits.DSV4_CHUNK,
                        sliding_window=128, dsv4=True)
    return wl.run_cache_phases("in-process", W, SchedulerApi(h))


def test_stock_loses_the_idle_sessions_resume_point_and_the_branchs_window_and_checkpoint():
    out = _phases()
    assert out["resume_cached_tokens"] == 0
    assert out["cone_cached_tokens"] == 0
    assert out["cone_recomputed_tokens"] == W.cone_branch_at == 7 * 256


def test_swa_thin_keeps_the_resume_point_and_the_cone_resumes_the_branch_below_f(records):
    from overlay_tools.simulate.cone_turn import install

    state = install(1024, DSV41_SWA_THIN="1")
    importlib.import_module(swa_thin.SWITCH.module_of("checkpoint_into_tree"))
    assert state.outcomes["swa_thin"].status == "installed", state.outcomes["swa_thin"].reason
    out = _phases()
    assert out["resume_cached_tokens"] == W.session_tokens
    # Full KV resident at F = 1792 with its window evicted: a cone of 1024 from s = 768 (no
    # checkpoint there: chunks end at 1024 and 2048), where stock re-prefills all 1792.
    assert out["cone_cached_tokens"] == W.cone_branch_at - 1024
    plans = [r.getMessage() for r in records if "DSV41_SWA_CONE plan" in r.getMessage()]
    assert len(plans) == 1 and "F=1792 s=768" in plans[0], plans


def test_room_for_the_churns_chunk_checkpoints_lets_stock_keep_the_idle_session(monkeypatch):
    monkeypatch.setattr(model_kits, "DSV4_SWA_RATIO", 16 * 256 / model_kits.DSV4_MAX_TOTAL_TOKENS)
    assert _phases()["resume_cached_tokens"] == W.session_tokens
