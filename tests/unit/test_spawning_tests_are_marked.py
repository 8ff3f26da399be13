"""A test that starts another Python interpreter carries ``@pytest.mark.spawns``, so the fast lane
(``bash tools/test.sh fast``) leaves it out: read from the tests' own source."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPAWNS = ("sys.executable", "subprocess.Popen", 'get_context("spawn")')


def _unmarked(path: Path) -> list[str]:
    source = path.read_text()
    tree = ast.parse(source)
    module_marked = any(isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
                        and "spawns" in ast.unparse(node.value) for node in tree.body)
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            body = ast.get_source_segment(source, node) or ""
            marked = any("spawns" in ast.unparse(d) for d in node.decorator_list)
            if any(word in body for word in SPAWNS) and not (marked or module_marked):
                found.append(f"{path.relative_to(ROOT)}::{node.name}")
    return found


def test_every_test_that_starts_an_interpreter_in_the_fast_lane_folders_is_marked_spawns():
    files = sorted((ROOT / "tests" / "unit").glob("test_*.py")) + sorted((ROOT / "tests" / "upstream").glob("test_*.py"))
    assert [name for path in files for name in _unmarked(path)] == []
