"""bench chat-latency-scripted's traffic (devkit/bench/chat_scripted.py) on the real scheduler: answer
lengths fixed per request, equal by default."""

from __future__ import annotations

from devkit.bench.chat_scripted import DSV4_COSTS, DSV4_SHAPE, Traffic, run_traffic


def test_answer_lengths_are_fixed_per_request_within_their_range_and_equal_by_default():
    varied = Traffic(answers=(4, 32))
    lengths = {rid: varied.answer_len(rid) for rid in (f"c{c}t{t}" for c in range(24) for t in range(3))}
    assert all(4 <= n <= 32 for n in lengths.values()) and len(set(lengths.values())) > 8
    assert all(varied.answer_len(rid) == n for rid, n in lengths.items())  # the same in every run
    assert {Traffic().answer_len(rid) for rid in lengths} == {16}


def test_the_dsv4_shaped_scheduler_serves_each_request_its_own_answer_length():
    traffic = Traffic(groups=1, per_group=4, system=256, question=32, turns=1, rate=8.0, answers=(4, 32))
    result = run_traffic(traffic, DSV4_COSTS, pool=DSV4_SHAPE)
    assert len(result.ttft_ms) == 4
    # each request's ITL samples: its answer less the first token
    assert len(result.itl_ms) == sum(traffic.answer_len(f"c{c}t0") - 1 for c in range(4))
