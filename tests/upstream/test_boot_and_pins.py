"""The import hook, pins and refusals, on the real SGLang modules."""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from adapter.core import boot, patching, pins, receipts, registry

AUTOTUNE = "sglang.srt.model_executor.runner.flashinfer_autotune"
DIGEST = f"{AUTOTUNE}:_autotune_cache_digest"


@pytest.fixture(scope="module")
def autotune_module():
    return importlib.import_module(AUTOTUNE)


def test_every_pin_matches_the_installed_sglang():
    drift = [c.describe() for c in (pins.check(t) for t in pins.PINS) if not c.ok]
    assert drift == []


def test_every_wrapped_or_relied_on_function_is_pinned_and_every_pin_is_used():
    pinned = {t for s in registry.SWITCHES for t in s.pinned} | set(registry.BOOT_PINNED)
    assert pinned == set(pins.PINS)


def test_installed_upstream_versions_are_the_pinned_ones():
    from importlib.metadata import version

    assert {name: version(name) for name in pins.UPSTREAM} == pins.UPSTREAM


def test_a_switch_installs_when_its_module_was_imported_before_the_finder(autotune_module, capfd):
    original = autotune_module._autotune_cache_digest
    state = boot.install({"DSV41_AUTOTUNE_KEEP": "1"})
    assert state.outcomes["autotune_keep"].status == "installed"
    assert autotune_module._autotune_cache_digest is not original
    assert getattr(autotune_module._autotune_cache_digest, "__wrapped__", None) is original
    assert "[dsv41] autotune_keep installed fingerprint=" in capfd.readouterr().err


def test_a_switch_installs_when_its_module_is_imported_after_the_finder(autotune_module, monkeypatch):
    monkeypatch.delitem(sys.modules, AUTOTUNE)
    state = boot.install({"DSV41_AUTOTUNE_KEEP": "1"})
    assert state.outcomes["autotune_keep"].status == "pending"
    fresh = importlib.import_module(AUTOTUNE)
    assert fresh is not autotune_module
    assert state.outcomes["autotune_keep"].status == "installed"
    assert hasattr(fresh._autotune_cache_digest, "__wrapped__")
    finders = [f for f in sys.meta_path if isinstance(f, boot.SwitchFinder)]
    assert len(finders) == 1


def test_the_finder_claims_only_target_modules():
    state = boot.install({"DSV41_AUTOTUNE_KEEP": "1"})
    finder = next(f for f in sys.meta_path if isinstance(f, boot.SwitchFinder))
    assert finder.find_spec("json.decoder", None) is None
    assert finder.targets == {AUTOTUNE, registry.RANK_MODULE}  # the switch's module and the rank hook's
    assert state.outcomes["autotune_keep"].status == "installed"


def _modified_copy(module: types.ModuleType) -> object:
    namespace: dict[str, object] = {}
    exec("def _autotune_cache_digest(cache_path, env):\n    return 'changed upstream'\n", namespace)
    return namespace["_autotune_cache_digest"]


def test_a_drifted_function_makes_the_switch_refuse_and_stays_in_place(autotune_module, monkeypatch, capfd):
    drifted = _modified_copy(autotune_module)
    monkeypatch.setattr(autotune_module, "_autotune_cache_digest", drifted)
    context_before = autotune_module.flashinfer_autotune_context
    state = boot.install({"DSV41_AUTOTUNE_KEEP": "1"})
    outcome = state.outcomes["autotune_keep"]
    assert outcome.status == "refused"
    assert f"{DIGEST} drifted from the pin: expected {pins.PINS[DIGEST][:16]}" in outcome.reason
    assert autotune_module._autotune_cache_digest is drifted
    assert autotune_module.flashinfer_autotune_context is context_before  # nothing half-installed
    line = capfd.readouterr().err.strip().splitlines()[-1]
    parsed = receipts.parse_line(line)
    assert (parsed.switch, parsed.event) == ("autotune_keep", "refused")
    assert "drifted from the pin" in parsed.reason


def test_strict_turns_a_refusal_into_a_boot_failure(autotune_module, monkeypatch):
    monkeypatch.setattr(autotune_module, "_autotune_cache_digest", _modified_copy(autotune_module))
    with pytest.raises(boot.BootError, match="autotune_keep refused under DSV41_STRICT=1"):
        boot.install({"DSV41_AUTOTUNE_KEEP": "1", "DSV41_STRICT": "1"})


def test_an_install_that_fails_midway_reverts_what_it_wrapped(autotune_module, monkeypatch):
    originals = (autotune_module._autotune_cache_digest, autotune_module.flashinfer_autotune_context)

    def failing_install(ctx):
        ctx.wrap(DIGEST, lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
        raise boot.Refusal("cannot act here")

    monkeypatch.setattr(sys.modules["adapter.switches.autotune_keep"], "install", failing_install)
    state = boot.install({"DSV41_AUTOTUNE_KEEP": "1"})
    assert state.outcomes["autotune_keep"].status == "refused"
    assert state.outcomes["autotune_keep"].reason == "cannot act here"
    assert (autotune_module._autotune_cache_digest, autotune_module.flashinfer_autotune_context) == originals


_ORDER: list[str] = []


def _install_first(ctx):
    ctx.wrap(DIGEST, lambda wrapped, instance, args, kwargs: ["first", *wrapped(*args, **kwargs)])
    return {"order": "1"}


def _install_second(ctx):
    ctx.wrap(DIGEST, lambda wrapped, instance, args, kwargs: ["second", *wrapped(*args, **kwargs)])
    return {"order": "2"}


def test_two_switches_on_one_function_pin_its_original_and_install_in_registry_order(
    autotune_module, monkeypatch
):
    base = registry.by_name("autotune_keep")
    first = dataclasses.replace(
        base, name="first_wrapper", on_key=dataclasses.replace(base.on_key, name="DSV41_TEST_FIRST"),
        wraps=(DIGEST,), install=f"{__name__}:_install_first",
    )
    second = dataclasses.replace(
        base, name="second_wrapper", on_key=dataclasses.replace(base.on_key, name="DSV41_TEST_SECOND"),
        wraps=(DIGEST,), install=f"{__name__}:_install_second",
    )
    monkeypatch.setattr(registry, "SWITCHES", (first, second))
    monkeypatch.setattr(autotune_module, "_autotune_cache_digest", lambda cache_path, env: ["stock"])
    monkeypatch.setitem(pins.PINS, DIGEST, pins.source_hash(autotune_module._autotune_cache_digest))
    state = boot.install({"DSV41_TEST_SECOND": "1", "DSV41_TEST_FIRST": "1"})
    assert [state.outcomes[n].status for n in ("first_wrapper", "second_wrapper")] == ["installed"] * 2
    assert all(c.ok for n in ("first_wrapper", "second_wrapper") for c in state.outcomes[n].pins)
    # Registry order: the second switch wraps the first one's wrapper, so it runs outermost.
    assert autotune_module._autotune_cache_digest("p", {}) == ["second", "first", "stock"]
    boot.uninstall()
    assert autotune_module._autotune_cache_digest("p", {}) == ["stock"]


def test_a_receipt_is_logged_once_per_switch_per_process(capfd):
    receipts.installed("some_switch", share=33)
    receipts.installed("some_switch", share=33)
    receipts.refused("other_switch", "no\nsecond line")
    receipts.refused("other_switch", "again")
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("[dsv41] some_switch installed share=33 rank=pid")
    assert lines[1].startswith("[dsv41] other_switch refused: no second line rank=pid")


def test_receipt_lines_parse_back_to_switch_event_params_and_rank():
    r = receipts.parse_line("2026-11-29 INFO [dsv41] decode_yield installed share=33 source=default rank=tp0")
    assert (r.switch, r.event, r.rank, r.params) == ("decode_yield", "installed", "tp0", {"share": "33", "source": "default"})
    r = receipts.parse_line("[dsv41] swa_thin refused: tree core is rust (set by the operator) rank=tp3pp1")
    assert (r.switch, r.event, r.rank, r.reason) == ("swa_thin", "refused", "tp3pp1", "tree core is rust (set by the operator)")
    r = receipts.parse_line("[dsv41] autotune_keep tuned and saved cache=x.json rank=pid12")
    assert (r.event, r.params) == ("tuned and saved", {"cache": "x.json"})
    assert receipts.parse_line("[dsv41] configuration error: bad") is None
    assert receipts.parse_line("INFO scheduler started") is None


def test_the_rank_comes_from_the_engine_once_it_has_published_one(monkeypatch):
    from sglang.srt import runtime_context

    with runtime_context.get_parallel().override(tp_rank=0, pp_rank=0, dp_rank=0):
        assert receipts.current_rank() == "tp0"
    monkeypatch.setattr(receipts, "_engine_ranks", lambda: (2, 1, 0))
    assert receipts.current_rank() == "tp2pp1"
    monkeypatch.undo()
    monkeypatch.delitem(sys.modules, "sglang.srt.runtime_context")  # an engine that published nothing
    assert receipts.current_rank() == f"pid{os.getpid()}"


def test_patch_revert_restores_plain_attributes_and_wrapped_functions(autotune_module):
    before = autotune_module._autotune_cache_digest
    patch = patching.Patch("t")
    patch.wrap(DIGEST, lambda wrapped, instance, args, kwargs: "wrapped")
    patch.set_attr(autotune_module, "DSV41_MARKER", 1)
    assert autotune_module._autotune_cache_digest("p", {}) == "wrapped"
    patch.revert()
    assert autotune_module._autotune_cache_digest is before
    assert not hasattr(autotune_module, "DSV41_MARKER")


def test_a_switch_that_cannot_act_on_this_machine_is_refused_as_not_applicable(autotune_module, monkeypatch, capfd):
    def no_device(ctx):
        raise boot.NotApplicable("no CUDA device")

    monkeypatch.setattr(sys.modules["adapter.switches.autotune_keep"], "install", no_device)
    state = boot.install({"DSV41_AUTOTUNE_KEEP": "1"})
    outcome = state.outcomes["autotune_keep"]
    assert (outcome.status, outcome.reason) == ("n/a", "not applicable here: no CUDA device")
    assert "[dsv41] autotune_keep refused: not applicable here: no CUDA device rank=" in capfd.readouterr().err


_SEEN_AT_INSTALL: list[bool] = []


def _install_needing_the_scheduler_class(ctx):
    _SEEN_AT_INSTALL.append(hasattr(sys.modules["sglang.srt.managers.scheduler"], "Scheduler"))
    return {}


def test_a_switch_waits_until_every_target_module_has_finished_executing(monkeypatch):
    """scheduler.py imports schedule_policy mid-body: that moment must not count as 'both imported'."""
    importlib.import_module("sglang.srt.managers.scheduler")
    base = registry.by_name("autotune_keep")
    waiting = dataclasses.replace(
        base, name="waits_for_both", on_key=dataclasses.replace(base.on_key, name="DSV41_TEST_WAITS"), wraps=(),
        modules=("sglang.srt.managers.schedule_policy", "sglang.srt.managers.scheduler"),
        install=f"{__name__}:_install_needing_the_scheduler_class",
    )
    monkeypatch.setattr(registry, "SWITCHES", (waiting,))
    for name in waiting.modules:
        parent, _, child = name.rpartition(".")
        # the re-import below rebinds the package attribute too: restore it with sys.modules, or a
        # later ``import a.b.c as m`` gets the re-imported module while the boot patches the original
        monkeypatch.setattr(sys.modules[parent], child, sys.modules[name])
        monkeypatch.delitem(sys.modules, name)
    _SEEN_AT_INSTALL.clear()
    state = boot.install({"DSV41_TEST_WAITS": "1"})
    assert state.outcomes["waits_for_both"].status == "pending"
    importlib.import_module("sglang.srt.managers.scheduler")
    assert state.outcomes["waits_for_both"].status == "installed"
    assert _SEEN_AT_INSTALL == [True]


def test_a_switch_cannot_wrap_a_target_its_record_only_relies_on_or_does_not_list(autotune_module, monkeypatch):
    relied = "sglang.srt.managers.scheduler:Scheduler._arm_prefill_decode_interval"
    assert relied in registry.by_name("decode_yield").relies_on

    def overreaching_install(ctx):
        ctx.wrap(DIGEST, lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
        ctx.wrap(relied, lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))

    original = autotune_module._autotune_cache_digest
    monkeypatch.setattr(sys.modules["adapter.switches.autotune_keep"], "install", overreaching_install)
    state = boot.install({"DSV41_AUTOTUNE_KEEP": "1"})
    outcome = state.outcomes["autotune_keep"]
    assert outcome.status == "refused"
    assert "Scheduler._arm_prefill_decode_interval" in outcome.reason and "not" in outcome.reason
    assert autotune_module._autotune_cache_digest is original  # reverted: nothing half-installed


def test_the_patch_refuses_a_target_outside_the_switchs_wraps():
    from adapter.core import patching

    patch = patching.Patch("autotune_keep", allowed=registry.by_name("autotune_keep").wraps)
    with pytest.raises(patching.UndeclaredTarget, match="not in the record's wraps"):
        patch.wrap(registry.by_name("swa_thin").wraps[0], lambda *a: None)


@pytest.mark.parametrize(("raw", "debug"), [("1", True), ("true", True), ("ON", True), ("yes", True),
                                             ("0", False), ("off", False), ("maybe", False)])
def test_debug_log_is_read_with_its_flag_parser_so_every_true_spelling_turns_debug_on(raw, debug):
    assert receipts.debug_log_enabled({"DSV41_DEBUG_LOG": raw}) is debug
    assert receipts.debug_log_enabled({}) is False


@pytest.mark.spawns
def test_a_debug_line_is_logged_when_debug_log_is_spelled_true(tmp_path):
    script = "from adapter.core import receipts\nreceipts.event('decode_yield', 'window', level=10, n=3)\n"
    root = str(Path(boot.__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    for raw, shown in (("true", True), ("0", False)):
        out = subprocess.run([sys.executable, "-c", script], env={**env, "DSV41_DEBUG_LOG": raw}, cwd=root,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert ("[dsv41] decode_yield window n=3" in out.stderr) is shown
