"""Cone replay is exact: a replay of ``[s, L)`` with the copied Full KV gives, for every
row >= F, the same fp32 bits as a prefix hit at F; and it does not when the replay depth is below
the receptive field of the SWA layers.

The model is ``devkit.testkit.tiny_hybrid.TinyHybrid`` on a real ``SWAKVPool``; the copy is the
switch's own ``copy_full_pages`` on that pool's buffers. Two modes (``MODES``):

* ``pool``: the model reads every K/V from the pool, with the cone's Full-side write mask and
  window floor (``forward_rows``) as arguments.
* ``production``: the switch is installed and each layer goes through the real, wrapped
  ``RadixAttention.forward`` to an extend backend that, like SGLang's extend kernels, reads the
  extend rows' K/V from the forward's own tensors; the replay rows are published as
  ``ModelRunner.forward`` does, so the switch's ``substitute_full_kv`` is what makes the replay
  exact (no mask, no floor: a replay row below s + W reads the evicted SWA slots).
"""

from __future__ import annotations

import pytest
import torch

from devkit.testkit import cone_replay_parts as cone_replay
from devkit.testkit.cone import published_replay_rows
from devkit.testkit.cone_replay_parts import align_up, cone_bound, cone_start, copy_full_pages
from devkit.testkit.tiny_hybrid import TinyHybrid
from overlay_tools.simulate.cone_turn import forward_rows, install

NAN = float("nan")
MODES = ["pool", "production"]


@pytest.fixture(params=MODES)
def mode(request):
    """``production`` installs the switch (its ``RadixAttention.forward`` wrapper); the autouse
    fixture in tests/conftest.py uninstalls it after the test."""
    if request.param == "production":
        assert install(64).outcomes["cone_replay"].status == "armed"
        assert hasattr(__import__("sglang.srt.layers.radix_attention", fromlist=["RadixAttention"])
                       .RadixAttention.forward, "__wrapped__")
    return request.param


def _setup(kinds: str, window: int, page: int, F: int, extra: int, seed: int = 0, mode: str = "pool"):
    """Turn 1 prefills [0, F) cold (in ``mode``); turn 2 = the same F tokens + ``extra`` new ones."""
    model = TinyHybrid(kinds, window=window, d=16, seed=seed)
    size = 64 * page
    kv = model.make_pool(size=size, size_swa=size, page=page)
    kv.register_mapping(torch.arange(size + page + 1, dtype=torch.int64))  # SWA slot = Full slot
    for layer in range(len(kinds)):  # nothing unwritten may ever be read
        kv.get_key_buffer(layer)[page:] = NAN
        kv.get_value_buffer(layer)[page:] = NAN
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, model.vocab, (F + extra,), generator=gen).tolist()
    first = torch.arange(page, page + F)  # turn 1's pages (page 0 is the padding page)
    if mode == "production":
        model.forward_extend(kv, first, tokens, 0, F)
    else:
        model.forward(kv, first, tokens, 0, F)
    return model, kv, tokens, first


def _fresh(after: int, n: int) -> torch.Tensor:
    return torch.arange(after, after + n)


def _prefix_hit(model, kv, tokens, first, F, mode="pool"):
    """The reference: turn 2 resumes at F with turn 1's Full and SWA KV."""
    L = len(tokens)
    slots = torch.cat([first, _fresh(int(first[-1]) + 1, L - F)])
    if mode == "production":
        return model.forward_extend(kv, slots, tokens, F, L)
    return model.forward(kv, slots, tokens, F, L)


def _evict_swa(model, kv, first, upto, value=NAN):
    """The resume point's window is gone: turn 1's SWA KV of [0, upto) becomes NaN (``value``)."""
    for layer in model.swa_layer_ids:
        kv.get_key_buffer(layer)[first[:upto]] = value
        kv.get_value_buffer(layer)[first[:upto]] = value


def _cone(model, kv, tokens, first, F, s, base, *, mask=True, floor=True, copy=True, whole=False,
          mode="pool", publish=True):
    """Turn 2 through the cone: Full prefix [0, s), fresh pages for [s, L), Full KV of [s, F)
    copied from turn 1's pages; returns the rows >= F (``whole``: every row from s).
    ``mode="production"``: the forward publishes its replay rows (``publish``; rows ``[s, F)``
    are the extend's first ``F - s`` rows, reading F's tree slots ``first[s:F]``) and runs through
    the installed ``RadixAttention.forward``; ``mask`` and ``floor`` do not apply."""
    L = len(tokens)
    slots = torch.cat([first[:s], _fresh(base, L - s)])
    if copy:
        pages, nbytes = copy_full_pages(kv, first[s:F], slots[s:F])
        assert pages == (F - s) // kv.page_size and (nbytes > 0) == bool(model.full_layer_ids)
    if mode == "production":
        cone = (torch.arange(F - s), first[s:F].to(torch.int64), kv) if publish else None
        with published_replay_rows(cone):
            out = model.forward_extend(kv, slots, tokens, s, L)
        return out if whole else out[F - s :]
    rows = forward_rows(s, F)
    out = model.forward(kv, slots, tokens, s, L, floor=rows["floor"] if floor else 0,
                        mask=rows["mask"] if mask else None)
    return out if whole else out[F - s :]


# (kinds, W, page, F): W below, equal to and above the page; Full layers first, last, between, none.
CASES = [
    ("SFSF", 8, 16, 96),
    ("SSFS", 16, 8, 96),
    ("FSSSFS", 6, 4, 64),
    ("SSSF", 8, 16, 96),
    ("SSSSSS", 4, 8, 64),
]


@pytest.mark.parametrize("kinds,W,page,F", CASES)
def test_replay_at_the_bound_is_bit_identical_to_a_prefix_hit_for_every_row_from_F(kinds, W, page, F, mode):
    layers = kinds.count("S")
    N = cone_bound(W, page, layers)
    s = cone_start(F, N, page)
    assert 0 < s < F and F - s == N
    model, kv, tokens, first = _setup(kinds, W, page, F, extra=2 * page + 3, mode=mode)
    hit = _prefix_hit(model, kv, tokens, first, F, mode)
    _evict_swa(model, kv, first, F)
    cone = _cone(model, kv, tokens, first, F, s, base=40 * page, mode=mode)
    assert not torch.isnan(hit).any()
    assert torch.equal(cone, hit), (cone - hit).abs().max()
    if mode == "production" and model.full_layer_ids:
        assert cone_replay.COUNTERS.substituted_layers > 0


@pytest.mark.parametrize("kinds,W,page,F", CASES[:3])
def test_replay_deeper_than_the_bound_is_still_bit_identical(kinds, W, page, F, mode):
    N = cone_bound(W, page, kinds.count("S")) + 2 * page
    s = cone_start(F, N, page)
    model, kv, tokens, first = _setup(kinds, W, page, F, extra=page, mode=mode)
    hit = _prefix_hit(model, kv, tokens, first, F, mode)
    _evict_swa(model, kv, first, F)
    assert torch.equal(_cone(model, kv, tokens, first, F, s, base=40 * page, mode=mode), hit)


@pytest.mark.parametrize("kinds,W,page,F", [c for c in CASES if "F" in c[0]])
def test_production_replay_rows_keeping_their_own_full_kv_make_rows_from_f_differ(kinds, W, page, F):
    """The production path without the substitution (no replay rows published): the extend
    kernels read the replay rows' own, recomputed Full-side K/V, so rows >= F are not exact.
    What ``substitute_full_kv`` is for."""
    assert install(64).outcomes["cone_replay"].status == "armed"
    N = cone_bound(W, page, kinds.count("S"))
    s = cone_start(F, N, page)
    model, kv, tokens, first = _setup(kinds, W, page, F, extra=page, mode="production")
    hit = _prefix_hit(model, kv, tokens, first, F, "production")
    _evict_swa(model, kv, first, F, value=0.0)
    cone = _cone(model, kv, tokens, first, F, s, base=40 * page, mode="production", publish=False)
    assert torch.isfinite(cone).all() and not torch.equal(cone, hit)


@pytest.mark.parametrize("kinds,W,page,F", [c for c in CASES if c[0].count("S") * (c[1] - 1) > c[2]])
def test_replay_shallower_than_the_receptive_field_differs_from_a_prefix_hit(kinds, W, page, F, mode):
    """With s so close to F that the SWA layers' receptive field (L_swa * (W - 1) rows) reaches
    below s, rows >= F see replayed (inexact) window KV: the outputs must differ. (Production has
    no floor: its evicted window reads the zeroed padding slot.)"""
    layers = kinds.count("S")
    N = (layers * (W - 1) - 1) // page * page  # a whole number of pages below the receptive field
    assert page <= N < cone_bound(W, page, layers)
    s = cone_start(F, N, page)
    model, kv, tokens, first = _setup(kinds, W, page, F, extra=2 * page, mode=mode)
    hit = _prefix_hit(model, kv, tokens, first, F, mode)
    _evict_swa(model, kv, first, F, value=NAN if mode == "pool" else 0.0)
    cone = _cone(model, kv, tokens, first, F, s, base=40 * page, mode=mode)
    assert not torch.isnan(cone).any()  # the floor (pool) / the padding slot (production) kept NaN out
    assert not torch.equal(cone, hit)


def test_the_pool_model_replay_is_exact_only_with_its_mask_floor_and_copy():
    """The pool model only: production never masks or floors (its counterpart is
    ``test_production_replay_rows_keeping_their_own_full_kv_make_rows_from_f_differ``)."""
    kinds, W, page, F = "SFSF", 8, 16, 96
    N = cone_bound(W, page, 2)
    s = cone_start(F, N, page)
    model, kv, tokens, first = _setup(kinds, W, page, F, extra=page)
    hit = _prefix_hit(model, kv, tokens, first, F)
    _evict_swa(model, kv, first, F)
    # Without the mask the replay rows overwrite the copied Full KV with their own (inexact) KV.
    assert not torch.equal(_cone(model, kv, tokens, first, F, s, base=40 * page, mask=False), hit)
    # Without the floor the first replay rows read the evicted window (NaN here). At N >= bound
    # that stays inside the cone (rows >= F are unaffected), but the replay rows would compute on
    # freed slots that other requests may own by then.
    unfloored = _cone(model, kv, tokens, first, F, s, base=48 * page, floor=False, whole=True)
    assert torch.isnan(unfloored[: F - s]).any() and torch.equal(unfloored[F - s :], hit)
    # Without the copy the masked rows leave the fresh pages unwritten (NaN here).
    assert torch.isnan(_cone(model, kv, tokens, first, F, s, base=56 * page, copy=False)).any()
    # All three: exact.
    assert torch.equal(_cone(model, kv, tokens, first, F, s, base=32 * page), hit)


@pytest.mark.parametrize("kinds,W,page,F", CASES)
def test_replay_rows_reading_the_zeroed_padding_slot_leave_every_row_from_f_exact(kinds, W, page, F):
    """What ``SWAKVPool`` engines do (no backend has a per-row window floor), on the pool model
    (compared with its floored replay): a freed SWA slot's mapping points at the padding slot, so
    the first replay rows read zeros below s. That changes rows inside the cone only; at N >= bound
    every row from F on is bit-identical. (The production mode never floors: its bound tests run
    with the evicted window NaN, so any read of it reaching a row >= F would show.)"""
    N = cone_bound(W, page, kinds.count("S"))
    s = cone_start(F, N, page)
    model, kv, tokens, first = _setup(kinds, W, page, F, extra=2 * page + 3)
    hit = _prefix_hit(model, kv, tokens, first, F)
    _evict_swa(model, kv, first, F, value=0.0)
    whole = _cone(model, kv, tokens, first, F, s, base=40 * page, floor=False, whole=True)
    assert torch.isfinite(whole).all()
    assert torch.equal(whole[F - s :], hit)
    floored = _cone(model, kv, tokens, first, F, s, base=48 * page, whole=True)
    assert not torch.equal(whole[:W], floored[:W])  # the padding reads did change the first replay rows


@pytest.mark.parametrize("kinds,W,page,F", CASES)
def test_the_swa_kv_the_checkpoint_republishes_is_bit_identical_at_the_bound(kinds, W, page, F, mode):
    """The first checkpoint re-publishes the replay's SWA KV of the last align_up(W, page) + page
    rows before F; a later request resuming a page below F reads it, so it must be exact."""
    N = cone_bound(W, page, kinds.count("S"))
    model, kv, tokens, first = _setup(kinds, W, page, F, extra=2 * page + 3, mode=mode)
    published = align_up(W, page) + page
    turn1 = {layer: kv.get_key_buffer(layer)[first[F - published : F]].clone() for layer in model.swa_layer_ids}
    _evict_swa(model, kv, first, F)
    base = 40 * page
    _cone(model, kv, tokens, first, F, cone_start(F, N, page), base=base, mode=mode)
    replay = _fresh(base + F - published - cone_start(F, N, page), published)
    assert all(torch.equal(kv.get_key_buffer(layer)[replay], turn1[layer]) for layer in model.swa_layer_ids)


def test_one_page_less_than_the_bound_leaves_the_republished_extra_page_inexact(mode):
    """The bound less its last page keeps F's window exact but not the extra
    page the checkpoint re-publishes: why the bound has one page more."""
    kinds, W, page, F = "SFSF", 8, 16, 96
    N = cone_bound(W, page, kinds.count("S")) - page
    s = cone_start(F, N, page)
    model, kv, tokens, first = _setup(kinds, W, page, F, extra=2 * page + 3, mode=mode)
    hit = _prefix_hit(model, kv, tokens, first, F, mode)
    top = model.swa_layer_ids[-1]
    turn1 = kv.get_key_buffer(top)[first[F - 2 * page : F]].clone()
    _evict_swa(model, kv, first, F)
    base = 40 * page
    assert torch.equal(_cone(model, kv, tokens, first, F, s, base=base, mode=mode), hit)  # rows >= F: exact
    replay = kv.get_key_buffer(top)[_fresh(base + F - 2 * page - s, 2 * page)]
    assert torch.equal(replay[page:], turn1[page:])  # F's window: exact
    assert not torch.equal(replay[:page], turn1[:page])  # the extra page: not


def test_bound_is_the_issue_formula_plus_one_page():
    assert cone_bound(128, 256, 43) == 256 + 42 * 128 + 256 == 5888
    assert cone_bound(128, 256, 61) == 8192  # 61 layers: exactly N = 8192
    assert cone_bound(8, 16, 1) == 32
    assert cone_bound(6, 4, 4) == 32
    assert cone_start(25600, 8192, 256) == 17408
    assert cone_start(100, 8192, 16) == 0
    with pytest.raises(ValueError):
        cone_bound(0, 16, 2)
