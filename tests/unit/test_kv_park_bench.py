"""The ``--device`` plumbing of ``python -m adapter bench`` and the kv-park benchmark's device check."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from adapter.ops import cli


@pytest.fixture
def recorder(monkeypatch):
    """Two benchmark entry points in a throwaway module: one takes ``device``, one does not."""
    calls: list[dict] = []
    module = types.ModuleType("kv_park_bench_probe")

    def with_device(quick: bool, device: str = "cpu") -> dict:
        calls.append({"quick": quick, "device": device})
        return {"device": device}

    def quick_only(quick: bool) -> dict:
        calls.append({"quick": quick})
        return {}

    module.with_device, module.quick_only = with_device, quick_only
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(
        "devkit.bench.BENCHMARKS",
        {"dev": f"{module.__name__}:with_device", "plain": f"{module.__name__}:quick_only"},
    )
    return calls


def test_bench_passes_device_only_when_it_is_given(recorder, capsys):
    assert cli.main(["bench", "dev", "--quick", "--device", "cuda"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {"bench": "dev", "quick": True, "device": "cuda"}
    assert cli.main(["bench", "plain"]) == 0  # a benchmark with run(quick) keeps working
    assert recorder == [{"quick": True, "device": "cuda"}, {"quick": False}]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_kv_park_bench_refuses_cuda_without_a_device():
    from devkit.bench import kv_park

    with pytest.raises(SystemExit, match="--device cuda asked for, but torch sees no CUDA device"):
        kv_park.run(quick=True, device="cuda")
