"""End-to-end: SGLang 0.5.23's HTTP server on CPU through the kit's launcher (slow: each boot takes
20-120 s on a shared 2-core machine). One server at a time, always stopped."""

import socket

import pytest

from adapter.core import receipts, registry
from devkit.engine_kit import client, launcher, model, workload

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return model.make_model(tmp_path_factory.mktemp("kit") / "model")


def test_server_boots_on_cpu_with_the_overlay_logs_its_receipts_and_generates_greedily(tiny_model, tmp_path):
    profile = {"DSV41_SWA_THIN": "1"}
    server = launcher.Server(launcher.server_args(tiny_model, launcher.free_port()), tmp_path / "server.log", profile)
    with server:
        ids = workload.Workload().ids("boot", 300)
        first = client.generate(server.base_url, ids, 12)
        second = client.generate(server.base_url, ids, 12)
        group = server.proc.pid
    assert launcher.members(group) == []
    lines = server.log_lines()
    assert receipts.audit(lines, registry.resolve(profile), ranks=1) == []
    assert any("[dsv41] swa_thin installed" in line for line in lines)
    assert any("Tree cache initialized" in line and "hybrid_swa=True" in line for line in lines)
    assert len(first["output_ids"]) == 12 and first["output_ids"] == second["output_ids"]
    assert first["meta_info"]["cached_tokens"] == 0 and second["meta_info"]["cached_tokens"] == 299


def test_a_server_whose_port_another_process_took_boots_again_on_a_fresh_port(tiny_model, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = launcher.Server(launcher.server_args(tiny_model, port), tmp_path / "server.log", {})
        with server:
            assert server.port != port and server.args[server.args.index("--port") + 1] == str(server.port)
            assert len(client.generate(server.base_url, [5, 6, 7], 2)["output_ids"]) == 2
    text = server.log_text()
    assert launcher.PORT_TAKEN in text and f"[launcher] port {port} was taken" in text
    assert launcher.members(server.proc.pid) == []


def test_launcher_leaves_no_process_behind_when_the_server_fails_to_boot(tmp_path):
    missing = tmp_path / "no-model-here"
    server = launcher.Server(launcher.server_args(missing, launcher.free_port()), tmp_path / "server.log", {})
    with pytest.raises(launcher.ServerFailed, match="exited with code"):
        server.start()
    assert server.proc is not None and server.proc.poll() is not None
    assert launcher.members(server.proc.pid) == []


def test_launcher_stops_every_process_of_a_server_that_is_not_ready_in_time(tiny_model, tmp_path):
    # A ready line the server never prints: it is stopped at the deadline, with its children
    # (scheduler, detokenizer) started or starting, whatever the machine's speed.
    server = launcher.Server(launcher.server_args(tiny_model, launcher.free_port()), tmp_path / "server.log", {},
                             ready_timeout_s=45, ready_line="a line the server never prints")
    with pytest.raises(launcher.ServerFailed, match="not ready after 45 s"):
        server.start()
    assert launcher.members(server.proc.pid) == []
