"""Conformance (no switch): greedy rows take the argmax on the real ``Sampler``, pytorch backend, CPU.

Pins SGLang 0.5.23 behaviour: temperature 0 becomes
``top_k=1`` (``SamplingParams.__post_init__``), a greedy row batched with sampled rows goes through
the top-k/top-p path where rank 0 always survives the top_p mask, and an all-greedy batch takes
``torch.argmax``. An SGLang bump that lets top_p (or a sampled neighbour) move a greedy row off
the argmax fails here.
"""

from __future__ import annotations

import warnings
from array import array

import pytest

VOCAB = 64
GREEDY = [
    {"temperature": 0.0, "top_p": 0.1},
    {"temperature": 0.0, "top_p": 1.0},
    {"temperature": 0.8, "top_k": 1, "top_p": 0.1},
    {"temperature": 1.3, "top_k": 1, "top_p": 0.5},
]
SAMPLED = [{"temperature": 1.0, "top_p": 0.9}, {"temperature": 1.0, "top_k": 20}]


@pytest.fixture(scope="module")
def sampler():
    warnings.filterwarnings("ignore", module="sglang")
    import torch
    from sglang.srt.layers.sampler import OutputLogprobProcessor, Sampler
    from sglang.srt.runtime_context import get_exec
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    torch.set_num_threads(1)
    set_global_server_args_for_scheduler(
        ServerArgs(model_path="dummy", sampling_backend="pytorch", pp_max_micro_batch_size=8, max_running_requests=8)
    )
    execution = get_exec()
    assert execution.kernel.sampling_backend == "pytorch"
    # Sampler.__init__ reads the TP group, which a single CPU process has not initialised;
    # everything else is what __init__ would set from the published config.
    smp = object.__new__(Sampler)
    torch.nn.Module.__init__(smp)
    smp.tp_sync_group = smp.cp_sync_group = None
    smp.rl_on_policy_target = execution.deterministic.rl_on_policy_target
    smp.enable_deterministic = execution.deterministic.enable_deterministic_inference
    smp.use_log_softmax_logprob = smp.rl_on_policy_target is not None
    smp.use_ascend_backend = False
    smp.sampling_mask_max_tokens = execution.features.sampling_mask_max_tokens
    smp.output_logprob_processor = OutputLogprobProcessor()
    return smp


def _sampling_info(rows: list[dict]):
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams

    reqs = []
    for i, kw in enumerate(rows):
        params = SamplingParams(max_new_tokens=4, **kw)
        params.normalize(None)
        params.verify(VOCAB)
        reqs.append(Req(f"q{i}", "", array("q", [1, 2, 3]), params, vocab_size=VOCAB))
    batch = ScheduleBatch(reqs=reqs)
    batch.device = "cpu"
    return SamplingBatchInfo.from_schedule_batch(batch, VOCAB)


def _sample(sampler, info, logits):
    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    n = logits.shape[0]
    out = LogitsProcessorOutput(next_token_logits=logits.clone())
    return sampler.forward(out, info, False, [0] * n, [None] * n, torch.zeros(n, dtype=torch.int64))


def test_greedy_rows_batched_with_sampled_rows_always_take_the_argmax(sampler):
    import torch

    rows = GREEDY + SAMPLED
    info = _sampling_info(rows)
    assert not info.is_all_greedy and info.need_top_k_sampling
    generator = torch.Generator().manual_seed(0)
    sampled_tokens: set[int] = set()
    for _ in range(200):
        # Nearly flat logits (small margins), a fresh argmax per row each draw.
        logits = torch.rand(len(rows), VOCAB, generator=generator) * 0.2
        ids = _sample(sampler, info, logits)
        assert ids[: len(GREEDY)].tolist() == logits[: len(GREEDY)].argmax(-1).tolist()
        sampled_tokens.add(int(ids[len(GREEDY)]))
    assert len(sampled_tokens) > 20  # the neighbours really sampled


def test_temperature_zero_becomes_top_k_one_at_temperature_one():
    info = _sampling_info([{"temperature": 0.0, "top_p": 0.1}])
    assert info.top_ks.tolist() == [1] and info.temperatures.view(-1).tolist() == [1.0]


def test_an_all_greedy_batch_takes_the_argmax_whatever_top_p_says(sampler):
    import torch

    info = _sampling_info(GREEDY)
    assert info.is_all_greedy
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        logits = torch.rand(len(GREEDY), VOCAB, generator=generator) * 0.2
        assert _sample(sampler, info, logits).tolist() == logits.argmax(-1).tolist()
