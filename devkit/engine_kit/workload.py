"""The agent-style workload the gate runs on every boot (same ids, same order on each).

Three phases, each starting from an empty radix cache (``/flush_cache``):

1. ``resume``: a long session prefills and decodes a turn, goes idle while other traffic (churn)
   fills the SWA pool, then resumes with its context plus a new user message. SGLang's own
   ``cached_tokens`` (``--enable-cache-report``) says how much of the context was still usable.
2. ``cone``: in the same phase a second session (a short prompt and a long answer) is branched
   inside its answer after the churn, as an agent edits or retries from the middle of a reply:
   the Full KV of the branch point F is resident, but no SWA window at F is (decode frees the
   window behind it, and the answer leaves no checkpoint before its end), so stock resumes at the
   last checkpoint below F (the prompt's, if the churn left it) or at 0. The branch sits more than
   a chunk from that checkpoint, so a cone replay of N tokens recomputes less. The recomputed
   tokens (``cone_branch_at - cached_tokens``) show what the engine prefilled again.
   With ``cone_branch_in_prompt`` the branch point lies inside a long first prompt instead (a
   short answer), so the branch reuses prefill-written KV only: on DeepSeek-V4 the KV a decode
   step writes differs in rounding from what a prefill of the same tokens writes (the attention
   sums in another order), so a branch inside decoded tokens is not comparable with a full
   re-prefill at :data:`devkit.gate.verdict.LOGPROB_TOLERANCE`. There the churn evicts the
   prompt's window at F (Full KV stays) and its chunk checkpoint below F. ``cone_first`` runs that
   first prompt before the idle session's turn, so the idle session is the newer of the two in
   the SWA LRU.
3. ``host`` (the HiCache leg only, ``host_churn_requests`` > 0): a session prefills and decodes a
   turn, then churn past the device Full pool pushes its Full KV to host (HiCache's write policy
   copies it there) and its window out of both tiers; the session resumes under the id
   :data:`HOST_RESUME_RID`, which the server's log lines name, so the gate can read whether its
   Full KV came back from host (:func:`run_host_phase`).
4. ``yield``: streams decode while a long prompt arrives and prefills in small chunks; the streams'
   decode rate during the prefill over their rate before it is the decode share.

Prompts are token ids from a seeded generator (no tokenizer round trip), all greedy.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from devkit.engine_kit import client

FIRST_ID = 6  # ids below are the specials of the kit's tokenizer


@dataclass(frozen=True)
class Workload:
    seed: int = 1
    vocab: int = 1024
    session_tokens: int = 1024  # the idle session's context
    cone_prompt_tokens: int = 64  # the branched session's first prompt (one chunk)
    cone_tokens: int = 640  # its context after turn 1: the prompt and the answer it decodes
    cone_branch_at: int = 480  # the branch keeps this many of its tokens (inside the answer)
    churn_requests: int = 10
    churn_tokens: int = 512
    turn_tokens: int = 8  # generated per turn
    new_user_tokens: int = 24
    streams: int = 4
    stream_prompt_tokens: int = 32
    # Small enough that the streams' reserved KV never keeps the long prompt out of admission
    # (PrefillAdder reserves their remaining tokens); aborted once the long prompt is done.
    stream_max_tokens: int = 600
    long_prompt_tokens: int = 2048
    before_s: float = 2.0  # how long the streams' rate is measured before the long prompt
    # How long it is measured again once the long prompt is done (0: not). A machine whose speed
    # drifts within seconds moves the rate before the prefill as much as decode yield does; the
    # share against the mean of both (``decode_share_bracketed``) and their spread (``reference_drift``)
    # say how far the reference itself moved.
    after_s: float = 0.0
    timeout_s: float = 300.0
    # A follow-up turn of the branched session before the churn (0: none). On a paged DeepSeek-V4
    # pool an evicted leaf goes whole, Full KV included: the follow-up makes the answer an inner
    # node, whose Full KV stays resident while the churn evicts its SWA window.
    cone_followup_tokens: int = 0
    # The branch point inside the branched session's first prompt (0 < cone_branch_at <
    # cone_prompt_tokens) instead of inside its answer (module docstring, phase 2).
    cone_branch_in_prompt: bool = False
    # The branched session's first turn runs before the idle session's (default: after it).
    cone_first: bool = False
    # The host phase (module docstring, phase 3): its churn requests (0: no host phase; the HiCache
    # leg sizes them past the device Full pool) and its session's context.
    host_churn_requests: int = 0
    host_session_tokens: int = 1024

    @classmethod
    def quick(cls) -> Workload:
        return cls()

    @classmethod
    def full(cls) -> Workload:
        return cls(session_tokens=2048, cone_tokens=1280, cone_branch_at=1000, churn_requests=16,
                   churn_tokens=768, long_prompt_tokens=6000, before_s=3.0)

    def validate(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, (int, float)) and value < 0:
                raise ValueError(f"Workload.{name}={value!r} is invalid: expected a value >= 0")
        if self.cone_branch_in_prompt:
            if not 0 < self.cone_branch_at < self.cone_prompt_tokens < self.cone_tokens:
                raise ValueError(f"Workload.cone_branch_at={self.cone_branch_at} is invalid with cone_branch_in_prompt: "
                                 f"expected 0 < it < cone_prompt_tokens={self.cone_prompt_tokens} < cone_tokens="
                                 f"{self.cone_tokens}")
        elif not 0 < self.cone_prompt_tokens < self.cone_branch_at < self.cone_tokens:
            raise ValueError(f"Workload.cone_branch_at={self.cone_branch_at} is invalid: expected cone_prompt_tokens="
                             f"{self.cone_prompt_tokens} < it < cone_tokens={self.cone_tokens}")

    def ids(self, tag: str, n: int) -> list[int]:
        rng = random.Random(f"{self.seed}:{tag}")
        return [rng.randrange(FIRST_ID, self.vocab) for _ in range(n)]


def run_cache_phases(base_url: str, w: Workload, api: Any = client) -> dict[str, Any]:
    """Phases 1 and 2: idle resume after churn, and the mid-context branch (cone). ``api`` sends
    the requests (``generate`` and ``flush_cache`` as :mod:`devkit.engine_kit.client` has them): the
    server by default; :mod:`devkit.testkit.gate_phases` runs the same phases on an in-process
    scheduler."""
    api.flush_cache(base_url)
    outputs: dict[str, list[int]] = {}
    session = w.ids("session", w.session_tokens)
    cone_prompt = w.ids("cone", w.cone_prompt_tokens)
    turns = [("session_turn1", session, w.turn_tokens), ("cone_turn1", cone_prompt, w.cone_tokens - w.cone_prompt_tokens)]
    for key, prompt, n in reversed(turns) if w.cone_first else turns:
        outputs[key] = api.generate(base_url, prompt, n, w.timeout_s)["output_ids"]
    answer = outputs["cone_turn1"]
    cone = cone_prompt + answer
    if w.cone_followup_tokens:
        followup = cone + w.ids("cone_followup", w.cone_followup_tokens)
        outputs["cone_followup"] = api.generate(base_url, followup, w.turn_tokens, w.timeout_s)["output_ids"]
    for i in range(w.churn_requests):
        outputs[f"churn{i}"] = api.generate(base_url, w.ids(f"churn{i}", w.churn_tokens), 4, w.timeout_s)["output_ids"]
    context = session + outputs["session_turn1"]
    resume = api.generate(base_url, context + w.ids("session_user2", w.new_user_tokens), w.turn_tokens, w.timeout_s)
    outputs["session_turn2"] = resume["output_ids"]
    branch_prompt = cone[: w.cone_branch_at] + w.ids("cone_user2", w.new_user_tokens)
    branch = api.generate(base_url, branch_prompt, w.turn_tokens, w.timeout_s, logprobs=True)
    outputs["cone_branch"] = branch["output_ids"]
    resume_cached = int(resume["meta_info"].get("cached_tokens") or 0)
    branch_cached = int(branch["meta_info"].get("cached_tokens") or 0)
    return {
        "outputs": outputs,
        "resume_context_tokens": len(session),
        "resume_cached_tokens": resume_cached,
        "resume_cached_frac": round(min(1.0, resume_cached / len(session)), 4),
        "cone_prompt_tokens": len(branch_prompt),
        "cone_cached_tokens": branch_cached,
        # Tokens of the branch's shared context the engine prefilled again (its new message excluded).
        "cone_recomputed_tokens": max(0, w.cone_branch_at - branch_cached),
        # The branch's greedy tokens' logprobs: a cone replay must match a re-prefill to float noise.
        "cone_branch_logprobs": [float(x[0]) for x in branch["meta_info"].get("output_token_logprobs") or []],
    }


HOST_RESUME_RID = "gate-host-resume"  # the host phase's resume: the id its log lines carry


def run_host_phase(base_url: str, w: Workload, api: Any = client) -> dict[str, Any]:
    """Phase 3: a session's turn, churn past the device Full pool, the session's resume (under
    :data:`HOST_RESUME_RID`). Nothing without ``host_churn_requests``."""
    if not w.host_churn_requests:
        return {}
    api.flush_cache(base_url)
    outputs: dict[str, list[int]] = {}
    session = w.ids("host_session", w.host_session_tokens)
    outputs["host_turn1"] = api.generate(base_url, session, w.turn_tokens, w.timeout_s)["output_ids"]
    for i in range(w.host_churn_requests):
        outputs[f"host_churn{i}"] = api.generate(base_url, w.ids(f"host_churn{i}", w.churn_tokens), 4,
                                                 w.timeout_s)["output_ids"]
    context = session + outputs["host_turn1"]
    resume = api.generate(base_url, context + w.ids("host_user2", w.new_user_tokens), w.turn_tokens, w.timeout_s,
                          rid=HOST_RESUME_RID)
    outputs["host_turn2"] = resume["output_ids"]
    cached = int(resume["meta_info"].get("cached_tokens") or 0)
    return {"outputs": outputs, "rid": HOST_RESUME_RID, "context_tokens": len(context), "cached_tokens": cached,
            # the session's context the engine prefilled again (its new message excluded)
            "recomputed_tokens": max(0, len(context) - cached)}


def bracketed_share(before: float, during: float, after: float | None) -> dict[str, float]:
    """The streams' rate during the prefill against the mean of their rates before and after it,
    and how far those two are apart (of their mean); nothing without a rate after."""
    if after is None or before <= 0 or after <= 0:
        return {}
    reference = (before + after) / 2
    return {"decode_rate_after": round(after, 2), "decode_share_bracketed": round(during / reference, 4),
            "reference_drift": round(abs(after - before) / reference, 4)}


def reference_point(tokens_at: Any, start: float, end: float) -> tuple[float, float]:
    """A reference span as :func:`context_share` takes it: the streams' rate over ``[start, end]``
    and their decoded tokens at its middle (``tokens_at(t)``: their tokens by ``t``)."""
    return ((tokens_at(end) - tokens_at(start)) / max(end - start, 1e-9), (tokens_at(start) + tokens_at(end)) / 2)


def context_share(points: dict[str, tuple[float, float]], edges: list[float], tokens_at: Any) -> dict[str, Any]:
    """The streams' share against their own step at the context they had: what they decoded in
    each span, timed at their rate alone, over the span's wall time.

    A stream's decode step grows with its context (the Mellum kit's 4-row step: 5.5 ms at 33
    tokens a row, 15 ms at 900), and during a long prefill the streams decode hundreds of tokens,
    so neither the rate before nor the mean of the rates before and after is their rate alone in
    the middle of it (pct 70: rate 483 tok/s before, 246 after, the bracketed share 0.62 where
    the streams' time share was 0.71). The time a token costs alone is taken as linear in the
    streams' decoded tokens between the two measured spans (``points``: ``before`` and ``after``,
    each ``(rate, tokens at its middle)``); a span's reference time is then its tokens times that
    cost at its middle, exact for a linear cost. ``edges``: the span boundaries (the prefill, or
    its quarters); ``tokens_at(t)``: the streams' decoded tokens by ``t``. ``reference_token_s``:
    that cost at the whole span's middle, what the share values a token at, and
    ``reference_token_s_quarters`` the cost each span's share values its tokens at. Nothing
    without both rates."""
    (rate_b, k_b), (rate_a, k_a) = points["before"], points["after"]
    if rate_b <= 0 or rate_a <= 0 or k_a <= k_b:
        return {}

    def cost(k: float) -> float:  # seconds per decoded token (all streams together) at k tokens
        return 1 / rate_b + (1 / rate_a - 1 / rate_b) * (k - k_b) / (k_a - k_b)

    shares, costs = [], []
    for a, b in itertools.pairwise(edges):
        ka, kb = tokens_at(a), tokens_at(b)
        costs.append(cost((ka + kb) / 2))
        shares.append(round((kb - ka) * costs[-1] / max(b - a, 1e-9), 4))
    whole_k = tokens_at(edges[-1]) - tokens_at(edges[0])
    middle = cost((tokens_at(edges[0]) + tokens_at(edges[-1])) / 2)
    whole = whole_k * middle / max(edges[-1] - edges[0], 1e-9)
    return {"decode_share_context": round(whole, 4), "share_quarters_context": shares,
            "reference_token_s": round(middle, 7), "reference_token_s_quarters": [round(c, 7) for c in costs]}


def reference_noise(points: dict[str, tuple[float, float]], spans: list[tuple[float, float]], tokens_at: Any) -> float:
    """How far the streams' rate alone moved within a reference span, with nothing else running:
    the largest difference between the shares of a span's two halves, each against the same
    reference at the context it had (:func:`context_share`; both read 1.0 on a machine that holds
    its speed). The share during the prefill is timed against rates measured seconds away from it,
    so this is the order of the error its reference carries (two full Mellum runs on this 2-core
    VM: 0.03-0.33 per boot, where ±0.03 is ±4 % of a share of 0.70)."""
    spread = 0.0
    for a, b in spans:
        halves = context_share(points, [a, (a + b) / 2, b], tokens_at).get("share_quarters_context")
        if halves:
            spread = max(spread, abs(halves[1] - halves[0]))
    return round(spread, 4)


def decoded_since(streams: list[Any], t0: float, t1: float) -> list[tuple[float, int]]:
    """The streams' tokens together as a step function of time in ``(t0, t1]``: at each instant a
    token count arrived, (seconds after ``t0``, tokens since ``t0``)."""
    arrivals: list[tuple[float, int]] = []
    for s in streams:
        seen = s.tokens_at(t0)
        for when, count in s.ticks:
            if t0 < when <= t1 and count > seen:
                arrivals.append((when, count - seen))
                seen = count
    arrivals.sort()
    total, out = 0, []
    for when, added in arrivals:
        total += added
        out.append((round(when - t0, 6), total))
    return out


def run_yield_phase(base_url: str, w: Workload, tag: str) -> dict[str, Any]:
    """Phase 3: decode share of running streams while a long prompt prefills in chunks."""
    client.flush_cache(base_url)
    streams = [client.Stream(base_url, f"{tag}-s{i}", w.ids(f"stream{i}", w.stream_prompt_tokens),
                             w.stream_max_tokens, w.timeout_s).start() for i in range(w.streams)]
    try:
        client.wait_until(lambda: all(s.tokens >= 8 or s.error for s in streams), w.timeout_s, "streams to decode")
        failed = [s.error for s in streams if s.error]
        if failed:
            raise RuntimeError(f"stream failed: {failed[0]}")
        t_before = time.monotonic()
        time.sleep(w.before_s)
        done = [s.rid for s in streams if s.tokens >= w.stream_max_tokens]
        if done:
            # e.g. the engine kept one stream in its queue while another decoded all its tokens
            raise RuntimeError(f"streams {done} finished their {w.stream_max_tokens} tokens before the long prompt "
                               "was sent: the streams did not decode together")
        long = client.Stream(base_url, f"{tag}-long", w.ids("long", w.long_prompt_tokens), 8, w.timeout_s)
        t_send = time.monotonic()
        long.start()
        client.wait_until(lambda: long.tokens >= 1 or long.error, w.timeout_s, "the long prompt's first token")
        t_first = long.ticks[0][0] if long.ticks else time.monotonic()
        long.join(w.timeout_s)
        t_after = time.monotonic()
        time.sleep(w.after_s)
        t_after_end = time.monotonic()
    finally:
        client.stop_streams(base_url, streams)
    if long.error:
        raise RuntimeError(f"long prompt failed: {long.error}")
    # The prefill window ends at the long prompt's first token, or earlier if a stream ran out of tokens.
    t_end = min([t_first] + [s.ticks[-1][0] for s in streams if s.tokens >= w.stream_max_tokens])
    before = sum(s.tokens_at(t_send) - s.tokens_at(t_before) for s in streams) / max(t_send - t_before, 1e-9)
    during = sum(s.tokens_at(t_end) - s.tokens_at(t_send) for s in streams) / max(t_end - t_send, 1e-9)
    after = None
    if w.after_s > 0 and all(s.tokens_at(t_after_end) < w.stream_max_tokens for s in streams):
        after = sum(s.tokens_at(t_after_end) - s.tokens_at(t_after) for s in streams) / max(t_after_end - t_after, 1e-9)
    bracket = bracketed_share(before, during, after)
    # the rate in each quarter of the prefill's wall time (a fixed interval gives the late, slower
    # chunks' quarters less than the early ones'; decode yield should give each the same)
    edges = [t_send + (t_end - t_send) * i / 4 for i in range(5)]
    quarters = [sum(s.tokens_at(b) - s.tokens_at(a) for s in streams) / max(b - a, 1e-9)
                for a, b in itertools.pairwise(edges)]

    def decoded(t: float) -> int:
        return sum(s.tokens_at(t) for s in streams)

    in_context = {}
    if after is not None:
        points = {"before": reference_point(decoded, t_before, t_send),
                  "after": reference_point(decoded, t_after, t_after_end)}
        in_context = context_share(points, edges, decoded)
        if in_context:
            in_context["reference_noise"] = reference_noise(points, [(t_before, t_send), (t_after, t_after_end)], decoded)
    # Streams are aborted at different lengths on each boot: the gate compares their common prefix.
    outputs = {f"stream{i}": s.output_ids for i, s in enumerate(streams)}
    shortest = min(len(s.output_ids) for s in streams)
    outputs["long"] = long.output_ids
    return {
        "outputs": outputs,
        "decode_rate_before": round(before, 2),
        "decode_rate_during": round(during, 2),
        "decode_share": round(during / before, 4) if before > 0 else None,
        "prefill_s": round(t_first - t_send, 3),
        "measured_s": round(t_end - t_send, 3),
        # the phase's instants (time.monotonic()), for readers that account time another way
        "times": {"before": t_before, "send": t_send, "first": t_first, "end": t_end,
                  **({"after": t_after, "after_end": t_after_end} if after is not None else {})},
        "stream_tokens_compared": shortest,
        # the streams' tokens by each instant of the prefill they arrived at: (seconds after the send,
        # tokens since the send), for readers that count over other spans
        "decoded_s": decoded_since(streams, t_send, t_end),
        "decode_rate_quarters": [round(q, 2) for q in quarters],
        **bracket,
        **in_context,
    }
