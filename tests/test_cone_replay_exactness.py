"""Cone replay is exact (issue 5): a replay of ``[s, L)`` with the copied Full KV, masked Full-side
writes and the window floored at s gives, for every row >= F, the same fp32 bits as a prefix hit
at F; and it does not when the replay depth is below the receptive field of the SWA layers.

The model is ``adapter.testkit.tiny_hybrid.TinyHybrid`` on a real ``SWAKVPool``; the copy is the
switch's own ``copy_full_pages`` on that pool's buffers.
"""

from __future__ import annotations

import pytest
import torch

from adapter.cone_replay import cone_bound, cone_start, copy_full_pages, forward_rows
from adapter.testkit.tiny_hybrid import TinyHybrid

NAN = float("nan")


def _setup(kinds: str, window: int, page: int, F: int, extra: int, seed: int = 0):
    """Turn 1 prefills [0, F) cold; turn 2 = the same F tokens + ``extra`` new ones."""
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
    model.forward(kv, first, tokens, 0, F)
    return model, kv, tokens, first


def _fresh(after: int, n: int) -> torch.Tensor:
    return torch.arange(after, after + n)


def _prefix_hit(model, kv, tokens, first, F):
    """The reference: turn 2 resumes at F with turn 1's Full and SWA KV."""
    L = len(tokens)
    slots = torch.cat([first, _fresh(int(first[-1]) + 1, L - F)])
    return model.forward(kv, slots, tokens, F, L)


def _evict_swa(model, kv, first, upto):
    """The resume point's window is gone: turn 1's SWA KV of [0, upto) becomes NaN."""
    for layer in model.swa_layer_ids:
        kv.get_key_buffer(layer)[first[:upto]] = NAN
        kv.get_value_buffer(layer)[first[:upto]] = NAN


def _cone(model, kv, tokens, first, F, s, base, *, mask=True, floor=True, copy=True, whole=False):
    """Turn 2 through the cone: Full prefix [0, s), fresh pages for [s, L), Full KV of [s, F)
    copied from turn 1's pages; returns the rows >= F (``whole``: every row from s)."""
    L = len(tokens)
    slots = torch.cat([first[:s], _fresh(base, L - s)])
    if copy:
        pages, nbytes = copy_full_pages(kv, first[s:F], slots[s:F])
        assert pages == (F - s) // kv.page_size and (nbytes > 0) == bool(model.full_layer_ids)
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
def test_replay_at_the_bound_is_bit_identical_to_a_prefix_hit_for_every_row_from_F(kinds, W, page, F):
    layers = kinds.count("S")
    N = cone_bound(W, page, layers)
    s = cone_start(F, N, page)
    assert 0 < s < F and F - s == N
    model, kv, tokens, first = _setup(kinds, W, page, F, extra=2 * page + 3)
    hit = _prefix_hit(model, kv, tokens, first, F)
    _evict_swa(model, kv, first, F)
    cone = _cone(model, kv, tokens, first, F, s, base=40 * page)
    assert not torch.isnan(hit).any()
    assert torch.equal(cone, hit), (cone - hit).abs().max()


@pytest.mark.parametrize("kinds,W,page,F", CASES[:3])
def test_replay_deeper_than_the_bound_is_still_bit_identical(kinds, W, page, F):
    N = cone_bound(W, page, kinds.count("S")) + 2 * page
    s = cone_start(F, N, page)
    model, kv, tokens, first = _setup(kinds, W, page, F, extra=page)
    hit = _prefix_hit(model, kv, tokens, first, F)
    _evict_swa(model, kv, first, F)
    assert torch.equal(_cone(model, kv, tokens, first, F, s, base=40 * page), hit)


@pytest.mark.parametrize("kinds,W,page,F", [c for c in CASES if c[0].count("S") * (c[1] - 1) > c[2]])
def test_replay_shallower_than_the_receptive_field_differs_from_a_prefix_hit(kinds, W, page, F):
    """With s so close to F that the SWA layers' receptive field (L_swa * (W - 1) rows) reaches
    below s, rows >= F see replayed (inexact) window KV: the outputs must differ."""
    layers = kinds.count("S")
    N = (layers * (W - 1) - 1) // page * page  # a whole number of pages below the receptive field
    assert page <= N < cone_bound(W, page, layers)
    s = cone_start(F, N, page)
    model, kv, tokens, first = _setup(kinds, W, page, F, extra=2 * page)
    hit = _prefix_hit(model, kv, tokens, first, F)
    _evict_swa(model, kv, first, F)
    cone = _cone(model, kv, tokens, first, F, s, base=40 * page)
    assert not torch.isnan(cone).any()  # the floor kept the evicted window out
    assert not torch.equal(cone, hit)


def test_every_piece_is_needed_mask_floor_and_copy():
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


def test_bound_matches_the_issue_formula_and_dsv4_fits_in_the_default():
    assert cone_bound(128, 256, 43) == 256 + 42 * 128 == 5632
    assert cone_bound(128, 256, 61) == 8192 - 256  # 61 layers: still inside N = 8192
    assert cone_bound(8, 16, 1) == 16
    assert cone_bound(6, 4, 4) == 28
    assert cone_start(25600, 8192, 256) == 17408
    assert cone_start(100, 8192, 16) == 0
    with pytest.raises(ValueError):
        cone_bound(0, 16, 2)
