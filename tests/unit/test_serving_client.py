"""One SGLang benchmark client process serves many runs (devkit/engine_kit/serving_client.py): each
run is the client's own command line, its exit status and output come back per run."""

from __future__ import annotations

import pytest

from devkit.engine_kit.serving_client import ServingClient

pytestmark = pytest.mark.spawns  # one interpreter that imports sglang's benchmark client


def test_one_client_process_runs_the_clients_command_line_twice_and_reports_each_runs_status(tmp_path):
    with ServingClient({"PATH": "/usr/bin:/bin"}, tmp_path) as client:
        bad = client.run(["--backend", "no-such-backend"], tmp_path / "bad.txt", 300)
        helped = client.run(["--help"], tmp_path / "help.txt", 300)
    assert bad == 2 and "invalid choice: 'no-such-backend'" in (tmp_path / "bad.txt").read_text()
    assert helped == 0 and "--gsp-num-turns" in (tmp_path / "help.txt").read_text()


@pytest.mark.parametrize("pinned", [True, False])
def test_a_run_given_a_routing_run_sends_every_group_the_same_key_again(tmp_path_factory, pinned):
    """Upstream's dataset keys each group with a fresh uuid and the clock; a run given
    ``routing_run`` keys group g ``routing_key(name, g)`` on every call, and leaves the module as it was."""
    from transformers import AutoTokenizer

    from devkit.engine_kit import model
    from devkit.engine_kit.serving_client import GSP_MODULE, _routing_keys_of, routing_key

    gsp = __import__(GSP_MODULE, fromlist=["sample_generated_shared_prefix_requests"])
    tokenizer = AutoTokenizer.from_pretrained(str(model.make_model(tmp_path_factory.mktemp("kit") / "model")))

    def keys() -> list[str]:
        rows = gsp.sample_generated_shared_prefix_requests(
            num_groups=2, prompts_per_group=2, system_prompt_len=16, question_len=8, output_len=4, range_ratio=1.0,
            tokenizer=tokenizer, seed=1, send_routing_key=True, num_turns=2)
        return sorted({r.routing_key for r in rows})

    before = (gsp.uuid, gsp.datetime)
    with _routing_keys_of("fleet3" if pinned else None):
        first, second = keys(), keys()
    assert (gsp.uuid, gsp.datetime) == before
    if pinned:
        assert first == second == [routing_key("fleet3", 0), routing_key("fleet3", 1)]
    else:
        assert first != second  # a new uuid a run
