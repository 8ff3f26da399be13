"""Found by the gate: a switch whose target module is still executing (it imported another
target) must wait until that module's body has run, or its pins read missing classes."""

import sys

from adapter.core import boot, registry

INSTALLED: list[str] = []


def install(ctx):
    import dsv41_gate_outer

    INSTALLED.append(dsv41_gate_outer.Ready.__name__)  # AttributeError if installed mid-import
    return {}


def test_a_switch_waits_while_one_of_its_target_modules_is_still_executing(tmp_path, monkeypatch):
    # outer imports inner before it defines Ready: inner finishing must not install the switch.
    (tmp_path / "dsv41_gate_inner.py").write_text("VALUE = 1\n")
    (tmp_path / "dsv41_gate_outer.py").write_text("import dsv41_gate_inner\n\n\nclass Ready:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    switch = registry.Switch(name="partial_import_probe", on_key=registry.STRICT, summary="probe", predict=None,
                             no_predictor="a probe of the boot: check never sees it",
                             modules=("dsv41_gate_outer", "dsv41_gate_inner"), wraps=(),
                             install=f"{__name__}:install", volatile=True,
                             gate_role=registry.GateRole(not_applicable="a probe"))
    state = boot.State(registry.Config(requested=[switch]))
    state.outcomes[switch.name] = boot.Outcome(switch.name)
    # This probe's own state, not the boot's: were SGLang's scheduler module imported by an earlier
    # test, the finder would wrap the rank hook into it, out of reach of boot.uninstall.
    state.rank_hook = "off: not this probe's concern"
    finder = boot.SwitchFinder(state, set(switch.modules))
    sys.meta_path.insert(0, finder)
    INSTALLED.clear()
    try:
        import dsv41_gate_outer  # noqa: F401
    finally:
        sys.meta_path.remove(finder)
        for name in switch.modules:
            sys.modules.pop(name, None)
    assert state.outcomes[switch.name].status == "installed", state.outcomes[switch.name].reason
    assert INSTALLED == ["Ready"]
