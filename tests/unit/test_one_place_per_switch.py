"""A switch lives in one place: its registry record, its module, its docs page and its tests.

Everything else that knows switches by name is one map keyed by switch name, or one field of the
record, and a test here names the switch any of them is missing (or has an entry for a switch the
registry does not have): check's predictor (``Switch.predict``), the gate's rows
(``devkit.gate.verdict.ROWS``), the metrics table (``adapter.core.metrics``), the independence
contract (``pyproject.toml``) and README's switch table.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

from adapter.core import metrics, registry

ROOT = Path(__file__).resolve().parents[2]
NAMES = [s.name for s in registry.SWITCHES]


def _package(switch: registry.Switch) -> str:
    """``adapter.switches.<segment>``: the switch's module or package."""
    return ".".join(switch.install.partition(":")[0].split(".")[:3])


@pytest.mark.parametrize("switch", registry.SWITCHES, ids=NAMES)
def test_a_switch_predictor_is_a_function_of_its_own_package_or_the_record_says_why_it_needs_none(switch):
    if switch.predict is None:
        assert switch.no_predictor, f"{switch.name}: no check predictor and no reason why none is needed"
        return
    module, _, function = switch.predict.partition(":")
    assert module == _package(switch) or module.startswith(_package(switch) + "."), (
        f"{switch.name}: predict={switch.predict} lies outside {_package(switch)}")
    assert callable(getattr(importlib.import_module(module), function, None)), f"{switch.name}: {switch.predict} is not a function"


def _sources(switch: registry.Switch) -> str:
    """The text of the switch's module, or of every module of its package."""
    spec = importlib.util.find_spec(_package(switch))
    origin = Path(spec.origin)
    files = sorted(origin.parent.rglob("*.py")) if origin.name == "__init__.py" else [origin]
    return "\n".join(f.read_text() for f in files)


@pytest.mark.parametrize("switch", registry.SWITCHES, ids=NAMES)
def test_a_switch_that_can_refuse_after_install_has_a_predictor(switch):
    """A late refusal (at cache build, on the first pass) is what a boot logs instead of the install
    outcome, so ``check`` must predict it, or say it cannot yet (``not decided``)."""
    if "refuse_late(" in _sources(switch):
        assert switch.predict, f"{switch.name} refuses after install ({_package(switch)}) but check has no predictor"


def test_a_record_without_a_predictor_or_a_reason_for_none_is_refused():
    record = registry.SWITCHES[0]
    with pytest.raises(ValueError, match="a switch has a predictor or says why it needs none"):
        dataclasses.replace(record, predict=None, no_predictor="")
    with pytest.raises(ValueError, match="not both"):
        dataclasses.replace(record, predict="adapter.switches.x:predict", no_predictor="because")


def test_every_switch_the_gate_shows_acting_has_exactly_one_row_and_no_other_switch_has_one():
    from devkit.gate import verdict

    acting = {s.name for s in registry.SWITCHES if s.gate_role.acts}
    assert set(verdict.ROWS) - acting == set(), "gate rows for switches the registry does not say act here"
    assert acting - set(verdict.ROWS) == set(), "switches the registry says act in the gate, without a gate row"


def test_every_switch_has_metrics_or_says_why_not_and_metrics_name_only_registry_switches():
    with_metrics = {m.switch for m in metrics.METRICS}
    assert with_metrics - set(NAMES) == set(), "metrics of switches the registry does not have"
    assert set(metrics.WITHOUT_METRICS) - set(NAMES) == set(), "WITHOUT_METRICS names switches the registry does not have"
    assert set(NAMES) - with_metrics - set(metrics.WITHOUT_METRICS) == set(), "switches with no metrics and no reason"
    assert with_metrics & set(metrics.WITHOUT_METRICS) == set(), "switches both with metrics and in WITHOUT_METRICS"


def test_the_independence_contract_lists_every_switch_module_and_nothing_else():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    [contract] = [c for c in config["tool"]["importlinter"]["contracts"]
                  if c["type"] == "independence" and c["name"].startswith("switches are independent")]
    assert sorted(contract["modules"]) == sorted({_package(s) for s in registry.SWITCHES})


def _readme_switch_rows() -> dict[str, str]:
    """README's switch table: switch name -> its row."""
    text = (ROOT / "README.md").read_text()
    rows = {}
    for line in text.splitlines():
        found = re.match(r"\| [^|]* \| \[`(\w+)`\]\(docs/switches/[\w.]+\) \|", line)
        if found:
            rows[found.group(1)] = line
    return rows


def test_readme_switch_table_has_one_row_per_registry_switch_with_its_key_and_an_existing_doc_page():
    rows = _readme_switch_rows()
    assert sorted(rows) == sorted(NAMES), "README's switch table and the registry name different switches"
    for switch in registry.SWITCHES:
        row = rows[switch.name]
        assert f"`{switch.on_key.name}" in row, f"README's {switch.name} row does not name {switch.on_key.name}"
        page = re.search(r"\(docs/switches/([\w.]+)\)", row).group(1)
        assert (ROOT / "docs" / "switches" / page).is_file(), f"{switch.name}: docs/switches/{page} is missing"


@pytest.mark.parametrize("switch", registry.SWITCHES, ids=NAMES)
def test_every_switch_has_a_test_file_that_names_it(switch):
    named = [p for p in (ROOT / "tests").rglob("test_*.py")
             if p.name != Path(__file__).name and (switch.name in p.read_text() or switch.on_key.name in p.read_text())]
    assert named, f"{switch.name}: no test file under tests/ names the switch or {switch.on_key.name}"
