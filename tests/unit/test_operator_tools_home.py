"""The operator tools' home (``overlay_tools``): shipped in the wheel beside ``adapter``, out of the
serving path, and found by the CLI wherever a tool lives today (``overlay_tools`` first, then the
checkout's ``devkit``)."""

from __future__ import annotations

import sys
import tomllib
import types
from pathlib import Path

import pytest

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


def test_a_tool_in_overlay_tools_is_run_before_its_devkit_twin(monkeypatch):
    said: list[str] = []
    monkeypatch.setitem(sys.modules, "overlay_tools.simulate", _tool("overlay_tools.simulate", said))
    monkeypatch.setitem(sys.modules, "devkit.simulate", _tool("devkit.simulate", said))
    assert cli.main(["simulate", "t.jsonl"]) == 0
    assert said == ["overlay_tools.simulate t.jsonl"]


def test_without_overlay_tools_simulate_the_devkit_module_runs(monkeypatch):
    said: list[str] = []
    monkeypatch.setitem(sys.modules, "overlay_tools.simulate", None)  # import raises ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "devkit.simulate", _tool("devkit.simulate", said))
    assert cli.main(["simulate", "t.jsonl"]) == 0
    assert said == ["devkit.simulate t.jsonl"]


def test_with_neither_installed_the_command_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "overlay_tools.simulate", None)
    monkeypatch.setitem(sys.modules, "devkit.simulate", None)
    assert cli.main(["simulate"]) == 2
    assert capsys.readouterr().err == ("simulate: devkit is not installed here (the serving image carries only "
                                       "the overlay); run it from a checkout\n")


def test_a_tool_whose_own_import_is_missing_fails_loudly_instead_of_falling_back(monkeypatch):
    monkeypatch.setitem(sys.modules, "devkit.simulate", _tool("devkit.simulate", []))

    def failing_import(name: str, *args, **kwargs):
        if name == "overlay_tools.simulate":
            raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
        return real_import(name, *args, **kwargs)

    real_import = cli.importlib.import_module
    monkeypatch.setattr(cli.importlib, "import_module", failing_import)
    with pytest.raises(ModuleNotFoundError, match="matplotlib"):
        cli.main(["simulate", "t.jsonl"])
