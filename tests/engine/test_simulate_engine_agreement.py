"""``simulate`` against the real CPU engine: the same workload through SGLang's HTTP server (the
Mellum kit: page 1, window 31, chunk 64, Full pool 16,384, SWA pool 1,638) and through
``overlay_tools.simulate`` at that geometry gives the same prefix per turn (``cached_tokens``), under
stock and under SWA thin. Sequential turns, so the engine's batching does not enter; greedy and
deterministic, so both boots see the same outputs. Slow: two boots (about 3 minutes here)."""

from __future__ import annotations

import pytest

from devkit.engine_kit import client, launcher, model, workload
from overlay_tools import simulate
from overlay_tools.simulate import fleet, trace
from overlay_tools.simulate.cache_kit import OUTPUT_TOKEN

pytestmark = pytest.mark.slow

OUT = 8
CHURN = 10  # chunked 400-token prompts: their passed checkpoints and leaves fill the SWA pool


@pytest.fixture(scope="module")
def kit_model(tmp_path_factory):
    return model.make_model(tmp_path_factory.mktemp("kit") / "model")


def _engine(kit_model, log, profile):
    """Turn by turn on the server: A, the churn, A's next turn (A + A's output + 40 new tokens)."""
    w = workload.Workload()
    server = launcher.Server(launcher.server_args(kit_model, launcher.free_port(), swa_ratio=0.1), log, profile)
    prompts, cached = [], []
    with server:
        a = w.ids("a", 200)
        first = client.generate(server.base_url, a, OUT)
        prompts.append(a)
        cached.append(first["meta_info"]["cached_tokens"])
        for i in range(CHURN):
            prompt = w.ids(f"c{i}", 400)
            prompts.append(prompt)
            cached.append(client.generate(server.base_url, prompt, OUT)["meta_info"]["cached_tokens"])
        resumed = a + first["output_ids"] + w.ids("a2", 40)
        prompts.append(resumed)
        cached.append(client.generate(server.base_url, resumed, OUT)["meta_info"]["cached_tokens"])
    return prompts, cached


def _simulate(prompts, policy):
    """The same prompts on the simulated cache; A's output is the kit's decode token (what the tree
    keeps of it: prompt + output - 1 tokens), the rest of the resumed prompt is the engine's."""
    kept = OUT - 1
    prompts = [*prompts[:-1], prompts[0] + [OUTPUT_TOKEN] * kept + prompts[-1][len(prompts[0]) + kept:]]
    requests = []
    for i, p in enumerate(prompts):
        r = trace.Request(i, i + 1, i * 100_000, len(p), OUT, [], session=i)
        r.prompt, r.out_tokens = [(t, 1, 1) for t in p], kept
        requests.append(r)
    last = requests[-1]
    last.parent, last.session, requests[0].children = 0, 0, [last.index]
    geo = fleet.Fleet(page=1, window=31, chunk=64, max_running=8, tails=0, swa_pool=1638, full_tokens=16384,
                      full_source="the kit's --max-total-tokens", cone_tokens=64, cone_bound=0, model="mellum kit",
                      profile="-")
    turns, row = simulate.run_policy(policy, geo, requests, progress=False)
    assert row["leak"] == 0
    return [t.stock_prefix for t in turns]


@pytest.mark.parametrize(("policy", "profile", "resumed_at"),
                         [("stock", {}, 0), ("thin", {"DSV41_SWA_THIN": "1"}, 207)])
def test_simulate_gives_the_prefix_the_engine_reports_on_every_turn(kit_model, tmp_path, policy, profile, resumed_at):
    """The churn evicts A's window under stock (A's next turn matches nothing) and not under thin
    (it matches A's 200 + 8 - 1 tokens): simulate says the same, turn by turn."""
    prompts, cached = _engine(kit_model, tmp_path / "server.log", profile)
    assert cached[-1] == resumed_at  # the workload separates the policies on the engine
    assert _simulate(prompts, policy) == cached
