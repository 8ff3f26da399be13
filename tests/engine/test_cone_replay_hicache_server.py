"""Cone replay beside HiCache on SGLang 0.5.23's real server serving the tiny DeepSeek-V4 and V4.1
(slow, heavy: one boot per kit, four phases; :mod:`devkit.testkit.dsv4_cone_hicache`).

HiCache write-back at host ratio 1, the Python tree core (as ``DSV41_SWA_THIN=1`` selects it). An
idle session whose Full KV the churn pushed to host and whose window it dropped from both tiers:
stock + HiCache re-prefills it from the deepest surviving window (none here: all of it); the cone
loads the Full KV back through HiCache and recomputes N + one page of the history, and the rows
from the session's end get the logprobs a prefix hit on the same KV gets.
"""

from __future__ import annotations

import re

import pytest

from devkit.testkit import dsv4_cone as dc
from devkit.testkit import dsv4_cone_hicache as dch

pytestmark = [pytest.mark.slow, pytest.mark.heavy]
V41_RATIOS = (0, 2, 1, 1, 0)
KITS = {"dsv4": dc.N, "v41": 1024}  # N = each kit model's bound (test_cone_replay_v41_server.py)


@pytest.fixture(scope="module", params=sorted(KITS))
def kit_phases(request, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"{request.param}_cone_hicache")
    model = None
    if request.param == "v41":
        from devkit.engine_kit.dsv41 import checkpoint

        model = checkpoint.make_checkpoint(work / "ckpt", ratios=V41_RATIOS)
    return request.param, KITS[request.param], dch.run(work, model=model, tokens=KITS[request.param])


def _plan(log: list[str], n: int) -> dict[str, int]:
    lines = [line for line in log if "DSV41_SWA_CONE plan rid=" in line]
    assert len(lines) == 1, dch.cone_lines(log)
    fields = dict(re.findall(r" (\w+)=(\d+)", lines[0]))
    assert int(fields["N"]) == n, lines[0]
    return {k: int(v) for k, v in fields.items()}


def test_the_session_on_host_resumes_with_n_plus_a_page_recomputed_against_stock_hicaches_larger_figure(kit_phases):
    name, n, phases = kit_phases
    log = phases["log"]
    assert any(f"cone_replay installed N={n} " in line and "host_full_kv=load_back" in line for line in log), name
    plan = _plan(log, n)
    F, s = plan["F"], plan["s"]
    assert plan["load"] > 0 and s == F - n  # the Full KV of [F - load, F) sat on host only
    loads = [line for line in log if "DSV41_SWA_CONE load rid=" in line]
    assert len(loads) == 1 and f" tokens={plan['load']} " in loads[0] and f" F={F} s={s} " in loads[0], loads
    assert not [line for line in log if "DSV41_SWA_CONE fallback" in line]
    assert phases["hit"]["cached_tokens"] == dch.A_LEN
    cone, stock = (dch.A_LEN - phases[p]["cached_tokens"] for p in ("cone", "stock"))
    assert phases["cone"]["cached_tokens"] == s and cone == n + dc.PAGE  # N + the page past F
    assert stock > cone, (name, stock, cone)  # stock + HiCache: from the deepest window left (none)


def test_the_rows_from_the_sessions_end_get_a_prefix_hits_logprobs_and_are_no_farther_from_a_re_prefill(kit_phases):
    name, _, phases = kit_phases
    cone, hit, cold = phases["cone"], phases["hit"], phases["cold"]
    assert cone["token"] == hit["token"] and cone["top"] == hit["top"], name
    assert dc.logprob_distance(cone, hit) == 0.0, name
    assert dc.logprob_distance(cone, cold) <= dc.logprob_distance(hit, cold) + dc.LOGPROB_TOLERANCE, name
