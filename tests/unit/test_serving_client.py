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
