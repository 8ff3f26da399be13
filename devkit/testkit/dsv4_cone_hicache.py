"""Cone replay beside HiCache on the DSV4 kit server (devkit only: a slow test).

One boot of SGLang 0.5.23's real server serving the tiny DeepSeek-V4 (or V4.1) checkpoint through
:mod:`devkit.engine_kit.dsv4.cone_probe` (its ``control.json`` turns the cone off for a phase), with
HiCache write-back at host ratio 1 and the Python tree core (as ``DSV41_SWA_THIN=1`` selects it).
Every phase starts from an empty tree (``/flush_cache``) and runs turn 1 (prompt A, ``A_LEN`` tokens)
then turn 2 = A + B with the logprobs of every row from the session's end (``START``). The resume point
F is where the match's Full KV ends (the cone's plan line says it: a page short of A on the kits,
whose last leaf leaves both tiers whole):

* ``hit``: turn 2 right after turn 1: the stock prefix hit at the session's end (the reference);
* ``cold``: turn 2 alone: the stock full re-prefill;
* ``stock``: between the turns, churn prompts push A's Full KV to host (write-back on eviction) and
  its window out of both tiers (the host SWA pool, as small as the device's, evicts oldest first);
  turn 2 with the cone off: stock + HiCache;
* ``cone``: the same churn, turn 2 with the cone: it loads A's Full KV back from host and replays N.

:func:`run` returns per phase the prefix the server reported (``cached_tokens``), the logprobs and
top logprobs of rows >= START, the greedy token, and the boot's log.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from devkit.engine_kit import client, launcher
from devkit.engine_kit.dsv4 import checkpoint, launch
from devkit.testkit.dsv4_cone import GEOMETRY, Kit, N, ProbeServer, _ids

A_LEN = 2048  # turn 1's prompt (8 pages)
START = A_LEN  # turn 2's logprobs start at the session's end (the resume point F is the plan line's)
B_LEN = 512
CHURN_LEN = 2048  # each churn prompt; CHURN of them press the Full pool (16,384 tokens) past A
CHURN = 10
HICACHE = ("--enable-hierarchical-cache", "--hicache-ratio", "1", "--hicache-write-policy", "write_back")


def boot(workdir: Path, *, model: Path | None = None, extra: tuple[str, ...] = (), tokens: int = N) -> Kit:
    """The kit server with HiCache (:data:`HICACHE`), the cone at depth ``tokens`` and the Python
    tree core; ``model``: a checkpoint folder (default: the DSV4 kit's C0/C4/C128)."""
    model = checkpoint.make_checkpoint(workdir / "ckpt") if model is None else model
    probe = workdir / "probe"
    shutil.rmtree(probe, ignore_errors=True)
    probe.mkdir(parents=True)
    profile = {"DSV41_SWA_CONE_REPLAY": "1", "DSV41_SWA_CONE_TOKENS": str(tokens), "DSV41_SWA_THIN": "1"}
    args = launch.server_args(model, launcher.free_port(), extra=(*extra, *HICACHE), **GEOMETRY)
    server = ProbeServer(args, workdir / "server.log", profile, ready_timeout_s=900)
    server.env = launch.child_env(profile)
    server.env["CONE_PROBE_DIR"] = str(probe)
    kit = Kit(server, probe)
    kit.control()
    server.start()
    return kit


def _turn2(kit: Kit) -> dict[str, Any]:
    out = kit.generate(_ids(1, A_LEN) + _ids(2, B_LEN), start=START)
    meta = out["meta_info"]
    return {"cached_tokens": int(meta.get("cached_tokens", -1)), "token": out["output_ids"][0],
            "logprobs": [row[0] for row in meta["input_token_logprobs"]],
            "top": [[(t[0], t[1]) for t in row] for row in meta["input_top_logprobs"] if row is not None],
            "e2e_s": round(out["e2e_s"], 3)}


def _phase(kit: Kit, name: str, churn: int) -> dict[str, Any]:
    client.flush_cache(kit.url)
    kit.control()
    if name != "cold":
        kit.generate(_ids(1, A_LEN))
    for i in range(churn if name in ("stock", "cone") else 0):
        kit.generate(_ids(1000 * (1 + ("stock", "cone").index(name)) + i, CHURN_LEN))
    time.sleep(0.5)  # write-back acks drain on the scheduler's next passes
    kit.control(cone=name != "stock")
    out = _turn2(kit)
    kit.control()
    return out


def run(workdir: Path, *, churn: int = CHURN, phases: tuple[str, ...] = ("hit", "cold", "stock", "cone"),
        **boot_kwargs: Any) -> dict[str, Any]:
    kit = boot(workdir, **boot_kwargs)
    try:
        out: dict[str, Any] = {"startup_s": round(kit.server.startup_s or 0.0, 1)}
        for name in phases:
            t0 = time.monotonic()
            out[name] = _phase(kit, name, churn)
            print(f"[dsv4 cone hicache] phase {name}: cached {out[name]['cached_tokens']} "
                  f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
        out["log"] = kit.server.log_lines()
        return out
    finally:
        kit.server.stop()


def cone_lines(log: list[str]) -> list[str]:
    return [line for line in log if "DSV41_SWA_CONE" in line or "cone_replay installed" in line]


if __name__ == "__main__":  # python -m devkit.testkit.dsv4_cone_hicache WORKDIR [CHURN]
    figures = run(Path(sys.argv[1]), churn=int(sys.argv[2]) if len(sys.argv) > 2 else CHURN)
    print("\n".join(cone_lines(figures["log"])))
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk in ("cached_tokens", "token", "e2e_s")}
                      for k, v in figures.items() if isinstance(v, dict)}))

