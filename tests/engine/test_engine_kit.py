"""The CPU engine kit without a server: the stand-in's reference attention, its import surface,
the model maker and the launcher's inputs. The end-to-end boots are in test_engine_kit_server.py."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from devkit.engine_kit import launcher, model

REFERENCE = launcher.STUB_PATH / "sgl_kernel" / "_reference.py"


def _reference():
    # Loaded by path: importing the sgl_kernel package would reroute this process's attention backends.
    spec = importlib.util.spec_from_file_location("dsv41_stub_reference", REFERENCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sdpa(q, k, v, window, scale, sinks=None):
    """Causal (windowed) GQA attention of a whole sequence through torch SDPA (sinks: one extra zero-value key)."""
    n, heads = q.shape[0], q.shape[1]
    k = k.repeat_interleave(heads // k.shape[1], 1)
    v = v.repeat_interleave(heads // v.shape[1], 1)
    i = torch.arange(n)
    mask = i[None, :] <= i[:, None]
    if window:
        mask &= i[None, :] > i[:, None] - window
    mask = mask[None].expand(heads, n, n)
    if sinks is not None:  # a sink is a key every query sees whose value is zero and whose score is the sink
        k = torch.cat([k, torch.zeros(1, heads, k.shape[2])])
        v = torch.cat([v, torch.zeros(1, heads, v.shape[2])])
        mask = torch.cat([mask, torch.ones(heads, n, 1, dtype=torch.bool)], dim=-1)
        bias = torch.zeros(heads, n, n + 1)
        bias[:, :, -1] = sinks.view(heads, 1)  # the zero key scores q.0 = 0, plus the sink
        bias = bias.masked_fill(~mask, float("-inf"))
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=bias, scale=scale).transpose(0, 1)
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale).transpose(0, 1)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_reference_attention_matches_torch_sdpa_for_extend_on_a_prefix_and_for_decode(window, with_sinks):
    ref = _reference()
    torch.manual_seed(0)
    heads, kv_heads, dim, n, pool, prefix = 4, 2, 16, 20, 64, 8
    k_buf, v_buf = torch.randn(pool, kv_heads, dim), torch.randn(pool, kv_heads, dim)
    locs = torch.randperm(pool - 1)[:n] + 1  # scattered pool slots, as the allocator hands them out
    req_to_token = torch.zeros(2, 128, dtype=torch.int64)
    req_to_token[1, :n] = locs
    q = torch.randn(n, heads, dim)
    sinks = torch.randn(heads) if with_sinks else None
    expected = _sdpa(q, k_buf[locs], v_buf[locs], window, 0.25, sinks)

    out = torch.empty(n - prefix, heads, dim)
    ref.extend_attention_cpu(q[prefix:], None, None, out, k_buf, v_buf, 1.0, 1.0, req_to_token, torch.tensor([1]),
                             torch.tensor([n]), torch.tensor([n - prefix]), torch.tensor([0]), n - prefix, 0.25, 0.0,
                             False, window, sinks=sinks)
    assert (out - expected[prefix:]).abs().max().item() < 1e-5

    one = torch.empty(1, heads, dim)
    ref.decode_attention_cpu(q[n - 1 :], k_buf, v_buf, 1.0, 1.0, one, None, None, None, None, req_to_token,
                             torch.tensor([1]), torch.tensor([n]), 0.25, 0.0, False, window, sinks=sinks)
    assert (one - expected[n - 1 :]).abs().max().item() < 1e-5


def test_reference_decode_writes_the_new_tokens_kv_at_cache_loc_before_attending():
    ref = _reference()
    torch.manual_seed(1)
    k_buf, v_buf = torch.zeros(16, 1, 4), torch.zeros(16, 1, 4)
    req_to_token = torch.tensor([[3, 7, 9]])
    k_buf[[3, 7]] = torch.randn(2, 1, 4)
    k_new, v_new = torch.randn(1, 1, 4), torch.randn(1, 1, 4)
    out = torch.empty(1, 1, 4)
    ref.decode_attention_cpu(torch.randn(1, 1, 4), k_buf, v_buf, 1.0, 1.0, out, k_new, v_new, torch.tensor([9]), None,
                             req_to_token, torch.tensor([0]), torch.tensor([3]), 0.5, 0.0, False, 0)
    assert torch.equal(k_buf[9], k_new[0]) and torch.equal(v_buf[9], v_new[0])


def test_the_sgl_kernel_stand_in_raises_for_missing_ops_and_routes_to_cpu_paths():
    code = (
        "import sgl_kernel, torch, time\n"
        "from sglang.srt.layers.attention import attention_registry as r\n"
        "from sglang.srt.utils.device_timer import DeviceTimer\n"
        "spans = []\n"
        "timer = DeviceTimer(reporter=lambda t, **k: spans.append(t))\n"
        "with timer.wrap({}):\n    time.sleep(0.05)\n"
        "out = {'route': r.ATTENTION_BACKENDS['torch_native'].__module__, 'spans': spans,\n"
        "       'amx_packing': hasattr(torch.ops.sgl_kernel, 'convert_weight_packed')}\n"
        "try:\n    sgl_kernel.verify_tree_greedy_cpu()\nexcept NotImplementedError as e:\n    out['import_only'] = str(e)\n"
        "try:\n    from sgl_kernel import fused_experts_cpu\nexcept ImportError as e:\n    out['missing'] = str(e)\n"
        "import json; print(json.dumps(out))\n"
    )
    env = launcher.child_env({})
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["route"] == "sgl_kernel._route"
    assert len(out["spans"]) == 1 and 0.04 < out["spans"][0] < 5  # wall clock, no CUDA event
    assert out["amx_packing"] is False
    assert "verify_tree_greedy_cpu" in out["import_only"]
    assert "fused_experts_cpu" in out["missing"]


def test_model_maker_writes_the_same_bytes_twice_and_reuses_a_matching_folder(tmp_path):
    spec = model.ModelSpec(window=8, layers=2, vocab=320)
    a, b = model.make_model(tmp_path / "a", spec), model.make_model(tmp_path / "b", spec)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    config = json.loads((a / "config.json").read_text())
    assert config["architectures"] == ["MellumForCausalLM"]
    assert config["sliding_window"] == 8 and config["layer_types"] == ["sliding_attention", "full_attention"]
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    model.make_model(tmp_path / "a", spec)
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    other = model.make_model(tmp_path / "c", model.ModelSpec(window=8, layers=2, vocab=320, seed=1))
    assert (other / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()


def test_model_spec_rejects_bad_values_naming_the_field():
    with pytest.raises(ValueError, match=r"ModelSpec.layers=3 .*even"):
        model.make_model("/nonexistent", model.ModelSpec(layers=3))
    with pytest.raises(ValueError, match=r"ModelSpec.dtype='fp8'"):
        model.ModelSpec(dtype="fp8").validate()


def test_server_env_drops_inherited_dsv41_keys_and_puts_stand_in_then_overlay_on_pythonpath():
    env = launcher.child_env({"DSV41_SWA_THIN": "1"}, base={"DSV41_DECODE_YIELD": "50", "PATH": "/bin"})
    assert env["DSV41_SWA_THIN"] == "1" and "DSV41_DECODE_YIELD" not in env
    assert env["PYTHONPATH"].split(os.pathsep) == [str(launcher.STUB_PATH), str(launcher.REPO_ROOT)]
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["PATH"] == "/bin"
    with pytest.raises(ValueError, match="PYTHONPATH"):
        launcher.child_env({"PYTHONPATH": "/x"})


def test_server_args_are_loopback_only_and_reject_bad_values():
    args = launcher.server_args("/m", 1234, swa_ratio=0.25)
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert args[args.index("--swa-full-tokens-ratio") + 1] == "0.25"
    with pytest.raises(ValueError, match=r"chunk=8 is invalid"):
        launcher.server_args("/m", 1234, chunk=8)
    with pytest.raises(ValueError, match=r"swa_ratio=2"):
        launcher.server_args("/m", 1234, swa_ratio=2)
