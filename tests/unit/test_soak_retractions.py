"""The soak's retraction table (devkit/soak/retractions.py): one row per outcome, counts right-aligned."""

from __future__ import annotations

from devkit.soak import retractions

SPLIT = {"retractions": 5, "parked": 1, "not_parked": {"window_below_the_servable_prefix": 3, "tree_holds_it": 1},
         "restored": 1, "resumed_from_tree": 1, "dropped": {"prefix_gone_from_the_tree": 1},
         "tokens_restored": 256, "tokens_resumed_from_tree": 512}


def test_the_table_has_a_row_per_outcome_and_reason_with_its_count():
    rows = {" ".join(r.split()[:-1]): r.split()[-1] for r in retractions.table(SPLIT, 7)}
    assert rows == {
        "SGLang retraction passes (Testing retraction)": "7",
        "rows retracted (kv_park lines)": "5",
        "parked": "1",
        "not parked: window_below_the_servable_prefix": "3",
        "not parked: tree_holds_it": "1",
        "at re-admission: restored": "1",
        "tokens restored, not recomputed": "256",
        "at re-admission: resumed from the tree": "1",
        "tokens held by the tree, pinned": "512",
        "at re-admission: dropped: prefix_gone_from_the_tree": "1",
    }


def test_a_log_without_the_sglang_count_prints_a_dash_and_the_counts_line_up():
    rows = retractions.table(SPLIT, None)
    assert rows[0].split()[-1] == "-"
    assert len({len(r) for r in rows}) == 1
