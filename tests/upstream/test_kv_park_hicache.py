"""``DSV41_KV_PARK=ram`` beside HiCache, on the real SGLang scheduler (CPU) with HiCache attached to
its cache (``devkit.testkit.scheduler.build_scheduler(hicache=...)``: ``init_hicache``, the real host
pools and controller). The switch refuses at the first scheduler pass with one line, takes every
wrapper off (a retraction then runs stock: nothing parked), and fails the boot under strict mode."""

from __future__ import annotations

import importlib
import re

import pytest

from adapter.core import boot
from devkit.testkit.radix_cache import HiCache

importlib.import_module("sglang.srt.managers.scheduler")
from devkit.testkit.scheduler import build_scheduler  # noqa: E402

HICACHE = HiCache(ratio=2.0, write_policy="write_back")


def _build(hicache: HiCache | None = HICACHE):
    return build_scheduler(page_size=16, pool_tokens=1024, max_reqs=8, chunked_prefill_size=256, hybrid_swa=True,
                           swa_pool_tokens=512, sliding_window=32, hicache=hicache)


def _park():
    return importlib.import_module("adapter.switches.kv_park.switch")


def test_beside_hicache_kv_park_refuses_at_the_first_pass_and_a_retraction_parks_nothing(capfd):
    state = boot.install({"DSV41_KV_PARK": "ram", "DSV41_KV_PARK_GIB": "4"})
    assert state.outcomes["kv_park"].status == "installed"
    h = _build()
    assert h.scheduler.tree_cache.cache_controller is not None
    a = h.add_request(100, max_new_tokens=200)
    h.add_request(70, max_new_tokens=200)
    h.run(10)
    h.retract_all()
    h.run(5)
    outcome = state.outcomes["kv_park"]
    assert outcome.status == "refused"
    assert re.fullmatch(
        r"--enable-hierarchical-cache is on: HiCache pinned its own host pool at boot \(\d+\.\d+ [MG]iB\) and keeps a "
        r"retracted request's inserted prefix there; the park store \(DSV41_KV_PARK_GIB=4\) would be a second "
        r"host-RAM budget outside it, parking what HiCache holds \(unset DSV41_KV_PARK, or turn HiCache off\)",
        outcome.reason), outcome.reason
    err = capfd.readouterr().err
    assert len(re.findall(r"\[dsv41\] kv_park refused: ", err)) == 1, err
    # Every wrapper is off and the store is gone: the retraction above ran stock, nothing was parked.
    from sglang.srt.managers import schedule_batch

    assert _park().STATE is None and not hasattr(schedule_batch.release_req, "__wrapped__")
    assert a.kv.holds_kv or a.finished()  # re-admitted stock (a re-prefill) after the retraction


def test_beside_hicache_kv_park_under_strict_fails_the_first_pass():
    boot.install({"DSV41_KV_PARK": "ram", "DSV41_STRICT": "1"})
    h = _build()
    with pytest.raises(boot.BootError, match="kv_park refused under DSV41_STRICT=1: --enable-hierarchical-cache is on"):
        h.step()


def test_without_hicache_kv_park_stays_installed_after_the_first_pass():
    state = boot.install({"DSV41_KV_PARK": "ram"})
    h = _build(hicache=None)
    h.add_request(100, max_new_tokens=4)
    h.run(3)
    assert state.outcomes["kv_park"].status == "installed"
