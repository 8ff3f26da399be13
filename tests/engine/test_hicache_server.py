"""SGLang 0.5.23's HiCache on the CPU kits' real servers: a prefix loaded back from host and from the
``file`` L3 serves exactly what a device hit serves (slow: one boot per kit).

Each boot runs the phases of :mod:`devkit.testkit.hicache` on one prompt P: ``cold``, ``hit`` (the
device hit, the reference), ``host`` (churn evicted P from device; SGLang loads it back from the host
pool) and ``storage`` (``/flush_cache`` emptied device and host; SGLang prefetches P from the files).
Every phase resumes at the same prefix, so the distributions over the whole vocabulary of the output
tokens computed on the loaded prefix must be bit-identical to the device hit's; on the DSV4 kits
every byte of every page region the extend left in the pool must be too.

L3: ``/flush_cache`` leaves only the files; SGLang's storage query finds the prefix (Mellum: the
window is 31 rows, ``sliding_window`` 32 minus the query's own), prefetches it into the host pools
and loads it back. Each read lands in the host pool's ``get_dummy_flat_data_page``, which the
``sgl_kernel`` stand-in allocates unpinned (upstream pins it, which needs a CUDA driver: before that
route every L3 prefetch failed and was discarded as a miss).
"""

from __future__ import annotations

import pytest

from devkit.engine_kit import model
from devkit.testkit import hicache as hc

pytestmark = pytest.mark.slow
PAGE = 256  # the DSV4 kits' page


def _where(phase):
    d = phase["details"]
    return d.get("device", 0), d.get("host", 0), d.get("storage", 0)


@pytest.fixture(scope="module")
def mellum(tmp_path_factory):
    work = tmp_path_factory.mktemp("hicache_mellum")
    return hc.run_mellum(work, model.make_model(work / "model"))


def test_mellum_boots_with_hicache_and_attaches_a_host_pool_for_full_and_swa(mellum):
    log = "\n".join(mellum["log"])
    assert "hicache_attached=True" in log
    assert "Allocating full hierarchical KV host pool" in log and "Allocating swa hierarchical KV host pool" in log
    assert "Creating storage backend 'file'" in log
    assert mellum["l3_files"] > 0  # write-through reached the folder


def test_mellum_serves_one_prefix_from_device_then_from_host_at_the_same_length(mellum):
    n = mellum["hit"]["cached_tokens"]
    assert n == hc.MELLUM.prompt_tokens - 1  # all of P but its last token
    assert mellum["cold"]["cached_tokens"] == 0
    assert _where(mellum["hit"]) == (n, 0, 0)
    assert _where(mellum["host"]) == (0, n, 0)


def _same_logits(out, tier, tokens=None):
    assert out[tier]["tokens"] == out["hit"]["tokens"]
    assert hc.max_logprob_diff(out["hit"], out[tier], tokens=tokens) == 0.0


def test_mellum_logits_on_a_prefix_loaded_back_from_host_equal_a_device_hit_bit_for_bit(mellum):
    # The first two output tokens: the extend over P's last token and the first decode both read
    # every loaded row (Full layers: all of P; SWA layers: the window).
    _same_logits(mellum, "host", tokens=2)


def test_mellum_prefix_comes_back_from_the_file_l3_with_the_logits_of_a_device_hit(mellum):
    n = mellum["hit"]["cached_tokens"]
    assert _where(mellum["storage"]) == (0, 0, n)
    _same_logits(mellum, "storage", tokens=2)


def _dsv4(tmp_path_factory, name, make, extra=()):
    work = tmp_path_factory.mktemp(name)
    return hc.run_dsv4(work, make(work / "ckpt"), extra=extra)


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory):
    from devkit.engine_kit.dsv4 import checkpoint

    return _dsv4(tmp_path_factory, "hicache_dsv4", checkpoint.make_checkpoint)


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    from devkit.engine_kit.dsv41 import checkpoint, launch

    # the V4.1 kit: ratio-1 KV-source layer, decoder SWA bounded replay on (as the kit boots it)
    return _dsv4(tmp_path_factory, "hicache_v41", checkpoint.make_checkpoint, extra=(launch.REPLAY_FLAG,))


def _check_dsv4_boot_and_host(out):
    log = "\n".join(out["log"])
    assert "hicache_attached=True" in log and "V4 paged pool 'swa'" in log
    assert "Creating storage backend 'file'" in log and out["l3_files"] > 0
    n = out["hit"]["cached_tokens"]
    assert n == (hc.DSV4.prompt_tokens - 1) // PAGE * PAGE
    assert _where(out["hit"]) == (n, 0, 0)
    assert _where(out["host"]) == (0, n, 0)
    _same_regions_and_logits(out, "host")


def _same_regions_and_logits(out, tier):
    n = out["hit"]["cached_tokens"]
    diffs = hc.region_diffs(hc.last_pages(out["hit"]), hc.last_pages(out[tier]), prefix=n)
    assert any(k.startswith("swa.") for k in diffs) and any(k.startswith("full.") for k in diffs), diffs
    assert all(v == 0 for v in diffs.values()), diffs
    assert out["hit"]["dumps"][-1]["logits"].equal(out[tier]["dumps"][-1]["logits"])
    _same_logits(out, tier)


def _check_dsv4_l3(out):
    assert _where(out["storage"]) == (0, 0, out["hit"]["cached_tokens"])
    _same_regions_and_logits(out, "storage")


def test_dsv4_kit_pool_regions_and_logits_after_host_load_back_equal_a_device_hit_byte_for_byte(dsv4):
    _check_dsv4_boot_and_host(dsv4)


def test_dsv4_kit_prefix_comes_back_from_the_file_l3_byte_for_byte(dsv4):
    _check_dsv4_l3(dsv4)


def test_v41_kit_pool_regions_and_logits_after_host_load_back_equal_a_device_hit_byte_for_byte(v41):
    _check_dsv4_boot_and_host(v41)


def test_v41_kit_prefix_comes_back_from_the_file_l3_byte_for_byte(v41):
    _check_dsv4_l3(v41)
