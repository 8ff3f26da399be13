"""The model kits the gate, the benches and the engine tests boot: what model each builds, how a server of it starts, what workload fits.

* ``mellum``: the tiny hybrid SWA model (:mod:`devkit.engine_kit.model`; fp32, page 1, window 31,
  ``torch_native`` routed to SGLang's CPU backend).
* ``dsv4``: the tiny DeepSeek-V4.1 model (:mod:`devkit.engine_kit.dsv4.checkpoint`, the fleet's
  model type; bf16, fp8 KV, page 256, window 128, ``--attention-backend dsv4`` on the kit's
  pure-torch stand-ins, :mod:`devkit.engine_kit.dsv4.launch`). Its workload is sized in whole
  256-token pages and chunks, so the same phases act on the paged DeepSeek-V4 pool.

Every boot of one gate run shares the kit's model, seed, server arguments and workload; the boots
differ only in their ``DSV41_*`` profile. The HiCache leg (``--hicache``) passes the host tier's ratio
and write policy to :meth:`Kit.workload`, whose churn then outruns the device SWA pool and the host
tier together (Mellum: :func:`outrun_host_tier`; DSV4: the churn found per host tier setting,
:data:`DSV4_HICACHE_CHURN`), and whose host phase presses the device Full pool (:func:`press_full_pool`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol


class Kit(Protocol):
    name: str

    def build(self, out: Path) -> Path: ...

    def describe(self) -> str: ...

    def server(self, model: Path, log: Path, profile: dict[str, str], extra: Sequence[str],
               plugin: Any = None) -> Any: ...

    def workload(self, quick: bool, hicache_ratio: float | None = None,
                 hicache_write_policy: str | None = None) -> Any: ...

    def profile_overrides(self) -> dict[str, str]: ...


# The HiCache leg's churn: this many times what the device SWA pool and the host tier hold together.
# On the Mellum kit (host ratio 2, write-through) stock + HiCache kept the idle session after 1.04x
# of churn and lost it after 1.67x; twice leaves a margin on both sides of that edge.
OUTRUN = 2.0


def outrun_host_tier(w: Any, hicache_ratio: float, swa_tokens: int, full_tokens: int, kit: str) -> Any:
    """``w`` with enough churn requests to outrun the device SWA pool (``swa_tokens``) and a host tier
    of ``hicache_ratio`` times it, so an idle session's window is gone from both; a clear error when
    that churn would press the Full pool (``full_tokens``) too: the leg would then judge another loss."""
    need = math.ceil(OUTRUN * (1 + hicache_ratio) * swa_tokens / w.churn_tokens)
    return churn_within_full_pool(replace(w, churn_requests=max(w.churn_requests, need)), full_tokens,
                                  f"--hicache with --model {kit} is invalid at --hicache-ratio {hicache_ratio:g}")


def cache_phases_held(w: Any) -> int:
    """The tokens the cache phases (:func:`devkit.engine_kit.workload.run_cache_phases`) put in the
    tree: both sessions' turns, the branch's follow-up and every churn request with its 4 answer tokens."""
    return (w.session_tokens + 2 * w.turn_tokens + w.new_user_tokens + w.cone_tokens + w.cone_followup_tokens
            + w.churn_requests * (w.churn_tokens + 4))


def churn_within_full_pool(w: Any, full_tokens: int, invalid: str) -> Any:
    """``w``, or a clear error (``invalid``: what is invalid) when its cache phases would press the
    Full pool (``full_tokens``): the HiCache leg's rows judge the loss of the SWA window, and with
    the Full pool pressed they would judge another loss."""
    held = cache_phases_held(w)
    if held > full_tokens:
        raise ValueError(f"{invalid}: outrunning the host tier takes {w.churn_requests} churn requests of "
                         f"{w.churn_tokens} tokens, {held} tokens in all, more than the kit's Full pool of {full_tokens} "
                         "(the leg would press the Full pool and judge another loss)")
    return w


# The HiCache leg's host phase: churn of this many times the device Full pool, so the phase's session
# (the oldest leaf) leaves the device while the host tier, ``hicache_ratio`` times the pool, still
# holds its Full KV (write-through copied it there at insert; write-back copies it on eviction).
PRESS = 1.25


def press_full_pool(w: Any, hicache_ratio: float, full_tokens: int, kit: str) -> Any:
    """``w`` with a host phase whose churn presses the device Full pool (``full_tokens``) past the
    phase's session, so its Full KV goes to host; a clear error when the host tier could not hold
    the session after that churn (the leg would judge a loss from both tiers)."""
    churn = math.ceil(PRESS * full_tokens / (w.churn_tokens + 4))
    held = w.host_session_tokens + w.turn_tokens + churn * (w.churn_tokens + 4)
    if held >= hicache_ratio * full_tokens:
        raise ValueError(f"--hicache with --model {kit} is invalid at --hicache-ratio {hicache_ratio:g}: pressing the "
                         f"Full pool of {full_tokens} tokens takes {churn} churn requests of {w.churn_tokens} tokens, "
                         f"{held} tokens in all, more than the host tier holds ({hicache_ratio:g} x {full_tokens}): the "
                         "host phase's session would leave the host too")
    return replace(w, host_churn_requests=churn)


MELLUM_MAX_TOTAL_TOKENS = 16384  # the Full pool
MELLUM_SWA_RATIO = 0.1  # the SWA pool: a tenth of it


@dataclass(frozen=True)
class MellumKit:
    name: str = "mellum"

    def build(self, out: Path) -> Path:
        from devkit.engine_kit import model as mk

        spec = mk.ModelSpec()
        return mk.make_model(out.parent / f"engine_kit_model_{spec.digest()}", spec)

    def describe(self) -> str:
        from devkit.engine_kit import model as mk

        return f"mellum (window {mk.ModelSpec().window}, page 1)"

    def server(self, model: Path, log: Path, profile: dict[str, str], extra: Sequence[str],
               plugin: Any = None) -> Any:
        from devkit.engine_kit import launcher

        args = launcher.server_args(model, launcher.free_port(), max_total_tokens=MELLUM_MAX_TOTAL_TOKENS,
                                    swa_ratio=MELLUM_SWA_RATIO, extra=list(extra))
        if plugin is None:  # the import hook: sitecustomize.py on PYTHONPATH
            return launcher.Server(args, log, profile)
        return launcher.Server(args, log, profile, python=str(plugin.python),
                               env=plugin.server_env(launcher.child_env(profile)), cwd=plugin.cwd)

    def workload(self, quick: bool, hicache_ratio: float | None = None,
                 hicache_write_policy: str | None = None) -> Any:
        from devkit.engine_kit import workload as wl

        w = wl.Workload.quick() if quick else wl.Workload.full()
        if hicache_ratio is None:
            return w
        w = outrun_host_tier(w, hicache_ratio, int(MELLUM_MAX_TOTAL_TOKENS * MELLUM_SWA_RATIO),
                             MELLUM_MAX_TOTAL_TOKENS, self.name)
        return press_full_pool(w, hicache_ratio, MELLUM_MAX_TOTAL_TOKENS, self.name)

    def profile_overrides(self) -> dict[str, str]:
        return {}  # the registry's gate roles are set for this kit


# The DSV4 kit's pool, found on the real DSV4 pool and scheduler in-process first
# (devkit.testkit.scheduler, dsv4=True; tests/upstream/test_gate_dsv4_geometry.py) and then on the
# server: 64 pages of Full KV, room for the whole workload, so the churn evicts SWA windows (and whole
# leaves) but the branched prompt's inner Full KV stays; 12 SWA pages. The churn is 2 requests of
# 3072 tokens (three chunks): SWA thin keeps a prompt's last chunk checkpoint as stock does (a later
# request may branch there) and demotes the one its middle chunk passes, so two-chunk churn would
# leave thin nothing to act on. Stock's LRU order evicts the idle session's resume point and the
# branched prompt's checkpoint and window; SWA thin's order evicts the passed checkpoints and the
# (older) branched prompt's leaf first and keeps the idle session's. (16 SWA pages: stock keeps it.)
DSV4_MAX_TOTAL_TOKENS = 64 * 256
DSV4_MAX_RUNNING = 3  # the yield phase's 2 streams and its long prompt
# Four pages a chunk: a cone replay's first chunk must cover [s, F) (N = 768 plus the new message),
# else it falls back to the stock match (first_chunk_short, seen at 256).
DSV4_CHUNK = 4 * 256
DSV4_SWA_RATIO = 12 * 256 / DSV4_MAX_TOTAL_TOKENS
# The HiCache leg on this kit (found in-process on the real DSV4 pool, scheduler and HiCache first,
# tests/upstream/test_gate_dsv4_hicache_geometry.py, then on the server). The Mellum rule
# (OUTRUN x what the SWA pool and the host tier hold) does not carry over: a DSV4 kit request leaves
# only its windows and chunk checkpoints in the SWA pool, not its prompt, and that rule asks for 6
# churn requests (21,064 tokens, past the 64-page Full pool). The churn is what was found per host
# tier setting (ratio, write policy): the count at which stock + HiCache has lost the idle session
# (from both tiers) and the branch's window while SWA thin still keeps the session. The window is one
# request wide at every setting tried (12 SWA pages, churn requests at which stock + HiCache lost it
# / thin lost it: ratio 1 write-through 2 / 3, ratio 2 write-through 4 / 5, ratio 2 write-back 6 / 7,
# ratio 4 write-through 8 / not reached at 8; the last two press the Full pool). The table holds the
# profile's setting, the one run on the server.
DSV4_HICACHE_CHURN: dict[tuple[float, str], int] = {(2.0, "write_through"): 4}
# The host phase's session: two chunks. A one-chunk session is one leaf, which leaves both tiers
# whole: its resume finds no Full KV on host and the cone plans nothing (in-process: no load at any
# churn). With two (as in devkit/testkit/dsv4_cone_hicache.py), the resume finds Full KV on host up
# to a page short of the prompt's end, and the cone loads it back.
DSV4_HOST_SESSION_TOKENS = 2 * DSV4_CHUNK


def dsv4_hicache_churn(w: Any, hicache_ratio: float, write_policy: str | None, full_tokens: int, kit: str) -> Any:
    """``w`` with the DSV4 kit's churn for this host tier (:data:`DSV4_HICACHE_CHURN`); a clear error
    naming the setting and the ones found when it has none, or when that churn presses the Full pool."""
    invalid = (f"--hicache with --model {kit} is invalid at --hicache-ratio {hicache_ratio:g} "
               f"--hicache-write-policy {write_policy}")
    churn = DSV4_HICACHE_CHURN.get((float(hicache_ratio), write_policy or ""))
    if churn is None:
        found = ", ".join(f"--hicache-ratio {r:g} --hicache-write-policy {p}" for r, p in DSV4_HICACHE_CHURN)
        raise ValueError(f"{invalid}: the kit's HiCache churn was found for {found} only (the churn where stock + "
                         "HiCache loses the idle session and SWA thin keeps it is one request wide and moves with the "
                         "host tier: find it in-process, tests/upstream/test_gate_dsv4_hicache_geometry.py)")
    return churn_within_full_pool(replace(w, churn_requests=churn), full_tokens, invalid)


@dataclass(frozen=True)
class Dsv4Kit:
    name: str = "dsv4"
    model_type: str = "deepseek_v41"

    def build(self, out: Path) -> Path:
        from devkit.engine_kit.dsv4 import checkpoint

        return checkpoint.make_checkpoint(out.parent / f"dsv4_kit_model_{self.model_type}", model_type=self.model_type)

    def describe(self) -> str:
        return f"dsv4 ({self.model_type}, 3 layers C0/C4/C128, window 128, page 256, fp8 KV)"

    def server(self, model: Path, log: Path, profile: dict[str, str], extra: Sequence[str],
               plugin: Any = None, chunk: int = DSV4_CHUNK, port: int | None = None) -> Any:
        from devkit.engine_kit.dsv4 import launch

        if plugin is not None:  # devkit.gate.ways.check refuses it before any boot
            raise ValueError("the DeepSeek-V4 kit boots through the import hook only")
        return launch.server(model, log, profile, ready_timeout_s=600.0, max_total_tokens=DSV4_MAX_TOTAL_TOKENS,
                             max_running=DSV4_MAX_RUNNING, chunk=chunk, swa_ratio=DSV4_SWA_RATIO,
                             extra=list(extra), port=port)

    def workload(self, quick: bool, hicache_ratio: float | None = None,
                 hicache_write_policy: str | None = None) -> Any:
        from devkit.engine_kit import workload as wl

        page = 256
        # Whole pages everywhere. The branched session is a two-chunk prompt (checkpoint at 1024)
        # with a short answer, branched at F = 1792 inside the prompt: prefill-written KV only
        # (decode-written KV differs from a re-prefill's by rounding on DSV4, see the workload's
        # docstring). After the churn F has Full KV but no window; stock resumes at 0 (the
        # checkpoint is gone too), a cone of N = 768 at s = 1024: 768 tokens recomputed, not 1792.
        # Its first turn runs before the idle session's (one chunk, resume point 512).
        w = wl.Workload(
            session_tokens=2 * page, cone_prompt_tokens=8 * page, cone_tokens=8 * page + 8, cone_branch_at=7 * page,
            cone_branch_in_prompt=True, cone_first=True,
            churn_requests=2, churn_tokens=12 * page, turn_tokens=8, new_user_tokens=24,
            streams=2, stream_prompt_tokens=32, stream_max_tokens=600,
            long_prompt_tokens=(8 if quick else 16) * page, before_s=2.0, timeout_s=900.0,
        )
        if hicache_ratio is None:
            return w
        w = dsv4_hicache_churn(replace(w, host_session_tokens=DSV4_HOST_SESSION_TOKENS), hicache_ratio,
                               hicache_write_policy, DSV4_MAX_TOTAL_TOKENS, self.name)
        return press_full_pool(w, hicache_ratio, DSV4_MAX_TOTAL_TOKENS, self.name)

    def profile_overrides(self) -> dict[str, str]:
        # Replay depth: a page multiple at least the kit model's bound (cone_replay checks it at
        # cache build; 768 for 3 layers C0/C4/C128, window 128, page 256).
        return {"DSV41_SWA_CONE_TOKENS": "768"}


KITS: dict[str, Kit] = {"mellum": MellumKit(), "dsv4": Dsv4Kit()}


def kit(name: str) -> Kit:
    try:
        return KITS[name]
    except KeyError:
        raise ValueError(f"--model {name!r} is invalid: expected one of {', '.join(KITS)}") from None
