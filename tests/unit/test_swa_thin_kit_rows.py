"""The kit rows of ``bench swa-thin`` (:mod:`devkit.bench.swa_thin.kit`): what the client sends per
phase, and how a row reads the server's answers."""

from __future__ import annotations

import pytest

from devkit.bench.swa_thin import kit as sk


class RecordingClient:
    """Records every call the phase makes; answers as a server that cached ``cached`` tokens of each resume."""

    def __init__(self, cached: dict[str, int]):
        self.calls: list[tuple] = []
        self.cached = cached

    def flush_cache(self, url):
        self.calls.append(("flush",))

    def generate(self, url, ids, n, session_id=None):
        self.calls.append(("generate", len(ids), session_id))
        return {"output_ids": list(range(7, 7 + n)), "meta_info": {"cached_tokens": 0}}

    def close_session(self, url, sid):
        self.calls.append(("close", sid))

    def generate_streamed(self, url, ids, n, session_id=None):
        self.calls.append(("stream", len(ids), session_id))
        agent = "A" if session_id else "B"
        return {"output_ids": [], "meta_info": {"cached_tokens": self.cached[agent]}, "ttft_s": 0.5}


def test_agent_a_and_every_subagent_send_session_ids_b_sends_none_and_each_subagent_closes_its_session():
    api = RecordingClient({"A": 0, "B": 0})
    sk.run_phase("http://x", "swa", api)
    subagents = [c for c in api.calls if c[0] == "generate" and c[1] == sk.SUBAGENT]
    closes = [c[1] for c in api.calls if c[0] == "close"]
    assert api.calls[0] == ("flush",)
    assert [c[2] for c in api.calls if c[0] == "generate" and c[1] == sk.CONTEXT] == ["agent-a", None]
    assert [c[2] for c in subagents] == closes == [f"swa-subagent-{i}" for i in range(sk.PHASES["swa"])]
    history = sk.CONTEXT + sk.OUT
    assert [c[1:] for c in api.calls if c[0] == "stream"] == [(history + sk.NEW_USER, "agent-a"),
                                                              (history + sk.NEW_USER, None)]


def test_a_resume_hits_when_the_cache_reaches_its_history_less_the_unwritten_last_token():
    history = sk.CONTEXT + sk.OUT
    api = RecordingClient({"A": history - 1, "B": history - 2})
    resumes = sk.run_phase("http://x", "full", api)
    row = sk.row("session", "full", resumes)
    assert row.hits == ["A"]
    assert row.recomputed == (sk.NEW_USER + 1) + (sk.NEW_USER + 2)
    assert (row.resumes, row.ttft_ms) == (2, 500.0)


def test_the_full_phase_outruns_the_kits_full_pool_and_the_swa_phase_does_not():
    from devkit.engine_kit.model_kits import MELLUM_MAX_TOTAL_TOKENS, MELLUM_SWA_RATIO

    def held(phase):
        return 2 * (sk.CONTEXT + sk.OUT) + sk.PHASES[phase] * (sk.SUBAGENT + sk.SUBAGENT_OUT)

    assert held("full") > MELLUM_MAX_TOTAL_TOKENS > held("swa")
    assert sk.PHASES["swa"] * sk.SUBAGENT > 2 * MELLUM_SWA_RATIO * MELLUM_MAX_TOTAL_TOKENS


@pytest.mark.parametrize("name, profile, extra", [
    ("stock", {}, []),
    ("thin", {"DSV41_SWA_THIN": "1"}, []),
    ("session", {}, ["--enable-session-radix-cache"]),
    ("thin+session", {"DSV41_SWA_THIN": "1"}, ["--enable-session-radix-cache"]),
])
def test_each_row_differs_only_in_the_servers_profile_and_flag(name, profile, extra):
    p = sk.policy(name)
    assert (p.profile, p.extra) == (profile, extra)


def test_an_unknown_row_is_refused_by_name():
    with pytest.raises(ValueError, match=r"'session\+thin' is invalid: expected one of stock, thin, session, thin\+session"):
        sk.policy("session+thin")


def test_the_thin_receipt_reads_installed_inactive_refused_or_off():
    assert sk.thin_state(["[dsv41] swa_thin installed tree_core=python backend_set_by=overlay rank=0"]) == "installed"
    assert sk.thin_state(["[dsv41] swa_thin installed", "[dsv41] swa_thin inactive reason=x"]) == "inactive"
    assert sk.thin_state(["[dsv41] swa_thin refused: ..."]) == "refused"
    assert sk.thin_state(["nothing"]) == "off"


def test_the_bench_refuses_quick_kit_rows_and_other_models_by_name():
    from devkit.bench import swa_thin

    with pytest.raises(ValueError, match="--quick with --model mellum is invalid"):
        swa_thin.run(quick=True, model="mellum")
    with pytest.raises(ValueError, match="--model 'dsv4' is invalid for swa-thin"):
        swa_thin.run(quick=False, model="dsv4")
