"""Why ``--enable-mixed-chunk`` ran no second stream on the DSV4 kit's decode-yield bench: on the
real ``Scheduler`` (CPU harness), a chunk of exactly one page admits no new prompt while any
request decodes. ``PrefillAdder`` takes the mixed decode rows off the chunk budget
(``rem_chunk_tokens -= num_mixed_decode_tokens``) and ``_select_prefill_admission`` floors what is
left to whole pages (``chunk_tokens_limit // page_size * page_size``): one page minus one row is
zero pages. The DSV4 kit's bench runs chunks of 256 = DSV4's page; the fleet's 8,192-token chunk
at page 256 keeps 7,936 beside 64 decoding rows.
"""

from __future__ import annotations

import pytest

from devkit.testkit.scheduler import build_scheduler

PAGE = 64


def _second_admitted_at(chunk: int, mixed_chunk: bool = True) -> list[int]:
    h = build_scheduler(page_size=PAGE, pool_tokens=1 << 16, chunked_prefill_size=chunk, max_reqs=8,
                        mixed_chunk=mixed_chunk)
    first = h.add_request(PAGE, max_new_tokens=200)
    h.run(2)  # its prefill, then it decodes
    second = h.add_request(PAGE // 2, max_new_tokens=4)
    steps = h.run(20)
    assert not first.finished()  # the first request decoded through every pass
    return [s.index for s in steps if s.chunk_of(second.rid)]


def test_under_mixed_chunk_a_one_page_chunk_admits_no_prompt_while_a_request_decodes():
    assert _second_admitted_at(PAGE) == []


@pytest.mark.parametrize("chunk, mixed_chunk", [(PAGE + 1, True), (2 * PAGE, True), (PAGE, False)])
def test_a_chunk_with_a_page_left_beside_the_decode_rows_or_no_mixing_admits_it_at_once(chunk, mixed_chunk):
    assert _second_admitted_at(chunk, mixed_chunk) == [2]
