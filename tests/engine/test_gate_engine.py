"""End-to-end behaviour the gate relies on, on the real engine (slow: two boots, stock and profile,
sharing one model, one workload and one set of server arguments)."""

import pytest

from devkit import gate
from devkit.engine_kit import launcher, model, workload

pytestmark = pytest.mark.slow

# Shorter than the gate's quick workload: enough chunks and churn to show each effect.
WORK = workload.Workload(session_tokens=768, cone_tokens=512, cone_branch_at=400, churn_requests=8,
                         churn_tokens=448, long_prompt_tokens=1536, before_s=1.5)


def _boot(label, profile, tiny_model, tmp_path):
    boot = gate.Boot(label, profile, tmp_path / f"{label}.log")
    args = launcher.server_args(tiny_model, launcher.free_port(), swa_ratio=0.1, extra=["--decode-log-interval", "1"])
    server = launcher.Server(args, boot.log, profile)
    with server:
        boot.cache = workload.run_cache_phases(server.base_url, WORK)
        boot.yield_log_from = len(server.log_lines())
        boot.yield_ = workload.run_yield_phase(server.base_url, WORK, label)
    boot.log_lines = server.log_lines()
    assert launcher.members(server.proc.pid) == []
    return boot


@pytest.fixture(scope="module")
def boots(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gate_engine")
    tiny = model.make_model(tmp / "model")
    profile = gate.build_profile()  # every acting switch this build has, default coefficients
    return _boot("stock", {}, tiny, tmp), _boot("profile", profile, tiny, tmp), profile


def test_idle_session_resumes_with_its_context_cached_under_swa_thin_and_not_under_stock(boots):
    stock, profile, keys = boots
    assert keys["DSV41_SWA_THIN"] == "1"
    assert stock.cache["resume_cached_frac"] < 0.1
    assert profile.cache["resume_cached_frac"] == 1.0
    assert profile.cache["outputs"]["session_turn2"] == stock.cache["outputs"]["session_turn2"]


def test_the_scheduler_log_shows_decode_steps_between_the_chunks_of_a_long_prompt(boots):
    stock, profile, keys = boots
    if "DSV41_DECODE_YIELD" not in keys:
        pytest.skip("decode_yield is not in this build's registry")
    stock_gaps = gate.decode_steps_between_chunks(stock.log_lines[stock.yield_log_from:])
    yield_gaps = gate.decode_steps_between_chunks(profile.log_lines[profile.yield_log_from:])
    assert stock_gaps and sorted(stock_gaps)[len(stock_gaps) // 2] == 0  # stock: chunk after chunk
    # The yield (the gate's pct 50): each window gives the steps the share still owes, so where a
    # 64-token chunk costs about one of the streams' steps (CI's machine) a window of 0 is right,
    # the balance carrying it into the next; what the log must show is decode steps spread over
    # the whole prompt, at least one for every three chunks.
    thirds = [yield_gaps[i * len(yield_gaps) // 3:(i + 1) * len(yield_gaps) // 3] for i in range(3)]
    # the prompt shows in chunks (yield 23 or 24 gaps in runs here, stock 24)
    assert len(yield_gaps) >= len(stock_gaps) // 2, (stock_gaps, yield_gaps)
    assert all(sum(third) >= 1 for third in thirds), yield_gaps
    assert sum(yield_gaps) >= len(yield_gaps) / 3, yield_gaps
    assert profile.yield_["outputs"]["long"] == stock.yield_["outputs"]["long"]


def test_cone_replay_recomputes_n_tokens_and_returns_what_a_reprefill_returns(boots):
    """The branch's window at F was never cached (decode freed it): stock prefills again from the
    last checkpoint, the cone replays N tokens with the resident Full KV substituted in the replay
    rows, and the branch's greedy tokens and their logprobs match the re-prefill."""
    if not gate.available("cone_replay")[0]:
        pytest.skip("cone_replay is not in this build's registry")
    stock, profile, keys = boots
    n = int(keys["DSV41_SWA_CONE_TOKENS"])
    assert not [line for line in profile.log_lines if "[dsv41] cone_replay refused" in line]
    assert any("[dsv41] cone_replay DSV41_SWA_CONE plan" in line for line in profile.log_lines)
    assert any("[dsv41] cone_replay DSV41_SWA_CONE copy rid=" in line for line in profile.log_lines)
    assert any(f"[dsv41] cone_replay DSV41_SWA_CONE forward rows={n} " in line for line in profile.log_lines)
    assert profile.cache["cone_recomputed_tokens"] == n < stock.cache["cone_recomputed_tokens"]
    assert profile.cache["outputs"]["cone_branch"] == stock.cache["outputs"]["cone_branch"]
    diff = gate.cone_logprob_diff(stock, profile, stock)
    assert diff is not None and diff <= gate.LOGPROB_TOLERANCE
