"""``simulate`` on traces and flags that claim more than the model or the clock holds, and on keyed
sessions whose blocks disagree: one-line errors, memory by the trace's real shape, no invented hits.
Small generated traces on the real cache (page 16), answers known by construction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapter.core import env
from adapter.ops import cli
from devkit.testkit.simulate_fleet import replay as _replay
from devkit.testkit.simulate_fleet import small_fleet as _fleet
from overlay_tools import simulate
from overlay_tools.simulate import engine, fleet, report, trace


def _write(tmp_path, rows, name="t.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _row(ts, n_in, n_out, ids, **extra):
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids, **extra}


@pytest.mark.parametrize("scale", ["nan", "inf", "-inf", "0", "-2"])
def test_a_time_scale_that_is_not_finite_and_positive_is_a_one_line_error(tmp_path, capsys, scale):
    path = _write(tmp_path, [_row(0, 512, 4, [1])])
    assert cli.main(["simulate", path, f"--time-scale={scale}"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --time-scale='{float(scale)}' is not valid: expected a finite positive factor\n"


def test_a_time_scale_that_pushes_the_last_arrival_past_the_clock_names_the_largest_it_allows(tmp_path, capsys):
    path = _write(tmp_path, [_row(0, 512, 4, [1]), _row(2**50, 512, 4, [2])])
    assert cli.main(["simulate", path, "--time-scale", "1e3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --time-scale='1000.0' is not valid: expected a factor of at most 8 for this "
                          "trace (its last timestamp 1,125,899,906,842,624 ms") and "\n" not in err


def test_the_cli_bounds_a_line_by_the_profiles_context_length(tmp_path, capsys):
    """The production profile serves DeepSeek-V4.1 at its assumed 1M context (said in the geometry
    line): an output of 2**20 tokens after a 1,024-token prompt is past it, an error naming line 2,
    the field, the value and the limit; a launch line's --context-length is the limit instead."""
    path = _write(tmp_path, [_row(0, 512, 4, [1]), _row(1, 1024, 2**20, [1, 2])])
    assert cli.main(["simulate", path]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {path}:2: output_length=1048576: expected an integer 1..1,047,552 (input_length 1,024 + "
                   "output_length within the model's context length 1,048,576)\n")
    profile = (fleet.REPO / ".env.tp4.example").read_text().replace(" --page-size 256", " --page-size 256 "
                                                                       "--context-length 2048")
    (tmp_path / "short.env").write_text(profile)
    geo = fleet.resolve(str(tmp_path / "short.env"))
    assert geo.context_len == 2048 and "context length 2,048 (--context-length of the launch line)" in geo.describe()
    assert "context length 1,048,576 (assumed for DeepSeek-V4.1" in fleet.resolve().describe()


def test_a_model_folders_context_length_is_what_sglang_derives_from_its_config(tmp_path):
    config = dict(fleet.V41_CONFIG, max_position_embeddings=65536)
    (tmp_path / "config.json").write_text(json.dumps(config))
    geo = fleet.resolve(None, str(tmp_path))
    assert geo.context_len == 65536 and "get_context_length" in geo.context_source


def _peak_rss_kib(fn) -> int:
    """Peak resident memory (KiB) while ``fn`` runs, above what was resident before (VmHWM, reset
    through /proc/self/clear_refs)."""
    status = Path("/proc/self/status")

    def field(name: str) -> int:
        return int(status.read_text().split(f"{name}:")[1].split()[0])

    before = field("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    fn()
    return field("VmHWM") - before


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS reset needs Linux's clear_refs")
def test_one_huge_but_allowed_output_costs_memory_by_the_traces_shape_not_its_claim(tmp_path):
    """The same small trace with and without one request claiming 4M output tokens (within a 4M+
    context; its decode outgrows the pool, so it is skipped): the replay and the ideal-prefix pass
    peak within twice the small trace's memory (+ 16 MiB of allocator noise). Rows sized by the
    longest request (11 rows x 4M x int32 = 176 MiB) or a set entry per output page (262,144) would
    not."""
    small = [(0, 512, 16, [1]), (10, 1024, 16, [2, 3]), (20, 1536, 16, [1, 4, 5])]

    def run(rows):
        requests = trace.prepare([trace.Request(i, i + 1, ts, n_in, n_out, ids)
                                  for i, (ts, n_in, n_out, ids) in enumerate(rows)], 16)
        engine.ideal_prefixes(requests, 16)
        _replay("stock", requests)

    run(small)  # warm: imports and first-use caches
    base = _peak_rss_kib(lambda: run(small))
    huge = _peak_rss_kib(lambda: run([*small, (30, 512, 4 << 20, [9])]))
    assert huge <= 2 * base + 16 * 1024, (base, huge)


def test_a_keyed_pair_with_disjoint_blocks_replays_as_no_hit_and_the_ideal_does_not_count_one(tmp_path, capsys):
    """Two 2,048-token requests with one session id and disjoint hash_ids: the second recomputes all
    2,048 tokens under every policy and in the ideal row; it has no resume point, so no resume hit
    (it used to replay as a 1,792-token hit, resume hit 1.000); the output counts the pair."""
    path = _write(tmp_path, [_row(0, 2048, 8, [1, 2, 3, 4], conv="s"), _row(100, 2048, 8, [5, 6, 7, 8], conv="s")])
    requests = trace.load(path, 16, session_key="conv")
    ideal = engine.ideal_prefixes(requests, 16)
    for policy in ("stock", "thin"):
        (a, b), row = _replay(policy, requests)
        assert b.continuation and b.history == b.resume_at == 0 and b.prefix == 0 and b.recomputed == 2048, policy
        assert row["resume_points"] == 0 and row["resume_hits"] == 0 and row["resume_hit_rate"] is None, policy
        assert report.ideal_summary([a, b], ideal)["recomputed_tokens_continuation"] == 2048
    assert cli.main(["simulate", path, "--session-key", "conv", "--policies", "stock", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["sessions"]["disagreeing"] == 1 and out["ideal"]["recomputed_tokens_continuation"] == 2048
    assert out["policies"]["stock"]["resume_hit_rate"] is None


def test_the_p90_of_two_turns_is_by_numpys_linear_default_never_below_their_mean():
    turns = [engine.Turn(i, False, 16, 0, 0, 0, 0, False, ready_fs=0, first_token_fs=s * report.FS_PER_S)
             for i, s in enumerate((1, 3))]
    row = report.summarize(turns, 1.0)
    assert row["ttft_s_modelled_mean"] == 2.0 and row["ttft_s_modelled_p90"] == 2.8
    assert "linear interpolation" in report.PERCENTILE_METHOD


@pytest.mark.parametrize(("key", "parks", "error"), [
    ("DSV41_KV_PARK=ram", True, None),
    ("DSV41_KV_PARK=0", None, "DSV41_KV_PARK='0' is not valid: expected one of ram"),
    ("DSV41_KV_PRAK=ram", False, None),
])
def test_profile_keys_are_parsed_by_the_switch_registry(tmp_path, key, parks, error):
    """Parking is on only when the registry says so: ``=0`` is a value the engine's boot refuses (so
    does simulate, naming it), a misspelt key parks nothing and is said with the registry's hint."""
    profile = tmp_path / "p.env"
    profile.write_text((fleet.REPO / ".env.tp4.example").read_text() + f"\n{key}\n")
    if error:
        with pytest.raises(env.ConfigError, match=error.replace("(", r"\(")):
            fleet.resolve(str(profile))
        return
    geo = fleet.resolve(str(profile))
    assert geo.kv_park is parks
    if "PRAK" in key:
        assert geo.profile_warnings == ("unknown key DSV41_KV_PRAK ignored; did you mean DSV41_KV_PARK?",)


def test_max_prefill_tokens_ends_a_pass_once_its_extends_reach_it(tmp_path):
    """Three 32-token strangers arrive together (chunk 128). With SGLang's default --max-prefill-tokens
    one pass admits all three; at 32 the pass admits one (the adder's rem_input_tokens reaches 0),
    so each first token comes a pass later; the launch line's value is the fleet's."""
    rows = [(0, 32, 4, [1]), (0, 32, 4, [2]), (0, 32, 4, [3])]
    requests = trace.prepare([trace.Request(i, i + 1, ts, n, o, ids) for i, (ts, n, o, ids) in enumerate(rows)], 16)
    import dataclasses

    wide, _ = simulate.run_policy("stock", _fleet(), requests, progress=False)
    narrow, _ = simulate.run_policy("stock", dataclasses.replace(_fleet(), max_prefill_tokens=32), requests,
                                    progress=False)
    assert len({t.first_token_fs for t in wide}) == 1
    assert narrow[0].first_token_fs < narrow[1].first_token_fs < narrow[2].first_token_fs
    profile = (fleet.REPO / ".env.tp4.example").read_text().replace(" --page-size 256", " --page-size 256 "
                                                                       "--max-prefill-tokens 4096")
    (tmp_path / "mp.env").write_text(profile)
    assert fleet.resolve(str(tmp_path / "mp.env")).max_prefill_tokens == 4096
    assert fleet.resolve().max_prefill_tokens == 16384
