"""The kit rows of ``bench swa-thin``: SWA thin beside SGLang's session radix cache on the Mellum kit
server (window 31, page 1, chunk 64, Full pool 16,384 tokens, SWA pool 1,638).

Four boots, one at a time, differing only in the server: ``stock``; ``thin`` (``DSV41_SWA_THIN=1``);
``session`` (``--enable-session-radix-cache``); ``thin+session`` (both). The client is the same on
every boot. Agent A's client sends its session's id as the request's top-level ``session_id``
(``GenerateReqInput.session_id``; with the flag on, the scheduler's "radix-native session": the
finished turn's KV is tagged by ``UnifiedSessionRefTracker``) and keeps its session open while idle;
agent B's client sends no session id. Each sub-agent turn sends its own session id and closes it with
``/close_session`` when its turn is done (``release_radix_session``: it only dereferences). Without
the flag the server ignores both (a plain request; the close logs that no such session exists).

Per boot, two phases from an empty cache (``/flush_cache``), each: A's and B's first turns (1,024
prompt tokens, 8 out), then sub-agent turns of 512 tokens (eight 64-token chunks, 4 out), then A's
and B's next turns (their history + 24 new tokens, streamed: time to first token):

* ``swa``: 10 sub-agent turns (5,160 tokens of Full KV: the Full pool keeps everything, the SWA pool
  does not: the idle sessions' windows are what is lost);
* ``full``: 36 sub-agent turns (18,576 tokens, more than the Full pool: the idle sessions' Full KV is
  evicted too, in stock LRU order, unless something holds it).

Per row (policy x phase): resume hits (a resumed turn whose cached tokens reach its resume point,
its history less the last output token, whose KV is never written), prompt tokens recomputed (the
resumed turns' prompt tokens less their cached tokens) and the resumed turns' TTFT.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SESSION_FLAG = "--enable-session-radix-cache"
POLICIES = ("stock", "thin", "session", "thin+session")
PHASES = {"swa": 10, "full": 36}  # sub-agent turns per phase
CONTEXT, OUT, SUBAGENT, SUBAGENT_OUT, NEW_USER = 1024, 8, 512, 4, 24
AGENTS = {"A": "agent-a", "B": None}  # B's client sends no session id


@dataclass(frozen=True)
class Policy:
    name: str
    thin: bool
    session: bool

    @property
    def profile(self) -> dict[str, str]:
        return {"DSV41_SWA_THIN": "1"} if self.thin else {}

    @property
    def extra(self) -> list[str]:
        return [SESSION_FLAG] if self.session else []


def policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"kit row policy {name!r} is invalid: expected one of {', '.join(POLICIES)}")
    return Policy(name, thin="thin" in name, session="session" in name)


@dataclass(frozen=True)
class Resume:
    """One idle agent's next turn: what the server reported for it."""

    agent: str
    history: int  # the first turn's prompt + output tokens
    prompt: int  # the resumed turn's prompt tokens (history + new user tokens)
    cached: int  # the server's cached_tokens for it
    ttft_s: float

    @property
    def resume_point(self) -> int:
        return self.history - 1  # the last output token's KV is never written

    @property
    def hit(self) -> bool:
        return self.cached >= self.resume_point

    @property
    def recomputed(self) -> int:
        return self.prompt - self.cached


@dataclass(frozen=True)
class Row:
    policy: str
    phase: str
    hits: list[str]  # the agents whose resume point held
    resumes: int
    recomputed: int
    ttft_ms: float


def row(policy_name: str, phase: str, resumes: list[Resume]) -> Row:
    return Row(policy_name, phase, [r.agent for r in resumes if r.hit], len(resumes),
               sum(r.recomputed for r in resumes), round(1000 * statistics.mean(r.ttft_s for r in resumes), 1))


def _ids(tag: str, n: int, vocab: int = 1024) -> list[int]:
    import random

    rng = random.Random(tag)
    return [rng.randrange(6, vocab) for _ in range(n)]  # ids below 6 are the kit tokenizer's specials


def run_phase(url: str, phase: str, api: Any = None) -> list[Resume]:
    """One phase on a running server (``api``: :mod:`devkit.engine_kit.client` by default)."""
    if api is None:
        from devkit.engine_kit import client as api

    api.flush_cache(url)
    history = {}
    for agent, sid in AGENTS.items():
        prompt = _ids(f"{phase}:{agent}", CONTEXT)
        history[agent] = prompt + api.generate(url, prompt, OUT, session_id=sid)["output_ids"]
    for i in range(PHASES[phase]):
        sid = f"{phase}-subagent-{i}"
        api.generate(url, _ids(f"{phase}:sub{i}", SUBAGENT), SUBAGENT_OUT, session_id=sid)
        api.close_session(url, sid)
    resumes = []
    for agent, sid in AGENTS.items():
        prompt = history[agent] + _ids(f"{phase}:{agent}:next", NEW_USER)
        r = api.generate_streamed(url, prompt, OUT, session_id=sid)
        resumes.append(Resume(agent, len(history[agent]), len(prompt), int(r["meta_info"].get("cached_tokens") or 0),
                              r["ttft_s"]))
    return resumes


def thin_state(log_lines: list[str]) -> str:
    """``installed`` / ``inactive`` / ``refused`` / ``off`` from the boot's receipts."""
    text = "\n".join(log_lines)
    for state in ("refused", "inactive"):
        if f"swa_thin {state}" in text:
            return state
    return "installed" if "[dsv41] swa_thin installed" in text else "off"


def run_boot(name: str, model: Path, out: Path) -> dict[str, Any]:
    """One boot of the Mellum kit server for ``name``: each phase's resumes and the thin receipt."""
    from devkit.engine_kit import launcher, model_kits

    p = policy(name)
    server = model_kits.MellumKit().server(model, out / f"{name.replace('+', '_')}.log", p.profile, p.extra)

    def work(s: Any) -> dict[str, Any]:
        return {"phases": {phase: run_phase(s.base_url, phase) for phase in PHASES}}

    result = launcher.serve(server, work)
    if result["survivors"]:
        raise RuntimeError(f"the {name} kit server left processes behind: {result['survivors']}")
    return {**result, "thin": thin_state(result["log"])}


def run(out: Path, say: Callable[[str], None] = print) -> dict[str, Any]:
    """The four boots; the table printed; per row the figures."""
    from adapter.ops import table
    from devkit.engine_kit import model_kits

    t0 = time.monotonic()
    model = model_kits.MellumKit().build(out / "model")
    rows, receipts = [], {}
    for name in POLICIES:
        boot = run_boot(name, model, out)
        receipts[name] = boot["thin"]
        if policy(name).thin and boot["thin"] != "installed":
            raise RuntimeError(f"SWA thin did not install on the {name} boot ({boot['thin']}); log {out}")
        rows += [row(name, phase, resumes) for phase, resumes in boot["phases"].items()]
    say(f"\nthe Mellum kit server (window 31, Full pool 16,384, SWA pool 1,638): idle agents A (sends a session id, "
        f"session left open) and B (no session id), {CONTEXT}-token contexts, resumed after sub-agent turns of "
        f"{SUBAGENT} tokens (swa: {PHASES['swa']}, within the Full pool; full: {PHASES['full']}, past it)")
    say(table.render(["policy", "phase", "resume hits", "hit agents", "tokens recomputed", "TTFT ms (mean)"],
                     [[r.policy, r.phase, f"{len(r.hits)} / {r.resumes}", ",".join(r.hits) or "-", r.recomputed,
                       r.ttft_ms] for r in rows], align="left"))
    say(f"SWA thin receipts: {receipts}; {time.monotonic() - t0:.0f} s for four boots (a shared machine: TTFT is noisy)")
    return {f"{r.policy}:{r.phase}": {"resume_hits": len(r.hits), "hit_agents": r.hits,
                                      "recomputed_tokens": r.recomputed, "ttft_ms": r.ttft_ms} for r in rows}
