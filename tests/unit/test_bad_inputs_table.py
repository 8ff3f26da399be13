"""docs/reliability.md's table of bad inputs is what those inputs get today: every row is run
again for real (the CLI in this process, the kit's validators directly) and compared."""

from devkit.soak import bad_inputs


def test_every_bad_input_in_the_reliability_table_still_gets_the_answer_the_table_shows():
    assert bad_inputs.table(bad_inputs.run_all()) == bad_inputs.documented(), (
        "docs/reliability.md is stale: run python -m devkit.soak.bad_inputs --write and read the diff")


def test_each_bad_input_is_refused_except_the_ones_the_page_names_as_findings():
    """Every case exits non-zero except the one the page keeps as a finding (a lone key typo is a
    warning)."""
    passing = [c.what for c, rc, _ in bad_inputs.run_all() if rc == 0]
    assert passing == ["DSV41_SWA_TIHN=1 (a typo of a switch key, alone)"]
