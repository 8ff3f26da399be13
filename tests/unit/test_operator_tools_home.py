"""The operator tools' home (``overlay_tools``): shipped in the wheel beside ``adapter``, out of the
serving path, found by the CLI there (``simulate``), and the one copy of what the checkout's test kit
shares with it."""

from __future__ import annotations

import inspect
import sys
import tomllib
import types
from pathlib import Path

import pytest

import overlay_tools.simulate.cache_kit  # noqa: F401  (loaded before a test stands a stub in for overlay_tools.simulate)
from adapter.ops import cli

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_packages_overlay_tools_beside_adapter_and_the_tools_extra_exists():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == [
        "adapter", "adapter.*", "overlay_tools", "overlay_tools.*"]
    assert project["project"]["optional-dependencies"]["tools"] == []  # nothing beyond the serving image
    assert "overlay_tools" in (ROOT / "tools/image/build_wheel.sh").read_text().split("-cf - ")[1].split("|")[0]
    contracts = {c["name"]: c for c in project["tool"]["importlinter"]["contracts"]}
    assert contracts["serving code never imports the operator tools"]["forbidden_modules"] == ["overlay_tools"]


def _tool(name: str, said: list[str]) -> types.ModuleType:
    module = types.ModuleType(name)
    module.add_arguments = lambda parser: parser.add_argument("trace")
    module.main = lambda args: said.append(f"{name} {args.trace}") or 0
    return module


def test_simulate_lives_in_overlay_tools_and_the_cli_has_no_devkit_twin_to_fall_back_on(monkeypatch):
    assert (ROOT / "overlay_tools/simulate/__init__.py").is_file() and not (ROOT / "devkit/simulate").exists()
    said: list[str] = []
    monkeypatch.setitem(sys.modules, "overlay_tools.simulate", _tool("overlay_tools.simulate", said))
    assert cli.main(["simulate", "t.jsonl"]) == 0
    assert said == ["overlay_tools.simulate t.jsonl"]


# The checkout's kits that use simulate's cache kit, turn steps, pool formula or host route.
KIT_MODULES = ("devkit.testkit.radix_cache", "devkit.testkit.cone", "devkit.testkit.swa_thin",
               "devkit.testkit.cone_replay_parts", "devkit.testkit.simulate_fleet", "devkit.engine_kit.agreement")


def _borrowed(module: types.ModuleType) -> list[str]:
    """``module``'s top-level names bound to a function or class of ``overlay_tools``."""
    return sorted(name for name, value in vars(module).items()
                  if (inspect.isfunction(value) or inspect.isclass(value))
                  and getattr(value, "__module__", "").startswith("overlay_tools."))


def test_the_checkouts_kits_bind_no_simulate_function_or_class_under_a_second_name():
    """One name per object: tests and benches import simulate's cache kit, turn steps, SWA pool formula and
    host route from ``overlay_tools`` itself; the checkout's kits and the ``sgl_kernel`` stand-in's routes
    use them through the module and never bind one of their functions or classes as their own name."""
    import importlib

    from devkit.engine_kit.launcher import load_stub_module

    modules = [importlib.import_module(name) for name in KIT_MODULES] + [load_stub_module("_route")]
    assert {m.__name__: _borrowed(m) for m in modules} == {m.__name__: [] for m in modules}


def test_the_engine_kits_host_route_and_kvcacheio_are_simulates_own_not_copies():
    """One copy of HiCache's CPU host route and its pure-torch copies, in the wheel: the ``sgl_kernel``
    stand-in (loaded by path, as the in-process kits load it) pins simulate's pins and binds its ops
    under their kernel names (``kvcacheio`` is the module SGLang imports by name)."""
    from devkit.engine_kit.launcher import load_stub_module
    from overlay_tools.simulate import host_copies, host_route

    route, kvcacheio = load_stub_module("_route"), load_stub_module("kvcacheio")
    assert {t: route.PINS[t] for t in host_route.PINS} == host_route.PINS
    assert host_route.HOST_MEMORY in route.ROUTES and set(host_route.HOST_POOL_OPS) <= set(route.ROUTES)
    assert host_copies.__all__ and all(getattr(kvcacheio, n) is getattr(host_copies, n) for n in host_copies.__all__)
    with pytest.raises(NotImplementedError, match="transfer_kv_per_layer_ph_lf"):
        kvcacheio.transfer_kv_per_layer_ph_lf()


def test_with_neither_installed_the_command_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "overlay_tools.simulate", None)
    assert cli.main(["simulate"]) == 2
    assert capsys.readouterr().err == ("simulate: devkit is not installed here (the serving image carries only "
                                       "the overlay); run it from a checkout\n")


def test_a_tool_whose_own_import_is_missing_fails_loudly_instead_of_saying_it_is_not_installed(monkeypatch):
    def failing_import(name: str, *args, **kwargs):
        if name == "overlay_tools.simulate":
            raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
        return real_import(name, *args, **kwargs)

    real_import = cli.importlib.import_module
    monkeypatch.setattr(cli.importlib, "import_module", failing_import)
    with pytest.raises(ModuleNotFoundError, match="matplotlib"):
        cli.main(["simulate", "t.jsonl"])
