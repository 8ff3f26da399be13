"""SWA thin on branching traffic (real ``UnifiedRadixCache``, SMALL geometry: page 16, window 8,
chunk 128, SWA pool 1024): requests that branch from a shared document after one request has moved
past it must cost no more prefill under thin than under stock (a thin cache beside a stock twin)."""

from __future__ import annotations

from devkit.testkit import radix_cache as rc
from overlay_tools.simulate import cache_kit
from tests.upstream.test_swa_thin import pair

P = cache_kit.SMALL.page
C = cache_kit.SMALL.chunk


def _recomputed(kit: cache_kit.CacheKit, prompt: list[int], out: int = P) -> int:
    return kit.run_turn(prompt, out).reprefilled


def _shared_document_traffic(kit: cache_kit.CacheKit, tok: rc.Tokens, doc_pages: int, followers: int,
                             noise: int, older: int = 4, q_pages: int = 2) -> list[int]:
    """One request reads a document (chunked) with its question; ``noise`` unrelated one-chunk
    requests pass; then ``followers`` requests ask other questions of the same document.
    Returns each follower's recomputed tokens."""
    for _ in range(older):
        kit.run_turn(tok.fresh(C), P)
    doc = tok.fresh(doc_pages * P)
    kit.run_turn(doc + tok.fresh(q_pages * P), P)
    for _ in range(noise):
        kit.run_turn(tok.fresh(C), P)
    return [_recomputed(kit, doc + tok.fresh(q_pages * P)) for _ in range(followers)]


def test_requests_branching_from_a_shared_document_after_its_reader_moved_past_cost_no_more_than_stock(thin):
    stock, kit = pair(cache_kit.SMALL.with_pools(swa_tokens=512))
    args = dict(doc_pages=33, followers=4, noise=2)
    s = _shared_document_traffic(stock, rc.Tokens(), **args)
    t = _shared_document_traffic(kit, rc.Tokens(), **args)
    assert s[1:] == t[1:] == [2 * P] * 3, "later followers resume at the branch point under both"
    assert sum(t) <= sum(s), (s, t)


def test_many_requests_branching_from_a_shared_prompts_end_cost_no_more_than_stock_at_every_pressure(thin):
    for swa in (512, 384, 256):
        for doc_pages in (20, 33):
            for noise in (0, 2, 4, 6):
                stock, kit = pair(cache_kit.SMALL.with_pools(swa_tokens=swa))
                s = _shared_document_traffic(stock, rc.Tokens(), doc_pages, 4, noise)
                t = _shared_document_traffic(kit, rc.Tokens(), doc_pages, 4, noise)
                assert sum(t) <= sum(s), (swa, doc_pages, noise, s, t)


def test_a_reader_whose_question_spans_more_than_a_chunk_still_costs_the_first_follower(thin):
    """The case the rule leaves: the reader passed the document's last checkpoint mid-prefill (its
    question is longer than a chunk), so thin demoted it before anything shared it. Only the first
    follower pays; it inserts the branch point (``swa_branching_seqlen``) and the rest resume there."""
    stock, kit = pair(cache_kit.SMALL.with_pools(swa_tokens=384))
    args = dict(doc_pages=20, followers=4, noise=2, q_pages=10)
    s = _shared_document_traffic(stock, rc.Tokens(), **args)
    t = _shared_document_traffic(kit, rc.Tokens(), **args)
    assert s == [224, 160, 160, 160] and t == [480, 160, 160, 160]
