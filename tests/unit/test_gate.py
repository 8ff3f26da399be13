"""The gate's judgement, on recorded figures (no server): log reading, output comparison, control
agreement and the rows of switches that cannot act here. The boots are in test_gate_engine.py."""

import dataclasses

import pytest

from adapter.core import env, registry
from adapter.ops import cli

# Scheduler log lines in SGLang 0.5.23's format (``--decode-log-interval 1``), trimmed to the fields read.
from devkit import gate
from devkit.engine_kit import workload as wl

CHUNK = "[t] Prefill batch, #new-seq: 1, #new-token: 64, #cached-token: 0, #running-req: {r}, #queue-req: 0, #pending-token: {p}, x"
DECODE = "[t] Decode batch, #running-req: 4, #full token: 100, gen throughput (token/s): 10.0, #queue-req: 0"


def test_decode_steps_between_chunks_counts_the_steps_logged_between_chunks_beside_streams():
    lines = [CHUNK.format(r=0, p=128), DECODE,  # a lone prompt's chunk: nothing to count
             CHUNK.format(r=4, p=128), DECODE, DECODE, DECODE,
             CHUNK.format(r=4, p=64), DECODE,
             CHUNK.format(r=4, p=0), DECODE, DECODE]  # final chunk: what follows is plain decoding
    assert gate.decode_steps_between_chunks(lines) == [3, 1]
    assert gate.decode_steps_between_chunks([CHUNK.format(r=4, p=64), CHUNK.format(r=4, p=0)]) == [0]


def _boot(label, resume=1.0, cone=0, share=0.5, outputs=None, logprobs=(-0.5, -1.25)):
    boot = gate.Boot(label, {}, None)
    boot.cache = {"resume_cached_frac": resume, "resume_cached_tokens": int(resume * 100), "cone_cached_tokens": 700 - cone,
                  "cone_recomputed_tokens": cone, "outputs": outputs or {"a": [1, 2]},
                  "cone_branch_logprobs": list(logprobs)}
    boot.yield_ = {"decode_share": share, "outputs": {}}
    return boot


def test_outputs_are_compared_only_where_the_two_controls_agree():
    a1 = {"a": [1, 2], "b": [3], "stream0": [5, 6, 7]}
    a2 = {"a": [1, 2], "b": [4], "stream0": [5, 6]}
    b = {"a": [1, 2], "b": [9], "stream0": [5, 6, 7, 8]}
    result = gate.compare_outputs(a1, a2, b)
    assert result["controls_differ"] == ["b"] and result["equal"] == 2 and result["outputs_equal"]
    result = gate.compare_outputs(a1, a2, {**b, "a": [1, 3]})
    assert result["differ"] == ["a"] and not result["outputs_equal"]


def test_controls_that_disagree_make_the_run_invalid_and_say_why():
    a1, a2 = _boot("A1", share=0.05), _boot("A2", share=0.05)
    outputs = gate.compare_outputs(a1.outputs(), a2.outputs(), a1.outputs())
    assert gate.controls_agree(a1, a2, outputs) == (True, [])
    a2.yield_["decode_share"] = 0.5
    ok, why = gate.controls_agree(a1, a2, outputs)
    assert not ok and "decode_share: 0.05 vs 0.5" in why[0]
    a2 = _boot("A2", share=0.05, outputs={"a": [9]})
    outputs = gate.compare_outputs(a1.outputs(), a2.outputs(), a1.outputs())
    ok, why = gate.controls_agree(a1, a2, outputs)
    assert not ok and "different greedy tokens for a" in why[0]


def test_each_row_follows_the_switchs_gate_role_in_the_registry():
    table = {r["switch"]: r["status"] for r in gate.rows(_boot("A1"), _boot("B"), _boot("A2"), [], True)}
    assert set(table) == {s.name for s in registry.SWITCHES}
    for switch in registry.SWITCHES:
        role = switch.gate_role
        if role.not_applicable:
            assert table[switch.name] == f"not applicable here: {role.not_applicable}"
        elif role.not_in_profile:
            assert table[switch.name] == f"not in the profile: {role.not_in_profile}"
        else:
            assert not table[switch.name].startswith(("not applicable", "not in the profile"))
    assert table["autotune_keep"].startswith("not applicable here: FlashInfer autotuning runs only on CUDA")


def test_a_switch_whose_module_is_missing_shows_not_available_and_is_left_out_of_the_profile(monkeypatch):
    thin = registry.by_name("swa_thin")
    missing = dataclasses.replace(thin, install="adapter.switches.no_such_module:install")
    monkeypatch.setattr(registry, "SWITCHES", tuple(missing if s is thin else s for s in registry.SWITCHES))
    table = {r["switch"]: r["status"] for r in gate.rows(_boot("A1"), _boot("B"), _boot("A2"), [], True)}
    assert table["swa_thin"] == "not available in this build: its module adapter.switches.no_such_module is missing"
    assert "DSV41_SWA_THIN" not in gate.build_profile()


def test_an_acting_switch_the_gate_has_no_row_for_fails_instead_of_passing(monkeypatch):
    thin = registry.by_name("swa_thin")
    unknown = dataclasses.replace(thin, name="no_row_switch")
    monkeypatch.setattr(registry, "SWITCHES", (*registry.SWITCHES, unknown))
    row = gate._effect_row("no_row_switch", _boot("A1"), _boot("B"), _boot("A2"), True)
    assert row["status"].startswith("FAIL: the registry says this switch acts in the gate")


def test_thin_row_passes_only_when_the_profile_resumes_cached_and_both_controls_do_not():
    row = gate._effect_row("swa_thin", _boot("A1", resume=0.0), _boot("B", resume=1.0), _boot("A2", resume=0.0), True)
    assert row["status"] == "pass"
    row = gate._effect_row("swa_thin", _boot("A1", resume=0.0), _boot("B", resume=0.0), _boot("A2", resume=0.0), True)
    assert row["status"] == "FAIL: the profile resumed 0.00 cached (not its whole context) where both controls lost the session"


def test_a_switch_refused_at_boot_shows_its_receipt_gap_and_never_passes():
    gaps = ["swa_thin refused on tp0: engine drifted"]
    table = {r["switch"]: r["status"] for r in gate.rows(_boot("A1"), _boot("B"), _boot("A2"), gaps, True)}
    assert table["swa_thin"] == "not available in this build: refused at boot: swa_thin refused on tp0: engine drifted"


def test_without_leaves_a_switch_out_of_the_profile_and_rejects_unknown_names():
    assert "DSV41_SWA_THIN" not in gate.build_profile(without=("swa_thin",))
    table = {r["switch"]: r["status"] for r in gate.rows(_boot("A1"), _boot("B"), _boot("A2"), [], True, ("swa_thin",))}
    assert table["swa_thin"] == "not in this run: left out with --without"
    with pytest.raises(ValueError, match=r"without=\['swa_thn'\] is invalid"):
        gate.build_profile(without=("swa_thn",))


def test_cone_row_needs_the_switchs_own_plan_lines_not_only_fewer_recomputed_tokens():
    a1, b, a2 = _boot("A1", cone=700), _boot("B", cone=60), _boot("A2", cone=700)
    assert gate._effect_row("cone_replay", a1, b, a2, True)["status"].startswith("FAIL")
    b.log_lines = ["[dsv41] cone_replay DSV41_SWA_CONE plan rid=x F=700 s=636 N=64 P=0 rank=tp0"]
    assert gate._effect_row("cone_replay", a1, b, a2, True)["status"] == "pass"


def test_the_cone_row_fails_when_branch_logprobs_drift_beyond_float_noise():
    a1, a2 = _boot("A1", cone=700), _boot("A2", cone=700)
    b = _boot("B", cone=60, logprobs=(-0.5 + 2e-7, -1.25 - 1e-6))
    b.log_lines = ["[dsv41] cone_replay DSV41_SWA_CONE plan rid=x F=700 s=636 N=64 P=0 rank=tp0"]
    assert gate._effect_row("cone_replay", a1, b, a2, True)["status"] == "pass"
    assert gate.cone_logprob_diff(a1, b, a2) == pytest.approx(1e-6, rel=1e-3)
    b.cache["cone_branch_logprobs"] = [-0.5, -1.25 + 4e-3]  # the replay changed what the row saw
    assert gate._effect_row("cone_replay", a1, b, a2, True)["status"].startswith("FAIL")
    b.cache["cone_branch_logprobs"] = [-0.5]  # a boot without the figure never passes
    assert gate.cone_logprob_diff(a1, b, a2) is None
    assert gate._effect_row("cone_replay", a1, b, a2, True)["status"].startswith("FAIL")


@pytest.mark.spawns
def test_gate_is_a_subcommand_of_the_cli():
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["gate", "--help"])
    assert exit_info.value.code == 0


def test_the_plugin_way_is_refused_before_any_boot_where_the_kit_cannot_boot_it():
    from devkit.gate import ways

    ways.check("plugin", "mellum")
    ways.check("import-hook", "dsv4")
    with pytest.raises(ValueError, match="--via plugin with --model dsv4 is invalid: the plugin way runs on mellum only"):
        ways.check("plugin", "dsv4")
    with pytest.raises(ValueError, match="--via 'pip' is invalid: expected one of import-hook, plugin"):
        ways.check("pip", "mellum")


def test_a_plugin_server_runs_the_venvs_python_with_only_the_stand_in_on_the_path_outside_the_repo(tmp_path):
    from devkit.engine_kit import launcher, model_kits
    from devkit.gate import ways

    plugin = ways.Plugin(tmp_path / "venv" / "bin" / "python", tmp_path)
    server = model_kits.kit("mellum").server(tmp_path / "model", tmp_path / "b.log", {"DSV41_SWA_THIN": "1"}, [], plugin=plugin)
    assert server.python == str(plugin.python) and server.cwd == tmp_path
    assert server.env["PYTHONPATH"] == str(launcher.STUB_PATH) and server.env["SGLANG_PLUGINS"] == "dsv41"
    assert server.env["DSV41_SWA_THIN"] == "1"
    hook = model_kits.kit("mellum").server(tmp_path / "model", tmp_path / "a.log", {}, [])
    assert str(launcher.REPO_ROOT) in hook.env["PYTHONPATH"].split(":") and "SGLANG_PLUGINS" not in hook.env


def _hicache(boot):
    boot.launch_extra = ("--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-write-policy", "write_through")
    return boot


@pytest.mark.parametrize("beside_hicache", [False, True], ids=["plain", "hicache"])
def test_thin_row_cannot_act_where_the_controls_kept_the_idle_session_and_never_passes(beside_hicache):
    """HiCache alone brought the session back from host (the old leg's workload): nothing for thin to
    keep, so the row says so instead of passing."""
    leg = _hicache if beside_hicache else (lambda boot: boot)
    a1, b, a2 = (leg(_boot(x, resume=1.0)) for x in ("A1", "B", "A2"))
    status = gate._effect_row("swa_thin", a1, b, a2, True)["status"]
    assert status == ("cannot act on this leg's workload: the controls resumed the idle session 1.00 cached "
                      "(at least 0.5): nothing lost for SWA thin to keep")
    half = leg(_boot("A2", resume=0.5))  # a control that kept half the context did not lose it either
    assert gate._effect_row("swa_thin", leg(_boot("A1", resume=0.5)), b, half, True)["status"].startswith(gate.CANNOT_ACT)


def test_beside_hicache_thin_passes_only_when_it_kept_what_stock_and_hicache_lost():
    """Recorded on the HiCache leg (`gate --quick --hicache`, Mellum): the controls resume 0.00, the
    profile 1.00."""
    a1, a2 = _hicache(_boot("A1", resume=0.0)), _hicache(_boot("A2", resume=0.0))
    assert gate._effect_row("swa_thin", a1, _hicache(_boot("B", resume=1.0)), a2, True)["status"] == "pass"
    partial = _hicache(_boot("B", resume=0.4375))  # a checkpoint kept, not the resume point
    assert gate._effect_row("swa_thin", a1, partial, a2, True)["status"].startswith("FAIL: the profile resumed 0.44")


def test_thin_row_fails_where_a_cone_replay_and_not_thin_brought_the_session_back():
    """Recorded with `--drop-key DSV41_SWA_THIN` on the HiCache leg: the cone replayed 64 tokens before
    the idle session's resume point, 0.94 of its context cached. That is the cone's, not thin's."""
    a1, a2 = _hicache(_boot("A1", resume=0.0)), _hicache(_boot("A2", resume=0.0))
    cone_only = _hicache(_boot("B", resume=0.9375))
    assert gate._effect_row("swa_thin", a1, cone_only, a2, True)["status"] == (
        "FAIL: the profile resumed 0.94 cached (not its whole context) where both controls lost the session")


def _table(*statuses):
    return [{"switch": f"s{i}", "status": status} for i, status in enumerate(statuses)]


def test_a_run_where_a_switch_cannot_act_is_invalid_never_pass():
    idle = gate.CANNOT_ACT + "the controls kept it"
    assert gate.overall(True, True, True, _table("pass", "pass (outputs equal)")) == ("PASS", "")
    assert gate.overall(True, True, True, _table("pass", idle)) == ("INVALID", "cannot act on this leg's workload: s1")
    assert gate.overall(True, True, True, _table(idle)) == ("INVALID", "cannot act on this leg's workload: s0")


def test_a_failed_row_fails_the_run_before_a_row_that_cannot_act_and_disagreeing_controls_invalidate_it():
    idle = gate.CANNOT_ACT + "the controls kept it"
    assert gate.overall(True, True, True, _table("FAIL: x", idle)) == ("FAIL", "rows failed: s0")
    assert gate.overall(True, False, True, _table("pass"))[0] == "FAIL"
    assert gate.overall(True, True, False, _table("pass")) == ("FAIL", "greedy outputs differ from the controls")
    assert gate.overall(False, True, True, _table("pass")) == ("INVALID", "the stock controls disagree")
    assert gate.overall(True, True, True, _table("not applicable here: cpu")) == ("FAIL", "no switch acted")


FALLBACK = "[dsv41] cone_replay DSV41_SWA_CONE fallback rid=r1 reason=full_on_host F=480 P=0 B=64 rank=tp0"
PLAN = "[dsv41] cone_replay DSV41_SWA_CONE plan rid=x F=480 s=416 N=64 P=64 B=64 rank=tp0"


def test_cone_row_fails_and_names_the_fallback_when_the_cone_did_not_plan_beside_hicache():
    """Recorded with Full-pool pressure beside HiCache: the branch point's Full KV was on host only, the
    cone fell back (``full_on_host``) and recomputed what the controls did."""
    a1, a2 = _hicache(_boot("A1", cone=480)), _hicache(_boot("A2", cone=480))
    b = _hicache(_boot("B", cone=480))
    b.profile = {"DSV41_SWA_CONE_TOKENS": "64"}
    b.log_lines = [FALLBACK]
    assert gate._effect_row("cone_replay", a1, b, a2, True)["status"] == (
        "FAIL: no replay planned (fallback: full_on_host); 480 tokens recomputed, not fewer than the controls' 480")
    b.cache["cone_recomputed_tokens"], b.log_lines = 64, [PLAN]
    assert gate._effect_row("cone_replay", a1, b, a2, True)["status"] == "pass"


def test_cone_row_cannot_act_where_the_controls_recomputed_no_more_than_the_replay_depth():
    a1, a2 = _boot("A1", cone=64), _boot("A2", cone=64)
    b = _boot("B", cone=64)
    b.profile = {"DSV41_SWA_CONE_TOKENS": "64"}
    b.log_lines = [PLAN]
    assert gate._effect_row("cone_replay", a1, b, a2, True)["status"] == (
        "cannot act on this leg's workload: the controls recomputed 64 of the branch's tokens, no more than the "
        "replay's N = 64")


def test_yield_row_cannot_act_where_the_controls_logged_no_chunk_beside_streams():
    a1, b, a2 = _boot("A1", share=0.05), _boot("B", share=0.5), _boot("A2", share=0.05)
    assert gate._effect_row("decode_yield", a1, b, a2, True)["status"].startswith(gate.CANNOT_ACT + "the controls logged no")
    for boot in (a1, a2, b):
        boot.log_lines = [CHUNK.format(r=4, p=128), DECODE, CHUNK.format(r=4, p=0)]
    assert gate._effect_row("decode_yield", a1, b, a2, True)["status"] == "pass"


def test_a_switch_without_a_figure_passes_on_equal_outputs_only_where_the_profile_boot_installed_it():
    """With `--drop-key DSV41_SWA_THIN` the fast tree core (which thin turns on) is off in the profile
    boot: equal outputs then show nothing about it."""
    b = _boot("B")
    assert gate._effect_row("fast_tree_core", _boot("A1"), b, _boot("A2"), True)["status"] == (
        "FAIL: not installed on the profile boot (no '[dsv41] fast_tree_core installed' line)")
    b.log_lines = ["[dsv41] fast_tree_core installed paths=insert_walk,match,full_lock key_copies=once_per_insert rank=tp0"]
    assert gate._effect_row("fast_tree_core", _boot("A1"), b, _boot("A2"), True)["status"] == "pass (outputs equal)"
    assert gate._effect_row("fast_tree_core", _boot("A1"), b, _boot("A2"), False)["status"] == "FAIL: outputs differ"


def test_drop_key_runs_the_profile_boot_without_the_key_and_rejects_keys_not_in_the_profile():
    profile = gate.build_profile()
    kept = gate.drop_keys(profile, ("DSV41_SWA_THIN",))
    assert "DSV41_SWA_THIN" not in kept and set(kept) == set(profile) - {"DSV41_SWA_THIN"}
    with pytest.raises(ValueError, match=r"--drop-key 'DSV41_SWA_THN' is invalid: expected a key of the gate's profile"):
        gate.drop_keys(profile, ("DSV41_SWA_THN",))
    # the row is still judged: a profile boot without thin that lost the session fails it
    table = {r["switch"]: r["status"] for r in gate.rows(_boot("A1", resume=0.0), _boot("B", resume=0.0),
                                                           _boot("A2", resume=0.0), [], True)}
    assert table["swa_thin"].startswith("FAIL")


def test_the_hicache_leg_runs_the_datacenter_profiles_hicache_flags():
    """The leg's flags are read from the profile's LAUNCH_ARGS: SGLang parses the same HiCache settings
    from both (write-through, the profile's ratio)."""
    from adapter.ops import check
    from devkit.gate import hicache_leg

    args = hicache_leg.launch_args()
    profile_words = env.read_env_file(str(hicache_leg.PROFILE))[check.LAUNCH_KEY].split()
    assert check.parse_launch(list(args)).hicache == check.parse_launch(profile_words).hicache
    assert check.parse_launch(list(args)).hicache["write_policy"] == "write_through"
    assert all(a == "--enable-hierarchical-cache" or a.startswith("--hicache-") or not a.startswith("-") for a in args)
    assert hicache_leg.host_ratio(args) == float(args[args.index("--hicache-ratio") + 1])


def test_the_hicache_leg_refuses_a_profile_without_hicache_or_sized_in_gigabytes(tmp_path):
    from devkit.gate import hicache_leg

    plain = tmp_path / "plain.env"
    plain.write_text("LAUNCH_ARGS=--model-path /m --page-size 256\nDSV41_SWA_THIN=1\n")
    with pytest.raises(ValueError, match="has no --enable-hierarchical-cache"):
        hicache_leg.launch_args(plain)
    with pytest.raises(ValueError, match="is missing"):
        hicache_leg.launch_args(tmp_path / "nothing.env")
    with pytest.raises(ValueError, match="expected --hicache-ratio R and no --hicache-size"):
        hicache_leg.host_ratio(("--enable-hierarchical-cache", "--hicache-size", "64"))


def test_the_hicache_legs_churn_outruns_the_swa_pool_and_host_tier_without_pressing_the_full_pool():
    from devkit.engine_kit import model_kits
    from devkit.gate import hicache_leg

    ratio = hicache_leg.host_ratio(hicache_leg.launch_args())
    swa = int(model_kits.MELLUM_MAX_TOTAL_TOKENS * model_kits.MELLUM_SWA_RATIO)
    for quick in (True, False):
        w = model_kits.kit("mellum").workload(quick, ratio)
        churn = w.churn_requests * w.churn_tokens
        assert churn >= model_kits.OUTRUN * (1 + ratio) * swa
        assert churn + w.session_tokens + w.cone_tokens < model_kits.MELLUM_MAX_TOTAL_TOKENS
    assert model_kits.kit("mellum").workload(True).churn_requests == 10  # the plain leg's workload is unchanged
    assert model_kits.kit("mellum").workload(True).host_churn_requests == 0  # no host phase without HiCache
    with pytest.raises(ValueError, match="--hicache with --model mellum is invalid at --hicache-ratio 4"):
        model_kits.kit("mellum").workload(True, 4.0)


def test_the_dsv4_kits_hicache_leg_runs_the_churn_found_for_the_profiles_host_tier_inside_its_full_pool():
    """The Mellum rule would take 6 three-chunk churn requests, past the DSV4 kit's 64-page Full pool;
    the kit runs the churn found in-process for the profile's ratio and policy
    (tests/upstream/test_gate_dsv4_hicache_geometry.py) and a two-chunk host session."""
    from devkit.engine_kit import model_kits
    from devkit.gate import hicache_leg

    args = hicache_leg.launch_args()
    ratio, policy = hicache_leg.host_ratio(args), hicache_leg.write_policy(args)
    full = model_kits.DSV4_MAX_TOTAL_TOKENS
    for quick in (True, False):
        w = model_kits.kit("dsv4").workload(quick, ratio, policy)
        assert (w.churn_requests, w.churn_tokens) == (4, 3 * model_kits.DSV4_CHUNK)
        assert model_kits.cache_phases_held(w) == 14912 <= full
        assert w.host_session_tokens == 2 * model_kits.DSV4_CHUNK
        # the host phase: past the device Full pool, inside the host tier
        assert w.host_churn_requests == 7 and full < 7 * (w.churn_tokens + 4) < ratio * full - w.host_session_tokens
    assert model_kits.kit("dsv4").workload(True).churn_requests == 2  # the plain leg's workload is unchanged
    assert model_kits.kit("dsv4").workload(True).host_churn_requests == 0


@pytest.mark.parametrize(("ratio", "policy"), [(4.0, "write_through"), (2.0, "write_back"), (2.0, None)])
def test_the_dsv4_kits_hicache_leg_refuses_a_host_tier_its_churn_was_not_found_for(ratio, policy):
    from devkit.engine_kit import model_kits

    with pytest.raises(ValueError, match=rf"--hicache with --model dsv4 is invalid at --hicache-ratio {ratio:g} "
                       rf"--hicache-write-policy {policy}: the kit's HiCache churn was found for --hicache-ratio 2 "
                       r"--hicache-write-policy write_through only .* find it in-process, "
                       r"tests/upstream/test_gate_dsv4_hicache_geometry.py"):
        model_kits.kit("dsv4").workload(True, ratio, policy)


def test_the_dsv4_kits_hicache_churn_is_refused_where_it_would_press_the_full_pool(monkeypatch):
    from devkit.engine_kit import model_kits

    monkeypatch.setitem(model_kits.DSV4_HICACHE_CHURN, (1.0, "write_through"), 5)
    with pytest.raises(ValueError, match=r"--hicache with --model dsv4 is invalid at --hicache-ratio 1 "
                       r"--hicache-write-policy write_through: outrunning the host tier takes 5 churn requests of 3072 "
                       r"tokens, 17988 tokens in all, more than the kit's Full pool of 16384"):
        model_kits.kit("dsv4").workload(True, 1.0, "write_through")


def test_the_hicache_legs_host_phase_presses_the_device_full_pool_while_the_host_tier_holds_the_session():
    """The host phase's churn passes the device Full pool (its session, the oldest leaf, leaves the
    device) and leaves room for the session in the host tier (ratio x the pool)."""
    from devkit.engine_kit import model_kits
    from devkit.gate import hicache_leg

    ratio = hicache_leg.host_ratio(hicache_leg.launch_args())
    full = model_kits.MELLUM_MAX_TOTAL_TOKENS
    for quick in (True, False):
        w = model_kits.kit("mellum").workload(quick, ratio)
        churn = w.host_churn_requests * (w.churn_tokens + 4)
        assert full < churn and churn + w.host_session_tokens + w.turn_tokens < ratio * full
    with pytest.raises(ValueError, match=r"--hicache with --model mellum is invalid at --hicache-ratio 1: pressing the "
                       r"Full pool of 16384 tokens takes 40 churn requests of 512 tokens, 21672 tokens in all, more than "
                       r"the host tier holds"):
        model_kits.press_full_pool(wl.Workload.quick(), 1.0, model_kits.MELLUM_MAX_TOTAL_TOKENS, "mellum")


@pytest.mark.parametrize(("model", "hicache", "drop", "error"), [
    ("mellum", False, ["DSV41_NOPE"], "--drop-key 'DSV41_NOPE' is invalid: expected a key of the gate's profile"),
    ("dsv4", True, [], "--hicache with --model dsv4 is invalid at --hicache-ratio 4 --hicache-write-policy write_through"),
], ids=["drop-key", "dsv4-hicache"])
def test_a_bad_drop_key_or_a_kit_the_hicache_leg_cannot_outrun_fails_before_any_boot(tmp_path, capsys, monkeypatch,
                                                                                      model, hicache, drop, error):
    import argparse

    from devkit.gate import hicache_leg

    # a profile whose host tier the DSV4 kit's churn was not found for
    monkeypatch.setattr(hicache_leg, "launch_args", lambda: ("--enable-hierarchical-cache", "--hicache-ratio", "4",
                                                             "--hicache-write-policy", "write_through"))
    args = argparse.Namespace(quick=True, out=str(tmp_path / "gate"), without=[], model=model, via="import-hook",
                              hicache=hicache, drop_key=drop)
    assert gate.main(args) == 2
    assert error in capsys.readouterr().err
    assert not (tmp_path / "gate").exists()  # nothing built, nothing booted
