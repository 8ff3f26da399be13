"""The tiny DeepSeek-V4 checkpoint (devkit/engine_kit/dsv4/checkpoint.py) against both of its loaders.

Invariants: the same seed writes the same bytes; SGLang 0.5.23's ``DeepseekV4ForCausalLM.load_weights``
fills every parameter of the model it builds from the folder (V4 and V4.1 flavours) and places every
tensor; transformers 5.19's ``DeepseekV4ForCausalLM`` loads the same folder with no missing,
unexpected or mismatched key.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")
pytest.importorskip("transformers.models.deepseek_v4")

from devkit.engine_kit.dsv4 import checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def v4(tmp_path_factory) -> Path:
    return checkpoint.make_checkpoint(tmp_path_factory.mktemp("dsv4") / "v4")


def test_two_makes_with_the_same_seed_write_identical_bytes(tmp_path, v4):
    """Each tensor has its own generator, so a second make (no stamp to reuse) is byte-identical,
    and another seed changes the weights but not the config."""
    again = checkpoint.make_checkpoint(tmp_path / "again")
    other = checkpoint.make_checkpoint(tmp_path / "other", seed=1)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (again / name).read_bytes() == (v4 / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (v4 / "model.safetensors").read_bytes()
    assert json.loads((other / "config.json").read_text()) == json.loads((v4 / "config.json").read_text())


def test_a_matching_stamp_reuses_the_folder_and_a_changed_spec_rewrites_it(tmp_path):
    out = checkpoint.make_checkpoint(tmp_path / "m")
    weights = out / "model.safetensors"
    before = weights.stat().st_mtime_ns
    checkpoint.make_checkpoint(out)
    assert weights.stat().st_mtime_ns == before
    checkpoint.make_checkpoint(out, seed=3)
    assert weights.stat().st_mtime_ns != before


def test_deeper_checkpoints_repeat_the_compress_ratio_pattern():
    config = checkpoint.tiny_config(num_layers=7)
    assert config["compress_ratios"] == [0, 4, 128, 0, 4, 128, 0]
    specs = checkpoint.tensor_specs(config)
    assert "layers.4.attn.indexer.compressor.ape" in specs and "layers.3.attn.compressor.ape" not in specs
    assert specs["layers.5.attn.compressor.ape"][0] == (128, 512)  # C128: one series
    assert specs["layers.4.attn.compressor.ape"][0] == (4, 1024)  # C4: two overlapping series
    assert "layers.0.ffn.gate.tid2eid" in specs and "layers.1.ffn.gate.bias" in specs


def test_the_v41_flavour_has_no_hc_head_and_transformers_refuses_it():
    config = checkpoint.tiny_config(model_type="deepseek_v41")
    assert not any(name.startswith("hc_head_") for name in checkpoint.tensor_specs(config))
    with pytest.raises(ValueError, match="deepseek_v4 only"):
        checkpoint.transformers_config(config)
    with pytest.raises(ValueError, match="model_type"):
        checkpoint.tiny_config(model_type="deepseek_v4_1")


def test_hash_routing_tables_pick_distinct_experts_per_token(v4):
    from safetensors.torch import load_file

    tid2eid = load_file(str(v4 / "model.safetensors"))["layers.0.ffn.gate.tid2eid"]
    assert tid2eid.shape == (1024, 2)
    assert (tid2eid[:, 0] != tid2eid[:, 1]).all() and tid2eid.min() >= 0 and tid2eid.max() < 4
    assert len(set(map(tuple, tid2eid.tolist()))) > 6  # not a constant table


@pytest.mark.spawns
@pytest.mark.parametrize("model_type", ["deepseek_v4", "deepseek_v41"])
def test_sglang_load_weights_fills_every_parameter_of_the_model(tmp_path, model_type, v4):
    """SGLang's real model class, built on CPU in a fresh process (it publishes process-wide config):
    after ``load_weights`` no parameter keeps its NaN / -1 fill and the loader placed every tensor."""
    path = v4 if model_type == "deepseek_v4" else checkpoint.make_checkpoint(tmp_path / "v41", model_type=model_type)
    code = ("import json, sys; from devkit.engine_kit.dsv4 import checkpoint as c; "
            f"print('RESULT ' + json.dumps(c.sglang_unloaded_parameters({str(path)!r}, port={29611 + len(model_type)})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["model_type"] == model_type
    assert result["parameters"] > 70
    assert result["unfilled"] == []
    assert result["unexpected"] == []


def test_transformers_loads_the_checkpoint_with_no_missing_or_unexpected_keys(v4):
    import torch
    from transformers import DeepseekV4ForCausalLM

    config = checkpoint.transformers_config(checkpoint.load_config(v4))
    model, info = DeepseekV4ForCausalLM.from_pretrained(str(v4), config=config, dtype=torch.bfloat16,
                                                        output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and info["error_msgs"] == []
    assert config.layer_types == ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    assert config.mlp_layer_types == ["hash_moe", "moe", "moe"]
    from safetensors.torch import load_file

    weights = load_file(str(v4 / "model.safetensors"))
    state = model.state_dict()
    assert torch.equal(state["model.layers.0.mlp.gate.tid2eid"].long(), weights["layers.0.ffn.gate.tid2eid"].long())
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"][2]
    assert torch.equal(gate_up[:128], weights["layers.1.ffn.experts.2.w1.weight"])
    assert torch.equal(gate_up[128:], weights["layers.1.ffn.experts.2.w3.weight"])
    assert torch.equal(state["model.layers.1.self_attn.compressor.indexer.position_bias"].float(),
                       weights["layers.1.attn.indexer.compressor.ape"])
