"""The overlay as an SGLang plugin: pyproject's entry point, found and run by SGLang 0.5.23's own
``load_plugins`` (``sglang/srt/plugins/__init__.py``), with the strictness that ``load_plugins``'s
``except Exception`` would otherwise swallow, and one install per process when ``sitecustomize``
loads the overlay too.

The entry point is declared by a dist-info folder written from ``pyproject.toml`` (what pip writes
for the wheel; tests/engine/test_plugin_server.py installs the real wheel), put on ``sys.path`` so
``importlib.metadata.entry_points`` finds it as SGLang looks for it.
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing
import os
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
import wrapt

from adapter.core import boot, pins, plugin, registry

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = "sglang.srt.plugins"
# The modules each load_plugins call site has imported when it calls it (launcher, sglang serve,
# Engine.__init__, scheduler, detokenizer, DP controller; a spawned child also imports the launcher
# as __mp_main__): docs/plugin.md lists the call sites.
CALL_SITES = ("sglang.launch_server", "sglang.cli.serve", "sglang.srt.entrypoints.engine",
              "sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager",
              "sglang.srt.managers.data_parallel_controller")


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def plugin_dist(folder: Path) -> Path:
    """``folder`` holding a dist-info with pyproject's name, version and entry points."""
    project = _project()["project"]
    info = folder / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    groups = project["entry-points"]
    (info / "entry_points.txt").write_text(
        "\n".join(f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in groups[group].items())
                  for group in groups))
    return folder


@pytest.fixture
def load_plugins(tmp_path, monkeypatch):
    """SGLang's real ``load_plugins``, able to run again, finding only this overlay's entry point."""
    upstream = importlib.import_module(PLUGINS)
    monkeypatch.syspath_prepend(str(plugin_dist(tmp_path / "site")))
    monkeypatch.setattr(upstream, "_plugins_loaded", False)
    monkeypatch.setenv("SGLANG_PLUGINS", plugin.ENTRY_POINT)
    for key in [k for k in os.environ if k.startswith("DSV41_")]:
        monkeypatch.delenv(key)
    return upstream.load_plugins


def test_pyproject_declares_the_plugin_in_sglangs_group_and_sglang_loads_it_from_there(load_plugins):
    upstream = importlib.import_module(PLUGINS)
    project = _project()
    assert plugin.GROUP == upstream.GENERAL_PLUGINS_GROUP
    assert project["project"]["entry-points"] == {plugin.GROUP: {plugin.ENTRY_POINT: "adapter.core.plugin:load"}}
    assert upstream.load_plugins_by_group(plugin.GROUP) == {plugin.ENTRY_POINT: (plugin.load, project["project"]["name"])}


def test_the_wheels_build_backend_is_the_one_constraints_txt_pins():
    lock = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert _project()["build-system"]["requires"] == [f"setuptools=={lock['setuptools']}"]


def test_load_plugins_installs_the_switches_whose_modules_are_already_imported(load_plugins, monkeypatch, capsys):
    scheduler = importlib.import_module("sglang.srt.managers.scheduler")
    monkeypatch.setenv("DSV41_DECODE_YIELD", "50")
    load_plugins()
    assert boot.STATE is not None and boot.STATE.outcomes["decode_yield"].status == "installed"
    assert isinstance(vars(scheduler.Scheduler)["get_next_batch_to_run"], wrapt.FunctionWrapper)
    assert boot.STATE.rank_hook == "installed"
    assert capsys.readouterr().err.count("[dsv41] decode_yield installed ") == 1


def test_a_bad_value_stops_the_boot_through_load_plugins_with_the_overlays_message(load_plugins, monkeypatch):
    monkeypatch.setenv("DSV41_DECODE_YIELD", "150")
    with pytest.raises(SystemExit) as stopped:
        load_plugins()
    assert str(stopped.value.code).startswith("[dsv41] configuration error: DSV41_DECODE_YIELD='150' is not valid: "
                                              "expected an integer 1..99")


def test_in_a_child_process_such_as_a_scheduler_a_bad_value_is_exit_status_1(load_plugins, monkeypatch):
    """SGLang's schedulers, detokenizer and DP controller are ``multiprocessing`` children whose
    target calls ``load_plugins`` first; ``multiprocessing`` turns the plugin's ``SystemExit`` into the
    child's exit status, and the engine stops on the dead child. (A fork here, to skip a fresh
    interpreter: SGLang spawns, and both end in the same ``BaseProcess._bootstrap``.)"""
    monkeypatch.setenv("DSV41_DECODE_YIELD", "150")
    child = multiprocessing.get_context("fork").Process(target=load_plugins)
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 1


def test_a_refusal_under_strict_stops_the_boot_through_load_plugins(load_plugins, monkeypatch, capsys):
    importlib.import_module(registry.by_name("swa_native_decode").modules[0])  # imported before the plugin runs
    monkeypatch.setenv("DSV41_SWA_NATIVE_DECODE", "1")
    monkeypatch.setenv("DSV41_STRICT", "1")
    with pytest.raises(SystemExit) as stopped:
        load_plugins()
    # on this machine (no SM120 device) the switch is not applicable; any refusal must stop the boot
    assert str(stopped.value.code).startswith("[dsv41] swa_native_decode refused under DSV41_STRICT=1: ")
    assert "[dsv41] swa_native_decode refused: " in capsys.readouterr().err


def _install_fails(*args, **kwargs):
    raise ImportError("cannot import name 'SwaThinState' from 'adapter.switches.swa_thin'")


def test_under_strict_any_other_exception_of_the_boot_stops_it_instead_of_booting_stock(load_plugins, monkeypatch):
    """``load_plugins`` logs a plugin's ``Exception`` and carries on: an ``ImportError`` inside the
    overlay would boot stock; under ``DSV41_STRICT=1`` it is a ``SystemExit`` naming it."""
    monkeypatch.setattr(boot, "install", _install_fails)
    monkeypatch.setenv("DSV41_SWA_THIN", "1")
    monkeypatch.setenv("DSV41_STRICT", "1")
    with pytest.raises(SystemExit) as stopped:
        load_plugins()
    assert stopped.value.code == ("[dsv41] the plugin failed under DSV41_STRICT=1: ImportError: cannot import name "
                                  "'SwaThinState' from 'adapter.switches.swa_thin'")


def test_without_strict_another_exception_of_the_boot_is_logged_by_load_plugins_and_the_engine_goes_on(
        load_plugins, monkeypatch, caplog):
    monkeypatch.setattr(boot, "install", _install_fails)
    monkeypatch.setenv("DSV41_SWA_THIN", "1")
    load_plugins()  # returns: SGLang's own handling of a failing plugin
    assert "SwaThinState" in caplog.text


def test_without_strict_a_refusal_is_one_line_and_the_boot_goes_on(load_plugins, monkeypatch, capsys):
    importlib.import_module(registry.by_name("swa_native_decode").modules[0])
    monkeypatch.setenv("DSV41_SWA_NATIVE_DECODE", "1")
    load_plugins()
    assert boot.STATE.outcomes["swa_native_decode"].status in ("n/a", "refused")
    assert capsys.readouterr().err.count("[dsv41] swa_native_decode refused: ") == 1


def test_sglang_plugins_naming_other_plugins_leaves_the_overlay_out(load_plugins, monkeypatch):
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    monkeypatch.setenv("DSV41_DECODE_YIELD", "50")
    load_plugins()
    assert boot.STATE is None


def test_with_no_switch_set_the_plugin_installs_nothing(load_plugins):
    load_plugins()
    assert boot.STATE is None and not any(isinstance(f, boot.SwitchFinder) for f in sys.meta_path)


def test_drift_of_load_plugins_is_a_warning_and_a_boot_failure_under_strict(load_plugins, monkeypatch, records):
    monkeypatch.setitem(pins.PINS, plugin.PINNED[0], "0" * 64)
    monkeypatch.setenv("DSV41_DECODE_YIELD", "50")
    load_plugins()
    assert any("plugin: a bad value may not stop the boot: sglang.srt.plugins:load_plugins drifted from the pin"
               in r.getMessage() for r in records)
    boot.uninstall()
    monkeypatch.setattr(importlib.import_module(PLUGINS), "_plugins_loaded", False)
    monkeypatch.setenv("DSV41_STRICT", "1")
    with pytest.raises(SystemExit, match=r"load_plugins drifted from the pin.*\(DSV41_STRICT=1\)"):
        load_plugins()


def test_no_module_imported_before_load_plugins_holds_a_copy_of_a_wrapped_function():
    """The plugin wraps after these modules ran: a ``from X import f`` (or any other reference) taken
    at their import would keep calling the stock ``f``. None exists in SGLang 0.5.23; the wrapped
    objects are referred to only by their owner (module or class dict)."""
    for name in CALL_SITES:
        importlib.import_module(name)
    targets = sorted({t for s in registry.SWITCHES for t in s.wraps} | {registry.RANK_HOOK})
    # A copy that is itself a wrapped target (kv_park wraps ``dsv4_needs_rebootstrap`` both in
    # ``mem_cache.common`` and where ``disaggregation.decode`` imported it) sees the wrapper too.
    wrapped_namespaces = [vars(sys.modules[t.partition(":")[0]]) for t in targets
                          if t.partition(":")[0] in sys.modules and "." not in t.partition(":")[2]]
    checked, copies = 0, []
    for target in targets:
        module_name, _, qualname = target.partition(":")
        if module_name not in sys.modules:
            continue  # imported after the plugin runs: the import hook installs it, copies see the wrapper
        owner_name, _, attr = qualname.rpartition(".")
        owner = pins.object_at(f"{module_name}:{owner_name}") if owner_name else sys.modules[module_name]
        obj = vars(owner)[attr]
        assert not isinstance(obj, wrapt.FunctionWrapper), f"{target} is wrapped: no switch may be installed here"
        namespace = vars(owner)  # a module's dict, or a class's mappingproxy of its dict
        if isinstance(namespace, types.MappingProxyType):
            (namespace,) = gc.get_referents(namespace)
        for ref in gc.get_referrers(obj):
            if isinstance(ref, types.FrameType) or ref is namespace:
                continue
            if isinstance(ref, dict) and ref.get(attr) is obj and [ns for ns in wrapped_namespaces if ns is ref]:
                continue  # another module's binding of this function, wrapped as its own target
            copies.append(f"{target}: {type(ref).__name__} {str(ref)[:120]}")
        checked += 1
    assert copies == []
    assert checked >= len(targets) - 3  # all but the GPU-only and model-runner modules are imported there


def _run(code: str, pythonpath: list[Path], **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    environ.update(PYTHONPATH=os.pathsep.join(map(str, pythonpath)), OMP_NUM_THREADS="1", SGLANG_PLUGINS="dsv41",
                   **env)
    return subprocess.run([sys.executable, "-c", code], env=environ, cwd=pythonpath[0], capture_output=True,
                          text=True, timeout=600)


LOAD = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
import sglang.srt.managers.scheduler
from sglang.srt.plugins import load_plugins
load_plugins()
from adapter.core import boot
print({n: o.status for n, o in boot.STATE.outcomes.items()})
"""


@pytest.mark.spawns
def test_a_process_that_loads_both_ways_installs_each_switch_once(tmp_path):
    """sitecustomize (the repo on PYTHONPATH) installs the hook at start; SGLang then runs the plugin."""
    site = plugin_dist(tmp_path / "site")
    # Receipts are deduplicated per process, so count the hooks and the wrapper layers too.
    code = LOAD + (
        "import wrapt\n"
        "from sglang.srt.managers.scheduler import Scheduler\n"
        "wrapper = vars(Scheduler)['get_next_batch_to_run']\n"
        "print(sum(isinstance(f, boot.SwitchFinder) for f in sys.meta_path), type(wrapper).__name__,\n"
        "      isinstance(wrapper.__wrapped__, wrapt.FunctionWrapper))\n")
    out = _run(code, [site, ROOT], DSV41_SWA_THIN="1", DSV41_DECODE_YIELD="50")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sglang.srt.plugins Executed general plugin: dsv41" in out.stderr
    for switch in ("decode_yield", "fast_tree_core", "swa_thin"):
        assert out.stderr.count(f"[dsv41] {switch} installed ") == 1, out.stderr[-3000:]
    outcomes, hooks = out.stdout.strip().splitlines()[-2:]
    assert outcomes == str({"decode_yield": "installed", "fast_tree_core": "installed", "swa_thin": "installed"})
    assert hooks == "1 FunctionWrapper False"  # one finder; decode yield's wrapper around the stock method


@pytest.mark.spawns
def test_the_plugin_alone_installs_imported_modules_at_once_and_later_ones_on_import(tmp_path):
    """No sitecustomize (the repo reaches sys.path after start): the plugin installs the scheduler's
    switches at once and cone replay, whose model runner loads later, when it is imported."""
    site = plugin_dist(tmp_path / "site")
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + LOAD + (
        "import sglang.srt.model_executor.model_runner\n"
        "print({n: o.status for n, o in boot.STATE.outcomes.items()})\n")
    out = _run(code, [site], DSV41_DECODE_YIELD="50", DSV41_SWA_CONE_REPLAY="1")
    assert out.returncode == 0, out.stderr[-3000:]
    at_load, after_import = out.stdout.strip().splitlines()[-2:]
    assert at_load == str({"decode_yield": "installed", "cone_replay": "pending"})
    assert after_import == str({"decode_yield": "installed", "cone_replay": "armed"})
    assert out.stderr.count("[dsv41] decode_yield installed ") == 1
    assert out.stderr.count("[dsv41] cone_replay armed ") == 1
