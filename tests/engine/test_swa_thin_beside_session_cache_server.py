"""SWA thin and SGLang's session radix cache both on, on the Mellum kit server (one boot): each does
its part (``bench swa-thin``'s thin+session row, :mod:`devkit.bench.swa_thin.kit`).

* thin installs on the server built with ``--enable-session-radix-cache`` (the Python tree core);
* under SWA pressure alone the agent that sends no session id (B) keeps its resume point: thin's
  part (the session tag does not reach B; the bench's ``session`` row loses it);
* when the sub-agent traffic outruns the Full pool, the agent that sends its session id (A) keeps its
  resume point, Full KV included: the session cache's part (thin reorders only the SWA LRU; the
  bench's ``thin`` row loses both) and B loses its own.
"""

from __future__ import annotations

import pytest

from adapter.core import receipts, registry
from devkit.bench.swa_thin import kit as sk
from devkit.engine_kit import model_kits

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def both_on(tmp_path_factory):
    out = tmp_path_factory.mktemp("thin_session")
    model = model_kits.MellumKit().build(out / "model")
    return sk.run_boot("thin+session", model, out)


def test_thin_installs_on_a_server_with_the_session_radix_cache(both_on):
    assert both_on["thin"] == "installed"
    assert receipts.audit(both_on["log"], registry.resolve({"DSV41_SWA_THIN": "1"}), ranks=1) == []


def test_the_agent_without_a_session_id_keeps_its_resume_point_under_swa_pressure(both_on):
    assert sk.row("thin+session", "swa", both_on["phases"]["swa"]).hits == ["A", "B"]


def test_the_agent_with_a_session_id_keeps_its_resume_point_when_traffic_outruns_the_full_pool(both_on):
    resumes = both_on["phases"]["full"]
    assert sk.row("thin+session", "full", resumes).hits == ["A"]
    assert resumes[0].agent == "A" and resumes[0].cached == resumes[0].resume_point
