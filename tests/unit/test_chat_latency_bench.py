"""bench chat-latency's per-request judgement (devkit/bench/chat_latency.py) and the kit's metrics
page reader (devkit/engine_kit/metrics_page.py), on recorded figures: no server."""

from __future__ import annotations

from devkit.bench.chat_latency import BootResult, past_bound, per_request_mean, summarize
from devkit.engine_kit.metrics_page import counter_sums

YIELD = {"DSV41_DECODE_YIELD": "33"}
BOUND = 100 / 67


def boot(label: str, profile: dict[str, str], ttfts: list[float | None], round_: int = 1,
         longest_ms: float = 0.0, unbounded: int = 0) -> BootResult:
    present = [x for x in ttfts if x is not None]
    figures = {"mean_ttft_ms": sum(present) / len(present), "p99_ttft_ms": max(present), "mean_itl_ms": 6.0,
               "p99_itl_ms": 30.0, "median_e2e_ms": 100.0, "ttfts_ms": ttfts}
    return BootResult(label, profile, round_, figures=figures, windows={"windows": 3, "longest_ms": longest_ms},
                      counted={"unbounded": unbounded} if profile else {})


def test_a_request_past_the_bound_times_its_own_stock_ttft_plus_the_window_is_counted():
    stock = [10.0, 100.0, 40.0]
    # 10 ms stock: bound 14.9 + 5 ms window; 100 ms stock: 149.3 + 5
    assert past_bound([19.0, 150.0, 40.0], stock, BOUND, 5.0) == 0
    assert past_bound([20.0, 155.0, 40.0], stock, BOUND, 5.0) == 2
    # a failed request (None) on either side is not judged; boots that do not line up are not compared
    assert past_bound([None, 155.0, 40.0], [10.0, None, 40.0], BOUND, 5.0) == 0
    assert past_bound([20.0, 155.0], stock, BOUND, 5.0) is None


def test_the_stock_ttft_of_a_request_is_the_mean_over_the_stock_boots():
    assert per_request_mean([[10.0, 20.0, None], [30.0, None, None]]) == [20.0, 20.0, None]
    assert per_request_mean([[1.0], [1.0, 2.0]]) == []


def test_summarize_judges_each_boot_per_request_and_gives_stock_boots_the_noise_floor():
    boots = [
        boot("stock", {}, [10.0, 100.0, 40.0, 20.0]),
        boot("yield 33", YIELD, [14.0, 160.0, 40.0, 20.0], longest_ms=5.0, unbounded=1),
        boot("stock", {}, [10.0, 100.0, 40.0, 31.0], round_=2),
        boot("yield 33", YIELD, [30.0, 100.0, 40.0, 40.0], round_=2, longest_ms=5.0, unbounded=0),
    ]
    rows = {r["row"]: r for r in summarize(boots)}
    # stock per request: 10, 100, 40, 25.5; the bound x that + 5 ms: 19.9, 154.3, 64.7, 43.1
    assert rows["yield 33"]["past_bound"] == [1, 1]
    assert rows["yield 33"]["counted"] == [1, 0]
    # each stock boot against the other at the run's tightest bound (1.49, no window): 31 > 1.49 x 20
    assert rows["stock"]["past_bound"] == [0, 1]
    assert rows["stock"]["counted"] == [None, None]


def test_the_first_turn_check_reads_each_conversations_first_turn_alone():
    # two conversations of three turns, listed turn by turn: 0, 1, 2 then 3, 4, 5
    stock = [10.0, 20.0, 30.0, 10.0, 20.0, 30.0]
    late = [10.0, 90.0, 30.0, 40.0, 90.0, 30.0]  # past: turn 2 of both, turn 1 of the second
    rows = {r["row"]: r for r in summarize([boot("stock", {}, stock), boot("stock", {}, stock, round_=2),
                                            boot("yield 33", YIELD, late)], turns=3)}
    assert rows["yield 33"]["past_bound"] == [3]
    assert rows["yield 33"]["past_bound_turn1"] == [1]
    assert rows["stock"]["past_bound_turn1"] == [0, 0]
    assert "past_bound_turn1" not in summarize([boot("stock", {}, stock), boot("yield 33", YIELD, late)])[1]


def test_a_run_with_one_stock_boot_has_no_noise_floor():
    rows = summarize([boot("stock", {}, [10.0]), boot("yield 33", YIELD, [30.0], longest_ms=1.0)])
    assert rows[0]["past_bound"] == [None]
    assert rows[1]["past_bound"] == [1]


def test_counter_sums_adds_a_counter_over_its_label_sets_and_reads_an_absent_one_as_zero():
    page = "\n".join([
        "# HELP dsv41_decode_yield_prompts_unbounded_total prompts served past their bound",
        "# TYPE dsv41_decode_yield_prompts_unbounded_total counter",
        'dsv41_decode_yield_prompts_unbounded_total{model_name="m",tp_rank="0"} 3.0',
        'dsv41_decode_yield_prompts_unbounded_total{model_name="m",tp_rank="1"} 2.0',
        "# HELP sglang_num_running_reqs running",
        "# TYPE sglang_num_running_reqs gauge",
        'sglang_num_running_reqs{model_name="m"} 4.0',
        "",
    ])
    sums = counter_sums(page, ["dsv41_decode_yield_prompts_unbounded_total", "dsv41_decode_yield_bursts_total"])
    assert sums == {"dsv41_decode_yield_prompts_unbounded_total": 5.0, "dsv41_decode_yield_bursts_total": 0.0}


def test_the_dsv4_chat_boot_prefills_a_page_a_chunk_so_chat_prompts_are_multi_chunk(tmp_path):
    from devkit.bench.chat_latency import CHAT_KITS, DSV4_CHAT_CHUNK
    from devkit.engine_kit.model_kits import DSV4_CHUNK

    server = CHAT_KITS["dsv4"].server(tmp_path / "model", tmp_path / "log", {}, ["--enable-metrics"])  # not started
    args = server.args
    assert args[args.index("--chunked-prefill-size") + 1] == str(DSV4_CHAT_CHUNK) == "256"
    assert DSV4_CHAT_CHUNK < DSV4_CHUNK and "--enable-metrics" in args


def test_the_varied_traffic_asks_the_client_for_drawn_lengths_and_the_issue_traffic_does_not(tmp_path):
    from devkit.bench.chat_latency import TRAFFIC, VARIED, client_args

    plain = client_args("http://h:1", tmp_path, tmp_path / "o.json", TRAFFIC)
    varied = client_args("http://h:1", tmp_path, tmp_path / "o.json", {**TRAFFIC, **VARIED})
    assert "--gsp-range-ratio" not in plain  # bench_serving's default: every answer --gsp-output-len tokens
    assert varied[varied.index("--gsp-range-ratio") + 1] == "0.5"
    assert varied[:len(plain)] == plain
