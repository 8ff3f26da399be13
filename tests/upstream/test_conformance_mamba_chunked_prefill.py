"""Conformance (no switch): hybrid-mamba chunked prefill keeps the previous chunk's state snapshot.

Pins SGLang 0.5.23 behaviour on the real scheduler with
a ``UnifiedRadixCache`` holding the FULL and MAMBA components (``extra_buffer``, checkpoint grid
64, page 1, CPU): a non-final chunk tracks ``mamba_last_track_seqlen`` at its grid-aligned end,
the stash donates that snapshot to the tree and resets the field, and a final chunk shorter than
the grid donates nothing new, so after the request finishes the tree still serves the previous
chunk's end. An SGLang bump that drops that snapshot (or stops tracking) fails here.
"""

from __future__ import annotations

import pytest

from devkit.testkit.mamba import build_mamba_scheduler, device_prefix_len

GRID = 64


def _prefill(chunk: int, tail: int):
    h = build_mamba_scheduler(chunk=chunk, grid=GRID)
    req = h.add_request(chunk + tail, max_new_tokens=1)  # the prefill emits the one token
    tracked = []
    while not req.finished():
        step = h.step()
        assert step.kind == "prefill" and len(h.trace) <= 4
        tracked.append(req.kv.mamba_last_track_seqlen)
    return h, req, tracked


@pytest.mark.parametrize(("chunk", "tail", "usable"), [(128, 40, 128), (64, 10, 64), (256, 40, 256), (128, 100, 192)])
def test_a_final_chunk_shorter_than_the_grid_keeps_the_previous_chunk_snapshot(chunk, tail, usable):
    h, req, tracked = _prefill(chunk, tail)
    assert [s.extend_lens for s in h.trace] == [(chunk,), (tail,)]
    # After the first chunk the field is the chunk end; the stash donated it and reset it.
    assert tracked == [chunk, None]
    assert device_prefix_len(h, list(req.origin_input_ids) + list(req.output_ids)) == usable


def test_the_previous_chunk_snapshot_serves_a_later_request_with_the_same_prefix():
    h, req, _ = _prefill(128, 40)
    longer = [*req.origin_input_ids, 11, 12, 13]
    assert device_prefix_len(h, longer) == 128
