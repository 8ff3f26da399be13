"""The gate's judgement, on recorded figures (no server): log reading, output comparison, control
agreement and the rows of switches that cannot act here. The boots are in test_gate_engine.py."""

import dataclasses

import pytest

from adapter.core import registry
from adapter.ops import cli

# Scheduler log lines in SGLang 0.5.23's format (``--decode-log-interval 1``), trimmed to the fields read.
from devkit import gate

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
    row = gate._effect_row("swa_thin", _boot("A1", resume=1.0), _boot("B", resume=1.0), _boot("A2", resume=1.0), True)
    assert row["status"].startswith("FAIL")


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
    from devkit.engine_kit import launcher
    from devkit.gate import kits, ways

    plugin = ways.Plugin(tmp_path / "venv" / "bin" / "python", tmp_path)
    server = kits.kit("mellum").server(tmp_path / "model", tmp_path / "b.log", {"DSV41_SWA_THIN": "1"}, [], plugin=plugin)
    assert server.python == str(plugin.python) and server.cwd == tmp_path
    assert server.env["PYTHONPATH"] == str(launcher.STUB_PATH) and server.env["SGLANG_PLUGINS"] == "dsv41"
    assert server.env["DSV41_SWA_THIN"] == "1"
    hook = kits.kit("mellum").server(tmp_path / "model", tmp_path / "a.log", {}, [])
    assert str(launcher.REPO_ROOT) in hook.env["PYTHONPATH"].split(":") and "SGLANG_PLUGINS" not in hook.env


def test_beside_hicache_the_thin_row_passes_when_the_profile_keeps_the_session_as_well_as_hicache_alone():
    def hicache(boot):
        boot.launch_extra = ("--enable-hierarchical-cache", "--hicache-ratio", "2")
        return boot

    both = [hicache(_boot(x, resume=1.0)) for x in ("A1", "B", "A2")]
    row = gate._effect_row("swa_thin", *both, True)
    assert row["status"] == "pass (HiCache alone also kept the session here)"
    lost = hicache(_boot("B", resume=0.0))
    assert gate._effect_row("swa_thin", both[0], lost, both[2], True)["status"].startswith("FAIL")
    kept = hicache(_boot("B", resume=1.0))
    assert gate._effect_row("swa_thin", hicache(_boot("A1", resume=0.0)), kept, hicache(_boot("A2", resume=0.0)),
                            True)["status"] == "pass"
    # without HiCache, equal to the controls is not enough
    assert gate._effect_row("swa_thin", _boot("A1"), _boot("B"), _boot("A2"), True)["status"].startswith("FAIL")
