"""The DeepSeek-V4.1 kit's fp4 index-K stand-ins (devkit.engine_kit.dsv4.fp4_index) against SGLang
0.5.23's own kernels run by the Triton interpreter (quantize, store: integer and fp32 work it runs
as written) and its torch references (the pool's dequant formula, ``DeepseekV41Indexer.scores``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.spawns
def test_the_fp4_index_stand_ins_are_bit_exact_against_sglangs_kernels_and_torch_scoring():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "devkit.engine_kit.dsv41.check_kernels"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "quantize_fp4_indexer_tensor rne=False: bit-exact" in lines[0]
    assert "quantize_fp4_indexer_tensor rne=True: bit-exact" in lines[1]
    assert "store_fp4_index_k_cache: bit-exact (0 bytes)" in lines[2]
    assert "dequant_index_k vs get_index_k_dequant's formula: bit-exact" in lines[3]
    assert "bit-exact 103/103, max rel diff 0" in lines[5]


def test_the_prefill_top_k_stand_in_picks_the_same_set_whatever_the_width_and_the_k_highest_scores():
    import torch

    from devkit.engine_kit.dsv4.fp4_index import topk_lowest_index_ties

    g = torch.Generator().manual_seed(0)
    scores = (torch.randn(64, 1024, generator=g) * 8).round() / 8  # bf16-like: many equal scores
    lens = torch.randint(600, 896, (64, 1), generator=g)
    cols = torch.arange(1024)
    wide = scores.masked_fill(cols >= lens, -torch.inf)
    narrow = wide[:, :896]
    k = 512
    a, b = topk_lowest_index_ties(narrow, k).sort(-1).values, topk_lowest_index_ties(wide, k).sort(-1).values
    assert torch.equal(a, b)
    # upstream's topk(sorted=False) keeps the same values but chooses among ties by the width
    up_a = narrow.topk(k, dim=-1, sorted=False).indices.sort(-1).values
    up_b = wide.topk(k, dim=-1, sorted=False).indices.sort(-1).values
    assert not torch.equal(up_a, up_b)
    assert torch.equal(wide.gather(1, b).sort(-1).values, wide.gather(1, up_b).sort(-1).values)
