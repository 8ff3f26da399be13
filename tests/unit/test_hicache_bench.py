"""``bench hicache``: the arithmetic of its rows and the JSON schema its last line keeps (no boot)."""

from __future__ import annotations

import pytest

from devkit.bench import hicache
from devkit.bench.hicache import server as hicache_server

# Lines as the Mellum kit server's /metrics page printed them (HiCache host 4x, one idle session resumed)
METRICS_PAGE = """\
# HELP sglang:hicache_backup_bytes_total Bytes backed up from GPU to local host DRAM (L2)
# TYPE sglang:hicache_backup_bytes_total counter
sglang:hicache_backup_tokens_total{cache_type="UnifiedRadixCache",dp_rank="0",pool="kv",pp_rank="0",tp_rank="0"} 1234.0
sglang:hicache_backup_tokens_total{cache_type="UnifiedRadixCache",dp_rank="0",pool="swa",pp_rank="0",tp_rank="0"} 690.0
sglang:hicache_backup_bytes_total{cache_type="UnifiedRadixCache",dp_rank="0",pp_rank="0",tp_rank="0"} 985088.0
sglang:backuped_tokens_total{dp_rank="0",pp_rank="0",storage_backend="file",tp_rank="0"} 1234.0
sglang:load_back_tokens_total{cache_type="UnifiedRadixCache",dp_rank="0",pool="kv",pp_rank="0",tp_rank="0"} 7.0
sglang:load_back_tokens_total{cache_type="UnifiedRadixCache",dp_rank="0",pool="swa",pp_rank="0",tp_rank="0"} 31.0
sglang:load_back_bytes_total{cache_type="UnifiedRadixCache",dp_rank="0",pp_rank="0",tp_rank="0"} 19456.0
sglang:load_back_bytes_total{cache_type="UnifiedRadixCache",dp_rank="1",pp_rank="0",tp_rank="0"} 100.0
"""


def test_the_metrics_page_gives_bytes_each_way_summed_over_label_sets_and_tokens_per_pool():
    counters = hicache_server.parse_counters(METRICS_PAGE)
    assert counters["bytes_d2h"] == 985088.0 and counters["bytes_h2d"] == 19556.0
    assert counters["d2h_tokens"] == {"kv": 1234.0, "swa": 690.0}
    assert counters["h2d_tokens"] == {"kv": 7.0, "swa": 31.0}


def test_a_page_without_hicache_counters_reads_as_nothing_moved():
    counters = hicache_server.parse_counters("# no HiCache\nsglang:num_requests_total 4.0\n")
    assert counters == {"bytes_d2h": 0.0, "bytes_h2d": 0.0, "d2h_tokens": {}, "h2d_tokens": {}}


def test_the_moved_figures_are_after_minus_before_in_ints_and_pools_that_moved_nothing_drop_out():
    before = hicache_server.parse_counters(METRICS_PAGE)
    after = hicache_server.parse_counters(
        METRICS_PAGE.replace("} 985088.0", "} 990208.0").replace('pool="kv",pp_rank="0",tp_rank="0"} 1234.0',
                                                                 'pool="kv",pp_rank="0",tp_rank="0"} 1244.0'))
    assert hicache_server.counters_delta(before, after) == {
        "bytes_d2h": 5120, "bytes_h2d": 0, "d2h_tokens": {"kv": 10}, "h2d_tokens": {}}
    nothing = hicache_server.parse_counters("")
    assert hicache_server.counters_delta(nothing, before)["h2d_tokens"] == {"kv": 7, "swa": 31}


@pytest.mark.parametrize(("history", "cached", "recomputed"), [(608, 607, 1), (608, 0, 608), (608, 631, 0), (608, -1, 608)])
def test_recomputed_history_is_what_lies_past_the_cached_prefix_and_never_below_zero(history, cached, recomputed):
    assert hicache_server.history_recomputed(history, cached) == recomputed


def test_row_names_map_to_their_launch_settings_per_kit():
    mellum, dsv4 = hicache_server.MELLUM, hicache_server.DSV4
    assert hicache_server.row_config(mellum, "stock") == (False, None, False)
    assert hicache_server.row_config(mellum, "stock_hicache") == (False, 4.0, False)
    assert hicache_server.row_config(mellum, "stock_hicache_small") == (False, 1.0, False)
    assert hicache_server.row_config(mellum, "stock_hicache_l3") == (False, 1.0, True)
    assert hicache_server.row_config(mellum, "stock_hicache_large_l3") == (False, 4.0, True)
    assert hicache_server.row_config(dsv4, "stock_hicache_large_l3") == (False, 2.0, True)
    assert hicache_server.row_config(mellum, "profile") == (True, None, False)
    assert hicache_server.row_config(dsv4, "profile_hicache") == (True, 2.0, False)
    with pytest.raises(ValueError, match="row='stock_hicache_small' is not a dsv4 row: expected one of stock, "):
        hicache_server.row_config(dsv4, "stock_hicache_small")


def test_both_kits_have_the_four_required_rows_two_l3_rows_both_idle_forms_and_the_agent_workload():
    for kit in hicache_server.KITS.values():
        assert set(hicache.REQUIRED_NAMES) | {"stock_hicache_l3", "stock_hicache_large_l3"} <= set(kit.rows)
        assert {"idle_swa", "idle_full", "agent"} <= set(kit.workloads) <= set(kit.churn)


def test_the_dsv4_agent_workload_grows_in_whole_256_token_pages():
    # at Mellum's sizes a turn's growth stays inside one DSV4 page: every row recomputes the same
    assert all(tokens % 256 == 0 for tokens in hicache_server.DSV4.agent)
    assert hicache_server.DSV4.agent != hicache_server.MELLUM.agent


def test_a_workload_row_sums_its_turns_takes_the_largest_logprob_distance_and_the_mean_time():
    turns = [
        {"recomputed": 1, "loaded_from_host": 607, "loaded_from_l3": 0, "logprob_max_diff": 1e-7, "ttft_s": 0.2,
         "hit_logprob_diff": 2e-7, "logprob_diff_vs_hit": 0.0, "reference_cached": 0, "tokens_equal": True},
        {"recomputed": 300, "loaded_from_host": 0, "loaded_from_l3": 5, "logprob_max_diff": 4e-7, "ttft_s": 0.4,
         "hit_logprob_diff": 0.0, "logprob_diff_vs_hit": 3e-7, "reference_cached": 0, "tokens_equal": False},
    ]
    assert hicache_server.combine(turns) == {
        "resumed_turns": 2, "recomputed": 301, "loaded_from_host": 607, "loaded_from_l3": 5,
        "logprob_max_diff": 4e-7, "hit_logprob_diff": 2e-7, "logprob_diff_vs_hit": 3e-7, "ttft_s": 0.3,
        "reference_cached": 0, "tokens_equal": False}


def _row(name, kit="mellum", **over):
    row = {"name": name, "kit": kit, "workload": "idle_swa", "recomputed": 1, "loaded_from_host": 607,
           "loaded_from_l3": 0, "bytes_d2h": 512, "bytes_h2d": 0, "d2h_tokens": {"kv": 1}, "h2d_tokens": {},
           "logprob_max_diff": 0.0, "ttft_s": 0.1}
    return row | over


def test_the_schema_accepts_server_rows_and_cache_rows_with_null_time_and_logprobs():
    hicache.check_rows([_row(n) for n in hicache.REQUIRED_NAMES])
    hicache.check_rows([_row(n, kit="cache", ttft_s=None, logprob_max_diff=None) for n in hicache.REQUIRED_NAMES])


@pytest.mark.parametrize(("rows", "message"), [
    ([_row(n) for n in hicache.REQUIRED_NAMES[:3]], r"kit 'mellum' has no row named \['profile_hicache'\]"),
    ([{k: v for k, v in _row("stock").items() if k != "loaded_from_l3"}], r"lacks \['loaded_from_l3'\]"),
    ([_row("stock", recomputed=-1)], "recomputed=-1 is not a count"),
    ([_row("stock", loaded_from_l3=None)], "loaded_from_l3=None is not a count"),
    ([_row("stock", ttft_s="0.1")], "ttft_s='0.1' is neither null nor a float"),
])
def test_the_schema_refuses_a_missing_row_a_missing_key_and_a_wrong_value(rows, message):
    with pytest.raises(ValueError, match=message):
        hicache.check_rows(rows)


def test_the_table_prints_one_line_per_row_with_dashes_for_null_figures_and_flags_a_cached_reference():
    lines: list[str] = []
    hicache.print_table([_row("stock", kit="cache", ttft_s=None, logprob_max_diff=None, h2d_tokens={"swa": 16})],
                        lines.append)
    assert len(lines) == 3 and lines[2].split() == ["cache", "idle_swa", "stock", "1", "607", "0", "512", "0", "1/0",
                                                    "0/16", "-", "-", "-"]
    lines.clear()
    hicache.print_table([_row("stock_hicache_l3", reference_cached=600, logprob_diff_vs_hit=0.0)], lines.append)
    assert lines[2].split()[-1] == "0" and len(lines) == 4
    assert lines[3].startswith("note: mellum idle_swa stock_hicache_l3: the reference re-prefill itself found 600 ")
