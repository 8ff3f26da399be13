"""Two ranks (``--tp 2``) on the CPU engine with the gate's profile (slow: two boots).

SGLang 0.5.23 runs TP=2 on CPU with two environment settings (``devkit.soak.TP2_ENV``: one core
per rank, and PyNccl kept off so the all-reduce is torch.distributed's gloo path). Every requested
switch must install in both scheduler processes, decode-yield windows must be identical on both
ranks (rank 0 measures and broadcasts each window's N on the TP CPU group), and greedy outputs must equal TP=1's where the
arithmetic allows (fp32; the all-reduce sums the two halves of each row-parallel matmul in another
order than one rank does, so equality is expected, not guaranteed: a difference is reported with
the prompt)."""

import pytest

from adapter.core import receipts, registry
from devkit import gate, soak
from devkit.engine_kit import launcher, model
from devkit.engine_kit import workload as wl

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return model.make_model(tmp_path_factory.mktemp("kit") / "model")


def _boot(tiny_model, log, profile, tp):
    args = launcher.server_args(tiny_model, launcher.free_port(), swa_ratio=0.25, extra=["--tp", str(tp)])
    server = launcher.Server(args, log, profile, ready_timeout_s=600, max_life_s=1200)
    server.env.update(soak.TP2_ENV)
    with server:
        probes = soak.run_probes(server.base_url, seed=1)
        streams = wl.run_yield_phase(server.base_url, wl.Workload.quick(), f"tp{tp}")
    return server, probes, streams


def test_two_cpu_ranks_install_every_switch_yield_identically_and_match_one_rank(tiny_model, tmp_path):
    profile = {**gate.build_profile(), "DSV41_DEBUG_LOG": "1"}
    one_rank, probes1, _ = _boot(tiny_model, tmp_path / "tp1.log", profile, 1)
    two, probes2, _ = _boot(tiny_model, tmp_path / "tp2.log", profile, 2)
    lines = two.log_lines()
    parsed = [r for r in map(receipts.parse_line, lines) if r is not None]
    assert not [r for r in parsed if r.refusal], [r for r in parsed if r.refusal]
    # Switches installed at import log the process id (the engine has not named its rank yet):
    # the server's main process and the two scheduler processes, three in all; each scheduler logs
    # them again under its rank once SGLang has published it (the boot's rank hook).
    for name in ("fast_tree_core", "swa_thin", "decode_yield"):
        seen = {r.rank for r in parsed if r.switch == name and r.event == "installed"}
        assert len({r for r in seen if r.startswith("pid")}) == 3 and seen - {r for r in seen if r.startswith("pid")} == {
            "tp0", "tp1"}, (name, seen)
    # receipts counts scheduler ranks only: the TP=2 log passes --ranks 2; without scheduler tp1's
    # lines (its pid lines and the main process's kept) it fails, naming tp0; TP=1's fails too.
    config = registry.resolve(profile)
    assert receipts.audit(lines, config, ranks=2) == []
    gaps = receipts.audit([line for line in lines if "rank=tp1" not in line], config, ranks=2)
    assert gaps and all(g.endswith("installed on 1 of 2 ranks (tp0)") for g in gaps), gaps
    assert {g.split()[0] for g in gaps} == {s.name for s in config.requested}
    one = receipts.audit(one_rank.log_lines(), config, ranks=2)
    assert one and all(g.endswith("installed on 1 of 2 ranks (tp0)") for g in one), one
    assert receipts.audit(one_rank.log_lines(), config, ranks=1) == []
    assert {r.rank for r in parsed if r.switch == "cone_replay" and r.event == "installed"} == {"tp0", "tp1"}
    # the decisions (each rank's measured share and estimates are its own clock's: rank 0's N is broadcast)
    decided = ("n", "given", "chunk", "prefix", "rows", "floor", "ended")
    windows = {rank: [tuple(r.params[k] for k in decided) for r in parsed
                      if r.switch == "decode_yield" and r.event == "window" and r.rank == rank]
               for rank in ("tp0", "tp1")}
    assert windows["tp0"] and windows["tp0"] == windows["tp1"]
    assert probes2 == probes1
