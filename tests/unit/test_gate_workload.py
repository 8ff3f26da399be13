"""The gate workload's cache phases as requests (no server: an ``api`` that records what it is sent).
The Mellum leg's requests must stay exactly what they were; the DSV4 leg's branch must reuse
prefill-written tokens only and its branched prompt must run before the idle session's turn."""

import pytest

from devkit.engine_kit import model_kits
from devkit.engine_kit import workload as wl


class Recorder:
    """Answers every request with ``n`` tokens of id 7 and no cache hit; keeps what was sent."""

    def __init__(self):
        self.sent: list[tuple[list[int], int, bool]] = []

    def flush_cache(self, base_url):
        self.sent.append(([], 0, False))

    def generate(self, base_url, input_ids, max_new_tokens, timeout_s=0.0, logprobs=False):
        self.sent.append((list(input_ids), max_new_tokens, logprobs))
        meta = {"cached_tokens": 0, "output_token_logprobs": [[-0.5, 7, None]] * max_new_tokens}
        return {"output_ids": [7] * max_new_tokens, "meta_info": meta}


def _run(w):
    api = Recorder()
    out = wl.run_cache_phases("http://unused", w, api)
    return api.sent, out


def test_mellums_quick_workload_sends_the_requests_it_always_sent_in_the_same_order():
    w = wl.Workload.quick()
    sent, out = _run(w)
    session, cone = w.ids("session", 1024), w.ids("cone", 64)
    expected = [([], 0, False), (session, 8, False), (cone, 576, False)]
    expected += [(w.ids(f"churn{i}", 512), 4, False) for i in range(10)]
    expected += [(session + [7] * 8 + w.ids("session_user2", 24), 8, False),
                 ((cone + [7] * 576)[:480] + w.ids("cone_user2", 24), 8, True)]
    assert sent == expected
    assert out["cone_recomputed_tokens"] == 480 and out["cone_branch_logprobs"] == [-0.5] * 8


def test_the_dsv4_leg_runs_its_branched_prompt_first_and_branches_inside_that_prompt():
    w = model_kits.kit("dsv4").workload(True)
    w.validate()
    sent, _ = _run(w)
    cone, session = w.ids("cone", w.cone_prompt_tokens), w.ids("session", w.session_tokens)
    assert [s[:2] for s in sent[1:3]] == [(cone, w.cone_tokens - w.cone_prompt_tokens), (session, w.turn_tokens)]
    branch, _, logprobs = sent[-1]
    # Prefill-written tokens only: the first cone_branch_at tokens of the prompt, then the new message.
    assert logprobs and branch == cone[: w.cone_branch_at] + w.ids("cone_user2", w.new_user_tokens)
    assert w.cone_branch_at % 256 == 0 and w.cone_branch_at - 768 >= model_kits.DSV4_CHUNK  # F - N above the prompt's checkpoint
    assert len(sent) == 1 + 2 + w.churn_requests + 2


def test_a_branch_inside_the_prompt_is_checked_against_the_prompt_and_named_when_wrong():
    ok = wl.Workload(cone_prompt_tokens=2048, cone_tokens=2056, cone_branch_at=1792, cone_branch_in_prompt=True)
    ok.validate()
    with pytest.raises(ValueError, match=r"cone_branch_at=2048 is invalid with cone_branch_in_prompt: expected 0 < it < "
                                         r"cone_prompt_tokens=2048 < cone_tokens=2056"):
        wl.Workload(cone_prompt_tokens=2048, cone_tokens=2056, cone_branch_at=2048, cone_branch_in_prompt=True).validate()
    with pytest.raises(ValueError, match=r"cone_branch_at=1792 is invalid: expected cone_prompt_tokens=2048 < it"):
        wl.Workload(cone_prompt_tokens=2048, cone_tokens=2056, cone_branch_at=1792).validate()


def test_the_yield_phase_refuses_a_round_whose_streams_did_not_decode_together(monkeypatch):
    """An engine that keeps one stream queued while another decodes all its tokens gives no share
    to measure (the streams' window would end before the prompt is sent): a clear error, not a
    meaningless number."""
    from devkit.engine_kit import client
    from devkit.engine_kit import workload as wl

    w = wl.Workload(streams=2, stream_max_tokens=100, before_s=0.0)

    class FinishedStream:
        def __init__(self, base_url, rid, ids, max_new_tokens, timeout_s):
            self.rid, self.error = rid, None
            self.tokens = max_new_tokens if rid.endswith("-s0") else 8  # s0 ran to its end meanwhile

        def start(self):
            return self

    stopped = []
    monkeypatch.setattr(client, "flush_cache", lambda url: None)
    monkeypatch.setattr(client, "Stream", FinishedStream)
    monkeypatch.setattr(client, "stop_streams", lambda url, streams: stopped.append(len(streams)))
    with pytest.raises(RuntimeError, match=r"streams \['r-s0'\] finished their 100 tokens before the long prompt"):
        wl.run_yield_phase("http://x", w, "r")
    assert stopped == [2]  # the streams are stopped on the way out


def test_the_streams_tokens_since_the_send_merge_every_streams_arrivals_in_time_order():
    """Two streams' arrivals (a chunk of 2 tokens in one message counts 2): those in (send, end] only,
    counted from the tokens each had at the send."""
    from devkit.engine_kit.client import Stream

    a = Stream("http://x", "a", [7], 10, ticks=[(0.5, 1), (1.2, 2), (1.9, 4), (3.1, 5)])
    b = Stream("http://x", "b", [7], 10, ticks=[(0.9, 1), (1.5, 2), (2.5, 3)])
    assert wl.decoded_since([a, b], 1.0, 3.0) == [(0.2, 1), (0.5, 2), (0.9, 4), (1.5, 5)]
    assert wl.decoded_since([a, b], 3.5, 4.0) == []


class RidRecorder(Recorder):
    """Also keeps the ``rid`` each request ran under; answers the resume with 960 tokens cached."""

    def __init__(self):
        super().__init__()
        self.rids: list[str | None] = []

    def generate(self, base_url, input_ids, max_new_tokens, timeout_s=0.0, logprobs=False, rid=None):
        self.rids.append(rid)
        out = super().generate(base_url, input_ids, max_new_tokens, timeout_s, logprobs)
        out["meta_info"]["cached_tokens"] = 960 if rid else 0
        return out


def test_the_host_phase_runs_a_turn_churn_past_the_full_pool_and_the_resume_under_its_own_id():
    w = model_kits.kit("mellum").workload(True, 2.0)
    api = RidRecorder()
    out = wl.run_host_phase("http://unused", w, api)
    session = w.ids("host_session", w.host_session_tokens)
    assert api.sent[0] == ([], 0, False) and api.sent[1] == (session, w.turn_tokens, False)
    assert [s[0] for s in api.sent[2:-1]] == [w.ids(f"host_churn{i}", w.churn_tokens) for i in range(w.host_churn_requests)]
    assert api.sent[-1][0] == session + [7] * w.turn_tokens + w.ids("host_user2", w.new_user_tokens)
    assert api.rids == [None] * (1 + w.host_churn_requests) + [wl.HOST_RESUME_RID]
    assert out["rid"] == wl.HOST_RESUME_RID and out["context_tokens"] == 1032 and out["recomputed_tokens"] == 72
    assert len(out["outputs"]) == 2 + w.host_churn_requests
    assert wl.run_host_phase("http://unused", model_kits.kit("mellum").workload(True), api) == {}  # no HiCache: no phase
