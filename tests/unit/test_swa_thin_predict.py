"""What ``check`` predicts SWA thin logs: installed at import, refused at the cache build when the
tree has no SWA component (a model without sliding windows, or DeepSeek-V4.1 under encoder SWA
bounded replay), and "not decided" without a model to tell."""

from __future__ import annotations

from adapter.core import api
from adapter.switches import swa_thin

DSV41 = api.ModelFacts("/m", "DeepseekV4ForCausalLM", "DeepSeekV4TokenToKVPool", window=128, model_type="deepseek_v41")
DENSE = api.ModelFacts("/d", "LlamaForCausalLM", "none")


def _said(model: api.ModelFacts | None, argv: tuple[str, ...] = (), status: str = "installed") -> str | None:
    return swa_thin.predict(api.Profile({}, {}, argv, None, model, status)).receipt


def test_a_model_with_sliding_windows_keeps_the_install_outcome():
    assert _said(DSV41) is None  # the install outcome (installed) is what the boot logs


def test_a_tree_without_an_swa_component_is_predicted_refused_with_the_switchs_own_reason():
    assert _said(DENSE) == f"refused: {swa_thin.NO_SWA_TREE}"
    assert _said(DSV41, ("--enable-encoder-swa-bounded-replay",)) == f"refused: {swa_thin.NO_SWA_TREE}"
    assert _said(None, ("--enable-encoder-swa-bounded-replay",)) == f"refused: {swa_thin.NO_SWA_TREE}"


def test_without_a_model_folder_the_cache_build_decides():
    assert _said(None).startswith("not decided (no model config.json")


def test_a_switch_refused_at_install_is_left_to_its_install_outcome():
    assert _said(DENSE, status="refused") is None
