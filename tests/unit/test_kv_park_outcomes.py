"""Where a log's retractions went (adapter/switches/kv_park/outcomes.py): what the soak prints."""

from __future__ import annotations

from adapter.switches.kv_park import outcomes

LOG = [
    "[dsv41] kv_park installed mode=ram budget_gib=8 copies=device_queued capture_lock=global rank=tp0\n",
    "[dsv41] kv_park parked rid=a pages=1 outcome=queued bytes=4 held=4 tree=256 rank=tp0\n",
    "[dsv41] kv_park parked rid=b pages=1 outcome=refused bytes=0 held=4 tree=0 rank=tp0\n",
    "[dsv41] kv_park not_parked rid=c reason=window_below_the_servable_prefix servable=512 swa_from=512 rank=tp0\n",
    "[dsv41] kv_park not_parked rid=d reason=tree_holds_it servable=256 rank=tp0\n",
    "[dsv41] kv_park not_parked rid=e reason=window_below_the_servable_prefix servable=256 swa_from=256 rank=tp0\n",
    "[dsv41] kv_park restored rid=a pages=1 tokens=512 cached=256 held=0 rank=tp0\n",
    "[dsv41] kv_park resumed_from_tree rid=d tokens=256 rank=tp0\n",
    "[dsv41] kv_park dropped rid=x reason=prefix_gone_from_the_tree servable=512 cached=0 rank=tp0\n",
    "[dsv41] kv_park unpinned rid=d reason=no_running_rows need=0 rank=tp0\n",
]


def test_the_split_counts_each_retraction_once_by_what_kv_park_did_with_it():
    split = outcomes.retraction_split(LOG)
    assert split == {
        "retractions": 5, "parked": 1,
        "not_parked": {"window_below_the_servable_prefix": 2, "refused_by_the_store": 1, "tree_holds_it": 1},
        "restored": 1, "resumed_from_tree": 1, "dropped": {"prefix_gone_from_the_tree": 1},
        "tokens_restored": 256, "tokens_resumed_from_tree": 256,
    }
    assert outcomes.describe(split) == (
        "5 retractions: 1 parked, 4 not parked (window_below_the_servable_prefix: 2, refused_by_the_store: 1, "
        "tree_holds_it: 1); at re-admission 1 restored (256 tokens not recomputed), 1 resumed from the tree "
        "(256 tokens), 1 dropped (prefix_gone_from_the_tree: 1)")


def test_a_log_without_kv_park_lines_splits_into_zeros():
    assert outcomes.describe(outcomes.retraction_split(["[2026] Testing retraction\n"])) == (
        "0 retractions: 0 parked, 0 not parked; at re-admission 0 restored (0 tokens not recomputed), 0 resumed "
        "from the tree (0 tokens), 0 dropped")
