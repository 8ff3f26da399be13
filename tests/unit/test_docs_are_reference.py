"""The operator docs read as reference, not as a run log: README.md, docs/switches/*.md and
docs/benchmarks.md hold no clock time, load average or "this stop"; every row of a switch page's
"Measured" table names the command that measured it; every CHANGELOG bullet is at most three lines;
every relative link between the docs points at a file (and heading) that exists. Plain text reads
only: no SGLang import."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = [ROOT / "README.md", ROOT / "docs" / "benchmarks.md", *sorted((ROOT / "docs" / "switches").glob("*.md"))]

CLOCK = re.compile(r"(?<![\w.:/-])(?:[01]?\d|2[0-3]):[0-5]\d(?![\d:])")
LOAD = re.compile(r"\bload (?:average|avg)\b|\bload \d+(?:\.\d+|-\d+)", re.IGNORECASE)
RUN_LOG = re.compile(r"\bthis (?:stop|session)\b", re.IGNORECASE)
COMMAND = re.compile(r"`(?:\.venv/bin/)?(?:python -m (?:adapter|pytest|devkit)|pytest|bash (?:tools|runtime)/)[^`]*`")
MEASURED_HEADER = "| figure | kit or machine | command |"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _run_log_text(text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern in (CLOCK, LOAD, RUN_LOG):
            hit = pattern.search(line)
            if hit:
                found.append(f"{number}: {hit.group(0)!r} in {line.strip()[:90]}")
    return found


def _measured_rows(text: str) -> tuple[list[str], list[str]]:
    """The header line(s) and data rows of every table under a '## Measured' heading."""
    headers, rows, inside, table = [], [], False, []
    for line in [*text.splitlines(), "## end"]:
        if inside and line.startswith("|"):
            table.append(line)
            continue
        if table:
            headers.append(table[0].strip())
            rows.extend(table[2:])
            table = []
        if line.startswith("## "):
            inside = line.strip() == "## Measured"
    return headers, rows


def _command_cell(row: str) -> str:
    return row.rstrip().rstrip("|").rsplit("|", 1)[-1]


def _changelog_bullets(text: str) -> list[tuple[int, int]]:
    """(first line, line count) of each bullet: a line starting '- ' and its indented continuation."""
    bullets, start, count = [], 0, 0
    for number, line in enumerate([*text.splitlines(), ""], 1):
        if line.startswith(("- ", "* ")):
            if start:
                bullets.append((start, count))
            start, count = number, 1
        elif start and line.startswith(" ") and line.strip():
            count += 1
        elif start:
            bullets.append((start, count))
            start = 0
    return bullets


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in path.read_text().splitlines() if re.match(r"#{1,6} ", line)}


@pytest.mark.parametrize("path", REFERENCE, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_reference_docs_hold_no_clock_time_load_average_or_this_stop(path):
    assert _run_log_text(path.read_text()) == []


def test_the_run_log_patterns_catch_clock_times_load_and_this_stop_but_not_figures():
    for planted in ("measured at 16:23 today", "a run 13:25-13:40 UTC", "(13:25 UTC, 835 s)",
                    "load average 10-14", "at load 1.1", "(load 5-6)", "(this stop)", "in this session"):
        assert _run_log_text(planted), planted
    for fine in ("`swa.py:1495`", "`unified_tree_core.py:1430-1447`", "0.203 / 0.333", "2026-12-04",
                 "sm_120a", "×1.48 at pct 20", "a loaded 2-core machine", "the turns load 0 from L3"):
        assert _run_log_text(fine) == [], fine


@pytest.mark.parametrize("path", sorted((ROOT / "docs" / "switches").glob("*.md")), ids=lambda p: p.name)
def test_every_switch_page_has_one_measured_table_whose_every_row_names_its_command(path):
    text = path.read_text()
    assert text.count("\n## Measured\n") == 1, "one '## Measured' section per switch page"
    headers, rows = _measured_rows(text)
    assert headers == [MEASURED_HEADER], f"one table under '## Measured' with the columns {MEASURED_HEADER}"
    assert rows, "the Measured table has no row"
    missing = [row for row in rows if not COMMAND.search(_command_cell(row))]
    assert missing == [], "every row's command column names its command in backticks"


def test_a_measured_row_without_a_command_is_caught():
    page = f"# x\n\n## Measured\n\n{MEASURED_HEADER}\n|---|---|---|\n| 1.0 | CPU | by hand |\n"
    headers, rows = _measured_rows(page)
    assert headers == [MEASURED_HEADER]
    assert not COMMAND.search(_command_cell(rows[0]))
    assert COMMAND.search(_command_cell("| 1.0 | CPU | `python -m adapter bench swa-thin` |"))


def test_every_changelog_bullet_is_at_most_three_lines():
    text = (ROOT / "CHANGELOG.md").read_text()
    long = [f"line {start}: {count} lines" for start, count in _changelog_bullets(text) if count > 3]
    assert long == []


def test_a_four_line_changelog_bullet_is_counted_as_four():
    assert _changelog_bullets("### Added\n- one\n  two\n  three\n  four\n- five\n\n") == [(2, 4), (6, 1)]


def test_every_relative_link_between_the_docs_points_at_a_file_and_heading_that_exist():
    broken = []
    for path in [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in LINK.findall(path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            name, _, anchor = target.partition("#")
            linked = (path.parent / name).resolve() if name else path
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []
