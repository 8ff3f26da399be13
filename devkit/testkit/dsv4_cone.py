"""Cone replay on the DSV4 kit server, side by side in one boot (devkit only: a slow test and a bench).

One boot of SGLang 0.5.23's real server (``devkit.engine_kit.dsv4``: real ``DeepSeekV4TokenToKVPool``,
``DeepseekV4AttnBackend``, ``UnifiedRadixCache``, the seeded tiny C0/C4/C128 checkpoint) run through
:mod:`devkit.engine_kit.dsv4.cone_probe`, whose probe dumps the pool's bytes after each extend
forward and switches the cone's depth / write mask / on-off between phases
(``$CONE_PROBE_DIR/control.json``).

Every phase starts from an empty tree and runs turn 1 (prompt A, F = ``len(A)`` tokens, page-aligned)
then turn 2 = A + B with input logprobs of every row from F (``logprob_start_len = F``):

* ``hit``: turn 2 right after turn 1: the stock prefix hit at F (the exactness reference).
* ``cold``: turn 2 alone on an empty tree: the stock full re-prefill.
* ``evicted`` phases: between the turns, churn prompts push A's SWA window out (Full KV stays);
  then turn 2 runs with the cone at depth N (``cone``; chunk = N + page), at N = the chunk
  (``exact_chunk``: the first pass is exactly ``[s, F)``), one page below the bound (``shallow``),
  without its write mask (``nomask``), with N above the chunk (``short``: falls back), or with the
  cone off (``stock``: the stock recompute).

:func:`run` returns per phase: the prefix the server reported (``cached_tokens``), the time to the
first token (one-token turns: e2e), the input logprobs and top logprobs of rows >= F, and the probe's
dumps (per whole page of each extend: every layer's SWA page and every Full-side page row).
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from devkit.engine_kit import client, launcher
from devkit.engine_kit.dsv4 import checkpoint, launch

PAGE = 256
WINDOW = 128
A_LEN = 2048  # turn 1's prompt (8 pages)
# The resume point after churn: A's last leaf loses its SWA window together with its Full page (a leaf
# is evicted whole), so the deepest node with resident Full KV and an evicted window ends a page short.
F = A_LEN - 256
B_LEN = 512  # turn 2's new tokens; turn 2 = A + B: rows from F are three whole pages
BELOW = F - 256  # a later session resuming one page below F (reads the pages the cone re-published)
CHURN = 4  # 1024-token prompts between the turns: A's SWA window is evicted, its Full KV stays
GEOMETRY = {"max_total_tokens": 16384, "max_running": 2, "chunk": 1024, "swa_ratio": 0.19}
N = 768  # the bound of the kit's C0/C4/C128 model (geometry.cone_bound_dsv4)
TOP = 5
LOGPROB_TOLERANCE = 1e-4  # the gate's (devkit.gate.verdict.LOGPROB_TOLERANCE)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 1024) for _ in range(n)]  # ids below 6 are the tokenizer's specials


class ProbeServer(launcher.Server):
    """The kit server launched through the probe module."""

    def command(self) -> list[str]:
        return ["timeout", "-k", "10", str(self.max_life_s), self.python, "-m",
                "devkit.engine_kit.dsv4.cone_probe", *self.args]


@dataclass
class Kit:
    server: ProbeServer
    probe: Path
    # False: turn 2 asks for the logprobs of its output tokens only (``new_tokens`` greedy tokens).
    # Under decoder SWA bounded replay a request that asks for prompt logprobs runs its whole
    # extend through the late layers (SGLang's ``late_layer_whole_extend``), so only this mode
    # measures the tail-only path a serving request takes.
    prompt_logprobs: bool = True
    new_tokens: int = 1

    @property
    def url(self) -> str:
        return self.server.base_url

    def control(self, **values: Any) -> None:
        (self.probe / "control.json").write_text(json.dumps(values))

    def generate(self, ids: list[int], *, start: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"input_ids": ids, "sampling_params": client.greedy(1)}
        if start is not None and not self.prompt_logprobs:
            body.update(return_logprob=True, top_logprobs_num=TOP, sampling_params=client.greedy(self.new_tokens))
        elif start is not None:
            body.update(return_logprob=True, logprob_start_len=start, top_logprobs_num=TOP)
        t0 = time.monotonic()
        response = requests.post(self.url + "/generate", json=body, timeout=1800)
        response.raise_for_status()
        out = response.json()
        out["e2e_s"] = time.monotonic() - t0
        return out

    def dumps(self, name: str) -> list[dict[str, Any]]:
        import torch

        paths = sorted(self.probe.glob(f"{name}-*.pt"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        return [torch.load(p, weights_only=False) for p in paths]


def boot(workdir: Path, *, tokens: int = N, log_name: str = "server.log", model: Path | None = None,
         extra: tuple[str, ...] = (), prompt_logprobs: bool = True, new_tokens: int = 1) -> Kit:
    """The kit server with the cone at depth ``tokens``; ``model``: a checkpoint folder (default: the
    DSV4 kit's C0/C4/C128), ``extra``: more server flags, ``prompt_logprobs`` / ``new_tokens``:
    see :class:`Kit`."""
    model = checkpoint.make_checkpoint(workdir / "ckpt") if model is None else model
    probe = workdir / "probe"
    shutil.rmtree(probe, ignore_errors=True)
    probe.mkdir(parents=True)
    profile = {"DSV41_SWA_CONE_REPLAY": "1", "DSV41_SWA_CONE_TOKENS": str(tokens)}
    args = launch.server_args(model, launcher.free_port(), extra=extra, **GEOMETRY)
    server = ProbeServer(args, workdir / log_name, profile, ready_timeout_s=900)
    server.env = launch.child_env(profile)
    server.env["CONE_PROBE_DIR"] = str(probe)
    kit = Kit(server, probe, prompt_logprobs, new_tokens)
    kit.control()
    server.start()
    return kit


def _phase(kit: Kit, name: str, *, evict: bool = False, cold: bool = False, turn1: int = A_LEN,
           after: bool = False, below: bool = False, **control: Any) -> dict[str, Any]:
    """One phase (module docstring). ``turn1``: turn 1's length (a stock hit at F runs turn 1 = A[:F]);
    ``after``: no flush and no turn 1 (runs on the tree the previous phase left); ``below``: turn 2
    is A[:BELOW] + C, resumed one page below F."""
    a, b = _ids(1, A_LEN), _ids(2, B_LEN)
    if not after:
        client.flush_cache(kit.url)
    kit.control()
    if not (cold or after):
        kit.control(dump=f"{name}.a")
        kit.generate(a[:turn1])
        kit.control()
    if evict:
        for i in range(CHURN):
            kit.generate(_ids(100 + i, 1024))
    kit.control(dump=name, **control)
    start = BELOW if below else F
    out = kit.generate(a[:BELOW] + _ids(3, B_LEN) if below else a + b, start=start)
    kit.control()
    meta = out["meta_info"]
    which = "input" if kit.prompt_logprobs else "output"
    dumps = kit.dumps(name)
    return {
        "name": name,
        "start": start,
        "cached_tokens": int(meta.get("cached_tokens", -1)),
        "ttft_s": round(out["e2e_s"], 3),
        "token": out["output_ids"][0],
        "tokens": list(out["output_ids"]),
        "logprobs": [row[0] for row in meta[f"{which}_token_logprobs"]],
        "top": [[(t[0], t[1]) for t in row] for row in meta[f"{which}_top_logprobs"] if row is not None],
        "logits": dumps[-1]["logits"] if dumps else None,  # the last extend forward's next-token logits
        "dumps": dumps,
        "turn1": kit.dumps(f"{name}.a"),
    }


PHASES = {
    "hit": dict(turn1=F),  # the stock prefix hit at F: the reference
    "cold": dict(cold=True),  # the stock full re-prefill
    "stock": dict(evict=True, cone=False),  # the stock recompute after churn
    "cone": dict(evict=True),
    "below": dict(after=True, below=True),  # right after "cone": resumes one page below F
    "below_hit": dict(turn1=BELOW, below=True),  # its reference: a stock prefix hit there
    "exact_chunk": dict(evict=True, tokens=GEOMETRY["chunk"]),  # N = chunk: the first pass is exactly [s, F)
    "nomask": dict(evict=True, mask=False),
    "shallow": dict(evict=True, tokens=N - PAGE),
    "short": dict(evict=True, tokens=GEOMETRY["chunk"] + PAGE),  # the first chunk cannot cover [s, F)
}
AFTER = {"below": "cone"}  # phases that read the tree the one before left


def run(workdir: Path, phases: tuple[str, ...] = tuple(PHASES), depths: dict[str, int] | None = None,
        **boot_kwargs: Any) -> dict[str, Any]:
    """The ``phases`` in one boot (:func:`boot`'s ``boot_kwargs``); ``depths``: a phase's cone depth
    in place of its own (``{"shallow": 768}``)."""
    kit = boot(workdir, **boot_kwargs)
    try:
        out = {"startup_s": round(kit.server.startup_s or 0.0, 1)}
        for name in phases:
            after = AFTER.get(name)
            assert after is None or phases[phases.index(name) - 1] == after, f"{name} runs right after {after}"
            t0 = time.monotonic()
            out[name] = _phase(kit, name, **{**PHASES[name], **({"tokens": depths[name]} if name in (depths or {}) else {})})
            print(f"[dsv4 cone] phase {name}: cached {out[name]['cached_tokens']} ttft {out[name]['ttft_s']} s "
                  f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
        out["log"] = kit.server.log_lines()
        return out
    finally:
        kit.server.stop()


# -- comparisons ---------------------------------------------------------------------------------
def pages_at(dumps: list[dict[str, Any]], positions: range) -> dict[int, dict[str, Any]]:
    """The last dump of each whole page starting at ``positions`` (over every forward of a turn)."""
    found: dict[int, dict[str, Any]] = {}
    for d in dumps:
        for req in d["reqs"]:
            for start, page in req["pages"].items():
                if int(start) in positions:
                    found[int(start)] = page
    return found


def page_diffs(a: dict[int, Any], b: dict[int, Any]) -> dict[str, int]:
    """Per region (``swa.<layer>``, ``full.<buffer>``): bytes that differ over the pages of both."""
    import torch

    assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
    out: dict[str, int] = {}
    for start in sorted(a):
        for kind in ("swa", "full"):
            for i, (x, y) in enumerate(zip(a[start][kind], b[start][kind])):
                key = f"{kind}.{i}"
                out[key] = out.get(key, 0) + int((x.view(torch.uint8) != y.view(torch.uint8)).sum())
    return out


def swa_row_diffs(a: dict[int, Any], b: dict[int, Any], layers: range, rows: range) -> dict[str, int]:
    """Per SWA layer of ``layers``: bytes that differ over the rows ``rows`` (absolute positions)
    only, each row its 576 data and 8 scale bytes of the V4 page (``kernels.v4_page_bytes``)."""
    import torch

    from devkit.engine_kit.dsv4.kernels import V4_DATA, V4_SCALE

    out: dict[str, int] = {}
    for start in sorted(set(a) & set(b)):
        lo, hi = max(rows.start, start) - start, min(rows.stop, start + PAGE) - start
        if lo >= hi:
            continue
        for layer in layers:
            x, y = (page["swa"][layer].view(torch.uint8) for page in (a[start], b[start]))
            data = [t[: PAGE * V4_DATA].view(PAGE, V4_DATA)[lo:hi] for t in (x, y)]
            scale = [t[PAGE * V4_DATA : PAGE * (V4_DATA + V4_SCALE)].view(PAGE, V4_SCALE)[lo:hi] for t in (x, y)]
            key = f"swa.{layer}"
            out[key] = out.get(key, 0) + int((data[0] != data[1]).sum()) + int((scale[0] != scale[1]).sum())
    assert out, f"no rows of {rows} in pages {sorted(a)} / {sorted(b)}"
    return out


def logprob_distance(a: dict[str, Any], b: dict[str, Any]) -> float:
    pairs = [(x, y) for x, y in zip(a["logprobs"], b["logprobs"]) if x is not None and y is not None]
    assert len(pairs) >= len(a["logprobs"]) - 1, (a["logprobs"][:3], b["logprobs"][:3])
    return max((abs(x - y) for x, y in pairs), default=0.0)
