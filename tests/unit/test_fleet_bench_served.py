"""bench fleet's reading of the workers' request logs (written here by SGLang's own RequestLogger in
the JSON format the workers boot with) and the Mooncake trace it writes (read back by simulate's own
trace reader)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from devkit.bench.fleet import fleet_totals, served

pytest.importorskip("sglang.srt.utils.request_logger")

_logger_ids = itertools.count()


def _write_log(folder: Path, requests: list[dict]) -> str:
    """SGLang's request logger (level 3, JSON, a file target) writes one finished line per request;
    returns the file's text."""
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.utils.request_logger import RequestLogger

    target = folder / f"log{next(_logger_ids)}"
    logger = RequestLogger(True, 3, "json", [str(target)])
    for r in requests:
        obj = GenerateReqInput(input_ids=r["ids"], rid=r["rid"], routing_key=r.get("key"))
        meta = {"request_received_ts": r["t"], "prompt_tokens": len(r["ids"]), "cached_tokens": r["cached"],
                "completion_tokens": r["out"], "first_token_latency": 0.05, "e2e_latency": 0.05 + 0.01 * (r["out"] - 1)}
        logger.log_finished_request(obj, {"meta_info": meta})
    for handler in [h for t in logger.targets for h in t.handlers]:
        handler.flush()
    return next(target.glob("*.log")).read_text()


SYSTEM = list(range(100, 700))  # 600 tokens a group shares
TURN1_A = [*SYSTEM, 1, 2, 3]
TURN1_B = [*SYSTEM, 4, 5, 6]
TURN2_A = [*TURN1_A, 9, 9, 7, 7]  # turn 1, its answer, the next message


def _two_workers(tmp_path: Path) -> list[served.Served]:
    w0 = _write_log(tmp_path, [{"rid": "a1", "ids": TURN1_A, "t": 10.0, "cached": 0, "out": 2, "key": "g0"},
                               {"rid": "a2", "ids": TURN2_A, "t": 10.5, "cached": 603, "out": 2, "key": "g0"}])
    w1 = _write_log(tmp_path, [{"rid": "b1", "ids": TURN1_B, "t": 10.2, "cached": 0, "out": 3, "key": "g0"}])
    return served.read_served([w0, w1])


def test_requests_of_all_workers_come_back_in_arrival_order_with_their_worker_and_cache(tmp_path):
    records = _two_workers(tmp_path)
    assert [(s.rid, s.worker, s.cached_tokens, s.routing_key) for s in records] == [
        ("a1", 0, 0, "g0"), ("b1", 1, 0, "g0"), ("a2", 0, 603, "g0")]
    assert records[2].input_ids == TURN2_A
    assert records[1].itl_s == pytest.approx(0.01)


def test_a_later_turn_joins_the_conversation_whose_prompt_it_extends_not_a_sibling_sharing_the_system_prompt(tmp_path):
    records = _two_workers(tmp_path)
    assert [s.session for s in records] == [0, 1, 0]
    assert served.moved_turns(records) == 0
    records[2].worker = 1
    assert served.moved_turns(records) == 1


def test_per_worker_figures_count_prefilled_as_prompt_minus_cached(tmp_path):
    rows = served.per_worker(_two_workers(tmp_path), 2)
    assert [(r["requests"], r["prompt_tokens"], r["cached_tokens"], r["prefilled_tokens"], r["conversations"])
            for r in rows] == [(2, 603 + 607, 603, 607, 1), (1, 603, 0, 603, 1)]


def test_the_trace_is_one_that_simulate_reads_with_shared_blocks_as_equal_ids(tmp_path):
    from overlay_tools.simulate import trace

    path = tmp_path / "fleet.trace.jsonl"
    path.write_text("".join(line + "\n" for line in served.mooncake_lines(_two_workers(tmp_path))))
    parsed = trace.read(path, session_key="session")
    assert [(r.arrival_ms, r.input_length, r.output_length, r.session_id) for r in parsed] == [
        (0, 603, 2, 0), (200, 603, 3, 1), (500, 607, 2, 0)]
    # block 0 (the first 512 tokens: system prompt) is shared by all three; block 1 differs per conversation
    # and turn 2's is a new prefix of its own
    assert [r.hash_ids for r in parsed] == [[0, 1], [0, 2], [0, 3]]
    links = trace.link_sessions(parsed, "session")
    assert links.linked == 1


DEAD_WORKER_LOG = """[2026-12-06 11:25:15] Prefill batch, #new-seq: 1, #new-token: 15, #cached-token: 0, full token usage: 0.33
[2026-12-06 11:25:15] Scheduler hit an exception: Traceback (most recent call last):
  File "/x/sglang/srt/managers/scheduler.py", line 6368, in run_scheduler_process
    scheduler.run_event_loop()
  File "/x/sglang/srt/mem_cache/allocation.py", line 170, in alloc_token_slots
    raise RuntimeError(error_msg)
RuntimeError: Out of memory. Try to lower your batch size.
Try to allocate 64 tokens.
Available full tokens: 5579 (full_available_size=5246 + full_evictable_size_=333)
Available swa: 56 (available_size=56 + component_evictable_size_=0)


[2026-12-06 11:25:15] SIGQUIT received. signum=None, frame=None. It usually means one child failed.
"""


def test_a_worker_whose_scheduler_died_is_named_with_the_exception_and_the_allocator_figures():
    from devkit.bench.fleet import scheduler_death

    death = scheduler_death(DEAD_WORKER_LOG)
    assert death is not None
    assert death.startswith("RuntimeError: Out of memory.")
    assert "Try to allocate 64 tokens." in death and "Available swa: 56" in death
    assert "SIGQUIT" not in death
    assert scheduler_death(DEAD_WORKER_LOG.split("[2026-12-06 11:25:15] Scheduler")[0]) is None


@pytest.mark.parametrize("groups", [2, 3, 4])
def test_the_key_hashing_runs_keys_spread_the_groups_evenly_on_smgs_ring_and_foreign_keys_are_named(groups):
    from devkit.bench.fleet import routing_run, unpinned_keys
    from devkit.engine_kit.serving_client import routing_key
    from overlay_tools.simulate.gateway.router import HashRing

    urls = ["http://127.0.0.1:49107", "http://127.0.0.1:57967"]
    name = routing_run(urls, groups)
    assert name == routing_run(urls, groups)  # every fleet on these ports gets the same keys
    placed = [HashRing(urls).find(routing_key(name, g)) for g in range(groups)]
    assert abs(placed.count(0) - placed.count(1)) <= 1
    sent = [served.Served(f"r{g}", 0, 0.0, [1], routing_key(name, g), 1, 0, 1, None, None) for g in range(groups)]
    assert unpinned_keys(sent, name, groups) == []
    stray = served.Served("x", 0, 0.0, [1], "ab2ee258_20261206143821_0", 1, 0, 1, None, None)
    assert unpinned_keys([*sent, stray], name, groups) == ["ab2ee258_20261206143821_0"]


def _row(fleet: str, policy: str, prefilled: int, error: str | None = None) -> dict:
    return {"fleet": fleet, "policy": policy, "prefilled": prefilled, "error": error}


def test_fleet_totals_sum_the_policies_every_fleet_ran_and_name_those_above_stock():
    rows = [_row("stock", "cache_aware", 3507), _row("stock", "round_robin", 10542), _row("stock", "hashing", 3507),
            _row("profile", "cache_aware", 3546), _row("profile", "round_robin", 6437),
            _row("profile", "hashing", 0, error="worker 0 died")]
    stock, profile = fleet_totals(rows)
    assert stock == {"fleet": "stock", "policies": ["cache_aware", "round_robin"], "prefilled": 14049,
                     "vs_stock": 1.0, "above_stock": []}
    assert profile["prefilled"] == 9983 and profile["vs_stock"] == 0.71
    assert profile["above_stock"] == ["cache_aware"]
