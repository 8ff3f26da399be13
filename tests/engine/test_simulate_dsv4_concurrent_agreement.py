"""``simulate`` against the DSV4 kit server with requests running at once, request by request.

The DSV4 kit (the tiny DeepSeek-V4.1 on SGLang's ``DeepSeekV4TokenToKVPool``: page 256, window 128,
chunk 1024, 3 running rows) booted with a 20-page Full pool and its 12 SWA pages, and the replay at
that geometry. Three waves (:mod:`devkit.engine_kit.agreement`): three prompts, two on a shared
4-page system prompt (the second admitted beside the first's second chunk); their next turns and a
question on the system prompt, each decoding 1,500 tokens, which outgrow the Full pool (the server
retracts request 4); then the next turns of those. Compared per request: ``cached_tokens`` (6 of 9
non-zero under stock) and retractions.

Measured under stock: 8 of 9 agree, the retraction included. Request 5 (the system-prompt question
of the second wave, admitted while the two session turns decode) resumes at the system prompt's
1,024-token checkpoint on the server and at 0 in the replay (:data:`KNOWN`; not yet explained). The
thin + cone case has not been run yet.

Heavy: one boot per profile, the second wave's 4,500 decode steps (many minutes here).
"""

from __future__ import annotations

import random

import pytest

from devkit.engine_kit import agreement, model_kits
from devkit.engine_kit.dsv4 import launch
from overlay_tools.simulate import fleet

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

KIT = model_kits.Dsv4Kit()
PAGE, WINDOW, CHUNK, MAX_RUNNING = 256, 128, model_kits.DSV4_CHUNK, model_kits.DSV4_MAX_RUNNING
FULL, SWA = 20 * PAGE, 12 * PAGE
VOCAB = 1024  # the kit model's (devkit.engine_kit.dsv4.checkpoint)
CONE_TOKENS = KIT.profile_overrides()["DSV41_SWA_CONE_TOKENS"]
PROFILES = {"stock": {}, "thin+cone": {"DSV41_SWA_THIN": "1", "DSV41_SWA_CONE_REPLAY": "1",
                                       "DSV41_SWA_CONE_TOKENS": CONE_TOKENS}}

_rng = random.Random(1)


def _new(n: int) -> tuple[int, ...]:
    return tuple(_rng.randrange(agreement.FIRST_ID, VOCAB) for _ in range(n))


SYSTEM = _new(4 * PAGE)
ASKS = [
    agreement.Ask(0, None, SYSTEM + _new(PAGE), 8), agreement.Ask(0, None, SYSTEM + _new(2 * PAGE), 8),
    agreement.Ask(0, None, _new(3 * PAGE), 8),
    agreement.Ask(1, 0, _new(PAGE), 1500), agreement.Ask(1, 1, _new(PAGE), 1500),
    agreement.Ask(1, None, SYSTEM + _new(PAGE), 1500),
    agreement.Ask(2, 3, _new(PAGE), 8), agreement.Ask(2, 4, _new(PAGE), 8), agreement.Ask(2, 5, _new(PAGE), 8),
]
# request -> (server, replay) cached tokens where they differ under stock (the module docstring)
KNOWN = {5: (1024, 0)}
GEO = fleet.Fleet(page=PAGE, window=WINDOW, chunk=CHUNK, max_running=MAX_RUNNING, tails=0, swa_pool=SWA,
                  full_tokens=FULL, full_source="the server's --max-total-tokens", cone_tokens=int(CONE_TOKENS),
                  cone_bound=0, model="dsv4 kit", profile="-")


@pytest.fixture(scope="module")
def kit_model(tmp_path_factory):
    return KIT.build(tmp_path_factory.mktemp("dsv4") / "model")


def _compare(kit_model, tmp_path, policy):
    agreement.check(ASKS, PAGE)
    server = launch.server(kit_model, tmp_path / "server.log", PROFILES[policy], ready_timeout_s=900.0,
                           max_total_tokens=FULL, max_running=MAX_RUNNING, chunk=CHUNK, swa_ratio=SWA / FULL)
    with server:
        rows = agreement.on_server(server.base_url, ASKS, PAGE)
    replay, _ = agreement.in_replay(ASKS, GEO, policy)
    print(f"\n{policy}\n" + agreement.table(ASKS, rows, replay))
    return rows, replay


@pytest.mark.parametrize("policy", ["stock", "thin+cone"])
def test_simulate_gives_the_dsv4_server_prefix_and_retractions_of_every_concurrent_request(kit_model, tmp_path, policy):
    """Every request's retractions agree and its cached tokens but :data:`KNOWN`'s; under stock
    most prefixes are non-zero and a request is retracted."""
    server, replay = _compare(kit_model, tmp_path, policy)
    assert [r.retractions for r in replay] == [r.retractions for r in server]
    differ = {i: (s.cached, r.cached) for i, (s, r) in enumerate(zip(server, replay, strict=True)) if s.cached != r.cached}
    assert differ == KNOWN if policy == "stock" else set(differ) <= set(KNOWN)
    if policy == "stock":
        assert sum(r.cached > 0 for r in server) >= 2 * len(server) // 3
        assert sum(r.retractions for r in server) >= 1
