"""``python -m adapter simulate``: small generated traces whose answers are known by construction,
replayed on the real ``UnifiedRadixCache`` under every policy (the switches installed through the
boot). Page 16, window 8, chunk 128; the SWA pool is small so that other traffic evicts windows,
the Full pool large so that Full KV stays."""

from __future__ import annotations

import json
import math

import pytest

from adapter.core import env
from adapter.ops import cli
from devkit.testkit import simulate_fleet
from devkit.testkit.simulate_fleet import CHUNK, PAGE, N
from overlay_tools import simulate
from overlay_tools.simulate import engine, fleet, trace

POLICIES = ("stock", "thin", "thin+cone")
_fleet, _replay = simulate_fleet.small_fleet, simulate_fleet.replay


def _trace(tmp_path, rows) -> list[trace.Request]:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out,
                                        "hash_ids": ids}) + "\n" for ts, n_in, n_out, ids in rows))
    return trace.load(str(path), PAGE)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_continuation_right_after_its_parent_matches_its_whole_history(tmp_path, policy):
    """A (1,024 tokens, 33 out: its KV covers 1,056 = prompt + output - 1, two pages of output) then
    B = A's prompt + A's output + new tokens: B's match is A's whole history under every policy; the
    leak check is clean."""
    requests = _trace(tmp_path, [(0, 1024, 33, [1, 2]), (1, 1536, 16, [1, 2, 3])])
    turns, row = _replay(policy, requests)
    a, b = turns
    assert b.continuation and b.history == 1056 and b.resume_at == 1056
    assert b.stock_prefix == b.prefix == 1056 and b.recomputed == 1536 - 1056 and not b.cone
    assert row["resume_hit_rate"] == 1.0 and row["whole_reprefills"] == 0
    assert a.recomputed == 1024 and row["recomputed_tokens"] == 1024 + 480


def _idle_then_chunked_traffic():
    # A goes idle; one 4,096-token prompt (32 chunks of 128) runs beside it; A's next turn comes late.
    return [(0, 512, 16, [1]), (5_000, 4096, 16, list(range(100, 108))), (100_000, 1024, 16, [1, 2])]


def test_an_idle_sessions_window_evicted_by_other_traffic_is_lost_under_stock_and_kept_under_thin(tmp_path):
    requests = _trace(tmp_path, _idle_then_chunked_traffic())
    stock, _ = _replay("stock", requests)
    thin, _ = _replay("thin", requests)
    assert stock[2].history == thin[2].history == 512  # a 16-token answer leaves no whole page
    assert stock[2].stock_prefix < stock[2].resume_at == 512  # stock: the resume point is gone
    assert stock[2].history_recomputed >= 512 // 2
    assert thin[2].stock_prefix == thin[2].prefix == 512  # thin: kept, the chunks it moved past went first
    assert thin[2].history_recomputed == 0


def test_a_lost_window_whose_full_kv_stays_costs_n_plus_a_page_under_the_cone(tmp_path):
    """Many short finished requests (their leaves are resume points thin keeps too) evict A's
    window under every policy while the large Full pool keeps A's KV: stock and thin re-prefill A's
    history, the cone recomputes N = 64 tokens of it, at most N + page."""
    rows = [(0, 512, 16, [1])] + [(5_000 + i, 64, 16, [1000 + i]) for i in range(24)] + [(100_000, 1024, 16, [1, 2])]
    requests = _trace(tmp_path, rows)
    results = {p: _replay(p, requests) for p in POLICIES}
    for policy in ("stock", "thin"):
        last = results[policy][0][-1]
        assert last.stock_prefix < last.resume_at == 512 and last.history_recomputed >= 512 // 2, policy
    turns, row = results["thin+cone"]
    last = turns[-1]
    assert last.cone and last.stock_prefix < last.resume_at
    # F is A's resume point or a page below it (the SWA-evicted last leaf takes its Full page along)
    assert N <= last.history_recomputed <= N + PAGE and last.prefix % PAGE == 0
    assert row["cone_plans"] == 1 and row["cone_fallbacks"] == {}


def _full_kv_pushed_off_the_device():
    # A (512 tokens) goes idle; three strangers of 1,024 tokens, one after another, each need half
    # the Full pool (2,048 tokens), so A's Full KV (the least recent) leaves the device; A's next
    # turn adds 512 tokens.
    rows = [(0, 512, 16, [1])] + [(5_000 * (i + 1), 1024, 16, [100 + 2 * i, 101 + 2 * i]) for i in range(3)]
    return [*rows, (100_000, 1024, 16, [1, 2])]


@pytest.mark.parametrize("policy", ["stock+hicache", "thin+cone+hicache"])
def test_a_session_whose_full_kv_left_the_device_reloads_its_history_from_host_under_hicache(tmp_path, policy):
    """HiCache (write-through, host 4x the device pool) kept A's history on host: the admission
    loads its 512 tokens back and only the 512 new tokens are recomputed; stock, without a host
    tier, re-prefills the whole prompt. The leak check is clean under both."""
    requests = _trace(tmp_path, _full_kv_pushed_off_the_device())
    stock, stock_row = _replay("stock", requests, full_tokens=2048)
    turns, row = _replay(policy, requests, full_tokens=2048, hicache_ratio=4.0)
    for last in (stock[-1], turns[-1]):
        assert last.continuation and last.history == last.resume_at == 512 and last.full_lost
    assert stock[-1].prefix == 0 and stock[-1].recomputed == 1024 and stock_row["host_loaded_tokens"] is None
    last = turns[-1]
    assert last.loaded == 512 and last.prefix == 512 and last.recomputed == 1024 - 512 and not last.cone
    assert last.stock_prefix < last.resume_at  # not on device: the host tier gave it back
    assert row["host_loaded_tokens"] == 512 and row["host_load_backs"] == 1 and row["resume_hit_rate"] == 1.0
    assert row["recomputed_tokens"] == stock_row["recomputed_tokens"] - 512


def test_a_prefix_whose_window_is_on_neither_tier_and_full_kv_on_host_is_loaded_by_the_cone_not_recomputed(tmp_path):
    """A (512 tokens) and B (A's first block + 512 more) make A's prompt an inner node; 24 short
    requests evict its window, two 1,024-token strangers push its Full KV to a write-back host tier
    of 1x the device (HiCache backs up no window of an inner node). C (A's block + a new one): stock
    + HiCache has no window to stop at and recomputes all 1,024 tokens; the cone loads A's 512 Full
    tokens back from host through HiCache's own load-back and recomputes N = 64 of them, no fallback."""
    rows = [(0, 512, 16, [1]), (1_000, 1024, 16, [1, 2])] + [(5_000 + i, 64, 16, [1000 + i]) for i in range(24)]
    rows += [(50_000 * (i + 1), 1024, 16, [100 + 2 * i, 101 + 2 * i]) for i in range(2)] + [(400_000, 1024, 16, [1, 3])]
    requests = _trace(tmp_path, rows)
    args = dict(full_tokens=2048, hicache_ratio=1.0, write_policy="write_back")
    stock, stock_row = _replay("stock+hicache", requests, **args)
    turns, row = _replay("thin+cone+hicache", requests, **args)
    assert stock[-1].prefix == 0 and stock[-1].recomputed == 1024 and stock_row["host_loaded_tokens"] == 0
    last = turns[-1]
    assert last.cone and last.prefix == 512 - N and last.recomputed == 1024 - 512 + N
    assert row["cone_plans"] == 1 and row["cone_loads"] == 1 and row["cone_loaded_tokens"] == 512
    assert row["cone_fallbacks"] == {}  # not full_on_host: the admission loads [D, F) instead
    assert row["recomputed_tokens"] == stock_row["recomputed_tokens"] - 512 + N


def test_the_hicache_policies_run_by_default_only_when_the_launch_line_enables_hicache():
    on = fleet.resolve(str(fleet.REPO / ".env.h200-hicache.example"))
    assert on.hicache_on and on.hicache_ratio == 2.0 and on.hicache_write_policy == "write_through"
    assert on.default_policies() == fleet.POLICIES
    off = fleet.resolve(str(fleet.REPO / ".env.tp4.example"), hicache_ratio=3)
    assert not off.hicache_on and off.hicache_ratio == 3.0
    assert off.default_policies() == ("stock", "thin", "thin+cone", "session", "thin+session")
    with pytest.raises(env.ConfigError, match="--hicache-ratio"):
        fleet.resolve(str(fleet.REPO / ".env.tp4.example"), hicache_ratio=0)


def test_a_launch_line_with_a_swa_full_tokens_ratio_is_refused_naming_the_flag(tmp_path):
    profile = (fleet.REPO / ".env.tp4.example").read_text().replace(" --page-size 256", " --page-size 256 "
                                                                       "--swa-full-tokens-ratio 0.1")
    (tmp_path / "ratio.env").write_text(profile)
    with pytest.raises(env.ConfigError, match="--swa-full-tokens-ratio"):
        fleet.resolve(str(tmp_path / "ratio.env"))


def test_the_cli_names_the_line_field_and_value_of_a_malformed_trace(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 512, "output_length": 4, "hash_ids": [1]}\n'
                    '{"timestamp": 5, "input_length": -3, "output_length": 4, "hash_ids": []}\n')
    assert cli.main(["simulate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: input_length=-3: expected an integer >= 1" in err


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ModuleNotFoundError
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 512, "output_length": 4, "hash_ids": [1]}\n')
    assert cli.main(["simulate", str(path), "--plot", str(tmp_path / "x.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_the_cli_replays_a_trace_at_the_profiles_geometry_and_ends_with_one_json_line(tmp_path, capsys):
    """The production profile's geometry (page 256, window 128, chunk 8192, the SWA pool of SGLang's
    configurator for --swa-prefix-tails 384): a session of two turns and a stranger; every policy
    (``--hicache``: the host-tier ones too, on a profile without HiCache) matches the continuation's
    whole history, nothing is loaded from host, and nothing leaks."""
    path = tmp_path / "t.jsonl"
    rows = [(0, 20000, 300, list(range(40))), (50, 3000, 10, list(range(100, 106))),
            (9000, 26000, 20, list(range(39)) + list(range(200, 212)))]
    path.write_text("".join(json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out,
                                        "hash_ids": ids}) + "\n" for ts, n_in, n_out, ids in rows))
    assert cli.main(["simulate", str(path), "--json", "--hicache"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert "sessions (heuristic): 1 requests linked to a parent, 2 roots; candidate parents refused: 0 branch point, " \
           "0 shorter than its history, 0 shared prefix" in out
    assert result["sessions"] == {"linked": 1, "roots": 2, "rule": "heuristic", "refused": dict.fromkeys(
        trace.REFUSALS, 0)}
    assert "left out (the replay's simplifications):" in out
    said = " ".join(result["left_out"])
    for simplification in ("prompts rounded up", "cost model", "FCFS", "retraction", "DeepSeekV4TokenToKVPool",
                           "load-back time", "no router"):
        assert simplification in said and f"  - {next(i for i in result['left_out'] if simplification in i)}" in out
    assert result["geometry"]["page"] == 256 and result["geometry"]["tails"] == 384
    assert result["geometry"]["swa_pool"] > 384 * (128 + 256)  # the request cap plus the tails' headroom
    assert result["cost_model"]["source"] == "default"
    history = (20224 + 300 - 1) // 256 * 256  # the prompt page-rounded (20,224), then whole pages of its KV
    assert tuple(result["policies"]) == fleet.POLICIES
    for policy, row in result["policies"].items():
        assert row["leak"] == 0 and row["continuation_turns"] == 1 and row["resume_hit_rate"] == 1.0, policy
        assert row["recomputed_tokens_continuation"] == 26112 - history, policy
        assert row["host_loaded_tokens"] == (0 if policy.endswith("+hicache") else None), policy


def test_the_sweep_picks_the_smallest_setting_within_one_percent_of_the_best(tmp_path, capsys):
    """The lost-window workload swept: both N values act (16 is below the bound, skipped) and the
    smaller recomputes N tokens fewer, so it is the pick; every pick is the smallest setting whose
    recomputed tokens are within 1 % of that policy's best."""
    from types import SimpleNamespace

    rows = [(0, 512, 16, [1])] + [(5_000 + i, 64, 16, [1000 + i]) for i in range(24)] + [(100_000, 1024, 16, [1, 2])]
    requests = _trace(tmp_path, rows)
    args = SimpleNamespace(time_scale=1.0, sweep_tails=(1, 64), sweep_n=(16, 32, 64))
    out = simulate.sweep(args, _fleet(), requests, None)
    runs = out["runs"]
    assert set(runs) == {"stock swa_prefix_tails", "thin swa_prefix_tails", "thin+cone cone_tokens"}
    assert set(runs["thin+cone cone_tokens"]) == {"32", "64"}  # 16 is below the bound (32): skipped
    cone = runs["thin+cone cone_tokens"]
    assert cone["32"]["cone_plans"] == cone["64"]["cone_plans"] == 1
    assert cone["32"]["recomputed_tokens"] == cone["64"]["recomputed_tokens"] - 32
    for knob, values in runs.items():
        best = min(r["recomputed_tokens"] for r in values.values())
        assert out["smallest_within_1pct"][knob] == min(int(v) for v, r in values.items()
                                                        if r["recomputed_tokens"] <= best * 1.01), knob
    assert out["smallest_within_1pct"]["thin+cone cone_tokens"] == 32
    assert "smallest within 1 % of the best" in capsys.readouterr().out


def test_an_instance_that_cannot_keep_up_is_called_overloaded_with_the_share_that_keeps_up(tmp_path):
    """Sixteen strangers of 2,048 tokens 1 ms apart: the modelled instance prefills far longer than
    the 15 ms the arrivals span, TTFT grows from the first quarter to the last, the table shows
    "overloaded" instead of TTFT figures, and the output names --share 1/k, k = prefill / span rounded
    up. The same requests 100 s apart are served: not overloaded, TTFT printed."""
    from overlay_tools.simulate import report

    burst = _trace(tmp_path, [(i, 2048, 8, [100 + 4 * i + j for j in range(4)]) for i in range(16)])
    _, row = _replay("stock", burst, swa_pool=768 * 16)
    assert row["overloaded"] and row["prefill_busy_s_modelled"] > row["span_s"] == 0.0  # 15 ms: rounds to 0.0 s
    assert row["ttft_s_modelled_last_quarter"] > row["ttft_s_modelled_first_quarter"]
    assert row["keeps_up_share"] == pytest.approx(0.015 / row["prefill_busy_s_modelled"], rel=0.05)
    (line,) = report.overload_lines({"stock": row})
    assert line.startswith("OVERLOADED (stock)") and f"--share 1/{math.ceil(1 / row['keeps_up_share'])} " in line
    assert "overloaded" in report.table({"stock": row}, {"recomputed_tokens": 0, "recomputed_tokens_continuation": 0})
    spread = _trace(tmp_path, [(100_000 * i, 2048, 8, [100 + 4 * i + j for j in range(4)]) for i in range(16)])
    _, calm = _replay("stock", spread, swa_pool=768 * 16)
    assert not calm["overloaded"] and calm["keeps_up_share"] is None and report.overload_lines({"stock": calm}) == []


def test_decode_that_outgrows_the_pool_retracts_the_request_with_fewest_outputs_as_the_engine_does(tmp_path):
    """Full pool 1,024 tokens (64 pages of 16). A (128-token prompt, 450 out) decodes alone; B (128,
    400 out) arrives later and is admitted: PrefillAdder reserves only new_token_ratio (0.7, decaying)
    of A's remaining tokens. Their pages together outgrow the pool: at the first decode step that
    needs a page the pool cannot give (after eviction), the replay retracts B, the request with fewer
    output tokens (``retract_decode``'s order), never A; B is prefilled again once A's pages are back
    and finishes; the retraction and its re-prefill are columns; nothing leaks. With a pool twice
    as large nothing is retracted."""
    from adapter import cost_model

    requests = _trace(tmp_path, [(0, 128, 450, [1]), (200, 128, 400, [2])])
    geo = _fleet(swa_pool=4096, full_tokens=1024)
    kit = fleet.build_kit("stock", geo, max_ctx=1024)
    try:
        replay = engine.Replay(kit, requests, chunk=CHUNK, max_running=8, coef=cost_model.DEFAULTS)
        a, b = replay.run()
        assert kit.leak_check() == {"full": 0, "swa": 0}
    finally:
        fleet.uninstall()
    (event,) = replay.events
    assert event["retracted"] == 1 and set(event["running"]) == {0}  # B goes, A stays
    assert event["free"] < event["need"]  # the pool had no page for the step, even after eviction
    # when: A's KV (prompt + output - 1) fills its last page, and A's and B's rows hold every page
    kv_a, kv_b = 127 + event["running"][0], 127 + event["decoded"]
    assert kv_a % PAGE == 0 and event["need"] == PAGE and event["free"] == 0
    assert (-(-kv_a // PAGE) + -(-kv_b // PAGE)) * PAGE == 1024
    assert (a.retractions, b.retractions) == (0, 1) and b.retracted_tokens > 0 and not b.skipped
    _, row = _replay("stock", requests, swa_pool=4096, full_tokens=1024)
    assert row["retractions"] == 1 and row["retracted_tokens"] == b.retracted_tokens
    (_, roomy_b), roomy = _replay("stock", requests, swa_pool=4096, full_tokens=2048)
    assert roomy["retractions"] == 0 and roomy["retracted_tokens"] == 0
    # With DSV41_KV_PARK in the profile the same retraction parks B: its re-admission restores the
    # 368 tokens (prompt + whole pages of output, less the prompt the tree still matched) and
    # prefills none of them.
    (_, parked_b), parked = _replay("stock", requests, swa_pool=4096, full_tokens=1024, kv_park=True)
    assert parked["retractions"] == 1 and parked["retracted_tokens"] == 0
    assert parked["parked_tokens"] == b.retracted_tokens and parked_b.prefill_fs == roomy_b.prefill_fs < b.prefill_fs


def test_a_request_whose_decode_the_pool_cannot_hold_beside_the_running_batch_waits_for_it(tmp_path):
    """The same pool and A; C (128, 600 out) needs 745 tokens, more than the pool has left once A's
    remaining decode is reserved at new_token_ratio (about 880 - 0.7 x 445), though less than the
    pool's free tokens: the adder refuses it while A runs, so C's first token comes after A's last
    decode step, and nothing is retracted."""
    requests = _trace(tmp_path, [(0, 128, 450, [1]), (200, 128, 600, [2])])
    turns, row = _replay("stock", requests, swa_pool=4096, full_tokens=1024)
    a, c = turns
    a_decode_fs = 449 * 40 * engine.FS_PER_MS  # A's 449 decode steps cost at least the default 40 ms step each
    assert c.first_token_fs >= a.first_token_fs + a_decode_fs and row["retractions"] == 0


def test_the_cli_says_which_share_emptied_and_how_many_sessions_the_session_key_made(tmp_path, capsys):
    """--session-key conv makes three sessions of five requests (the heuristic would make five
    roots); --share 1/16 keeps none of them (seed 0): exit 2 and an error naming the share, the
    seed and the session count, before any replay."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 600, "output_length": 4,
                                        "hash_ids": [i, 100 + i], "conv": i % 3}) + "\n" for i in range(5)))
    assert cli.main(["simulate", str(path), "--session-key", "conv", "--share", "1/16"]) == 2
    err = capsys.readouterr().err
    assert "error: --share=0.0625 (seed 0) keeps none of the trace's 3 sessions" in err


def test_a_decode_longer_than_the_swa_pool_runs_because_out_of_window_swa_is_released(tmp_path):
    """One request decodes 600 tokens beside an SWA pool of 256 slots (16 pages; the Full pool is
    large): as the engine's maybe_evict_swa does, the replay releases the SWA slots that fall out of
    the window as decode moves on, so the request finishes with no retraction and nothing leaks."""
    requests = _trace(tmp_path, [(0, 128, 600, [1])])
    (turn,), row = _replay("stock", requests, swa_pool=256)
    assert not turn.skipped and row["retractions"] == 0 and row["leak"] == 0


def test_a_profile_with_kv_park_makes_the_replay_park_retracted_requests(tmp_path):
    profile = tmp_path / "park.env"
    profile.write_text((fleet.REPO / ".env.tp4.example").read_text() + "\nDSV41_KV_PARK=ram\n")
    assert fleet.resolve(str(profile)).kv_park and "retraction: parked (DSV41_KV_PARK)" in fleet.resolve(
        str(profile)).describe()
    stock = fleet.resolve(str(fleet.REPO / ".env.tp4.example"))
    assert not stock.kv_park and "retraction: recomputed" in stock.describe()
