"""``simulate`` against the Mellum kit server with requests running at once, request by request.

Three waves (:mod:`devkit.engine_kit.agreement`: a wave is one batched ``/generate`` call, so its
requests join the scheduler's queue in one pass on every boot): four prompts, three of them on a
shared 100-token system prompt; then their next turns and a fourth question on the system prompt,
each decoding 300 tokens; then the next turns of those. At chunk 64 the prompts are chunked and
admitted beside each other's chunks; the second wave's rows decode together until the 512-slot SWA
pool runs out and the server retracts one (request 5; request 7 waits, then finds the system
prompt's window evicted). The server is booted at that geometry (``--max-total-tokens 1024``,
``--swa-full-tokens-ratio 0.5``, ``--max-running-requests 4``) and the replay runs at it. Compared
per request: the prefix it ran from (``cached_tokens``: 9 of 12 non-zero under stock) and its
retractions.

Where the replay still differs (:data:`KNOWN`): request 9 continues the retracted request 5, whose
re-prefill ends where it was retracted. The server retracts it two decode steps later than the
replay (135 output tokens, not 133): from the wave's first decode step the server's SWA pool has 7
more slots free (and its Full pool 3 fewer) than the replay's; not yet explained.

The replay agrees because its admission reserves the running rows' future decode tokens as
SGLang's ``PrefillAdder`` does: a replay whose adder ignores the running batch
(:func:`_admission_without_running_batch`) admits the second wave at once and differs on 7 of 12.

Stock runs in CI's lane (one boot: 99 s and 145 s in two runs here); SWA thin beside it is ``heavy``.
"""

from __future__ import annotations

import random

import pytest

from devkit.engine_kit import agreement, launcher, model
from overlay_tools.simulate import fleet

pytestmark = pytest.mark.slow

PAGE, WINDOW, CHUNK = 1, 31, 64
FULL, SWA_RATIO, MAX_RUNNING = 1024, 0.5, 4
VOCAB = 1024  # the kit model's (devkit.engine_kit.model.ModelSpec)
PROFILES = {"stock": {}, "thin": {"DSV41_SWA_THIN": "1"}}

_rng = random.Random(0)


def _new(n: int) -> tuple[int, ...]:
    return tuple(_rng.randrange(agreement.FIRST_ID, VOCAB) for _ in range(n))


SYSTEM = _new(100)
ASKS = [
    agreement.Ask(0, None, SYSTEM + _new(20), 16), agreement.Ask(0, None, SYSTEM + _new(30), 16),
    agreement.Ask(0, None, SYSTEM + _new(10), 16), agreement.Ask(0, None, _new(90), 16),
    agreement.Ask(1, 0, _new(20), 300), agreement.Ask(1, 1, _new(20), 300), agreement.Ask(1, 2, _new(20), 300),
    agreement.Ask(1, None, SYSTEM + _new(40), 300),
    agreement.Ask(2, 4, _new(20), 8), agreement.Ask(2, 5, _new(20), 8), agreement.Ask(2, 6, _new(20), 8),
    agreement.Ask(2, 7, _new(20), 8),
]
# request -> (server, replay) cached tokens where they differ (the module docstring)
KNOWN = {9: (300, 298)}
GEO = fleet.Fleet(page=PAGE, window=WINDOW, chunk=CHUNK, max_running=MAX_RUNNING, tails=0, swa_pool=int(FULL * SWA_RATIO),
                  full_tokens=FULL, full_source="the server's --max-total-tokens", cone_tokens=64, cone_bound=0,
                  model="mellum kit", profile="-")


@pytest.fixture(scope="module")
def kit_model(tmp_path_factory):
    return model.make_model(tmp_path_factory.mktemp("kit") / "model")


def _server_rows(kit_model, log, profile) -> list[agreement.Row]:
    args = launcher.server_args(kit_model, launcher.free_port(), max_total_tokens=FULL, chunk=CHUNK,
                                swa_ratio=SWA_RATIO, extra=["--max-running-requests", str(MAX_RUNNING)])
    with launcher.Server(args, log, profile) as server:
        rows = agreement.on_server(server.base_url, ASKS, PAGE)
        logged = sum("KV cache pool is full. Retract requests." in line for line in server.log_lines())
    assert logged >= 1 and sum(r.retractions for r in rows) >= logged  # the log says the pool ran out too
    return rows


def _admission_without_running_batch(monkeypatch) -> None:
    """The replay's ``PrefillAdder`` built without the running batch: nothing reserved for the
    rows already decoding."""
    from overlay_tools.simulate import cone_turn

    real = cone_turn._prefill_adder
    monkeypatch.setattr(cone_turn, "_prefill_adder",
                        lambda kit, chunk, running_batch=None, new_token_ratio=0.0, input_budget=1 << 30:
                        real(kit, chunk, None, 0.0, input_budget))


def _compare(kit_model, tmp_path, policy):
    agreement.check(ASKS, PAGE)
    server = _server_rows(kit_model, tmp_path / "server.log", PROFILES[policy])
    replay, _ = agreement.in_replay(ASKS, GEO, policy)
    print(f"\n{policy}\n" + agreement.table(ASKS, server, replay))
    return server, replay


def _differences(server, replay) -> dict[int, tuple[int, int]]:
    assert [r.retractions for r in replay] == [r.retractions for r in server]
    return {i: (s.cached, r.cached) for i, (s, r) in enumerate(zip(server, replay, strict=True)) if s.cached != r.cached}


def test_stock_simulate_gives_the_server_prefix_and_retractions_of_every_concurrent_request(
        kit_model, tmp_path, monkeypatch):
    """Stock: every request's retractions agree and its cached tokens too but :data:`KNOWN`'s; most
    prefixes are non-zero and one request is retracted; a replay admitting without the running
    batch's reservation differs on most requests."""
    server, replay = _compare(kit_model, tmp_path, "stock")
    assert _differences(server, replay) == KNOWN
    assert sum(r.cached > 0 for r in server) >= 2 * len(server) // 3
    assert [r.retractions for r in server] == [0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0]
    _admission_without_running_batch(monkeypatch)
    broken, _ = agreement.in_replay(ASKS, GEO, "stock")
    assert len({i for i, (s, b) in enumerate(zip(server, broken, strict=True))
                if (s.cached, s.retractions) != (b.cached, b.retractions)}) >= 6


@pytest.mark.heavy
def test_thin_simulate_gives_the_server_prefix_and_retractions_of_every_concurrent_request(kit_model, tmp_path):
    """SWA thin: the same agreement, request by request (the same residual allowed)."""
    server, replay = _compare(kit_model, tmp_path, "thin")
    assert set(_differences(server, replay)) <= set(KNOWN)
