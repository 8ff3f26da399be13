"""The soak's traffic: seeded agent-style scenarios against one server (:class:`Traffic`, one
``random.Random``: the same seed gives the same order of scenarios and the same token ids), and what
each request came to (:class:`Tally`)."""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_REQUESTS = 100_000  # the traffic loop's hard cap, whatever the deadline


@dataclass
class Tally:
    served: int = 0
    failed: int = 0
    aborted: int = 0  # aborted on purpose (disconnect, /abort_request) and ended cleanly
    errors: list[str] = field(default_factory=list)
    by_scenario: dict[str, int] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list)  # every served request's time to its first token
    itl_s: list[float] = field(default_factory=list)  # every gap between two tokens of a stream, per token
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def ok(self, scenario: str, n: int = 1, aborted: bool = False) -> None:
        with self._lock:
            self.served += n
            self.aborted += n if aborted else 0
            self.by_scenario[scenario] = self.by_scenario.get(scenario, 0) + n

    def fail(self, scenario: str, why: str) -> None:
        with self._lock:
            self.failed += 1
            if len(self.errors) < 20:
                self.errors.append(f"{scenario}: {why}")

    def timed(self, sent: float, ticks: list[tuple[float, int]], first: bool = True) -> None:
        """A stream's arrivals (``ticks``: client time, tokens so far) sent at ``sent``: its TTFT
        (``first``: the stream began at ``sent``) and its inter-token gaps."""
        ticks = [(t, n) for t, n in ticks if n > 0]
        gaps = [(t1 - t0) / (n1 - n0) for (t0, n0), (t1, n1) in itertools.pairwise(ticks) if n1 > n0]
        with self._lock:
            if first and ticks:
                self.ttft_s.append(ticks[0][0] - sent)
            self.itl_s.extend(gaps)

    def latency(self) -> dict[str, Any]:
        """Mean and p99 TTFT and ITL (ms) as SGLang's ``bench_serving`` reports them."""
        return {"requests_timed": len(self.ttft_s), **_mean_p99("ttft", self.ttft_s), **_mean_p99("itl", self.itl_s)}

    @property
    def total(self) -> int:
        return self.served + self.failed


def _mean_p99(name: str, seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {f"mean_{name}_ms": None, f"p99_{name}_ms": None}
    import numpy as np

    ms = np.asarray(seconds) * 1000
    return {f"mean_{name}_ms": round(float(ms.mean()), 1), f"p99_{name}_ms": round(float(np.percentile(ms, 99)), 1)}


@dataclass
class Traffic:
    """The seeded agent-style scenarios; every request is bounded in tokens and time."""

    base_url: str
    seed: int
    vocab: int = 1024
    timeout_s: float = 120.0
    tally: Tally = field(default_factory=Tally)
    sessions: list[list[int]] = field(default_factory=list)
    _n: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.system = self.ids(384)

    def ids(self, n: int) -> list[int]:
        from devkit.engine_kit.workload import FIRST_ID

        return [self.rng.randrange(FIRST_ID, self.vocab) for _ in range(n)]

    def rid(self, tag: str) -> str:
        self._n += 1
        return f"soak-{self.seed}-{self._n}-{tag}"

    def _generate(self, scenario: str, ids: list[int], new: int) -> list[int] | None:
        """A streamed greedy request (its TTFT and token gaps timed); its output ids, or None."""
        from devkit.engine_kit import client

        stream = client.Stream(self.base_url, self.rid(scenario), ids, new, self.timeout_s)
        sent = time.monotonic()
        stream.start()
        if not stream.join(self.timeout_s + 10):
            self.tally.fail(scenario, f"no end after {self.timeout_s:.0f} s")
            return None
        if stream.error:  # counted, never raised: the soak goes on and reports it
            self.tally.fail(scenario, stream.error[:300])
            return None
        out = stream.output_ids
        if len(out) != new:
            self.tally.fail(scenario, f"{len(out)} tokens instead of {new}")
            return None
        self.tally.timed(sent, stream.ticks)
        self.tally.ok(scenario)
        return out

    # -- scenarios -----------------------------------------------------------------------------
    def session(self) -> None:
        """Resume an idle session (context + a new user message) or open a new one."""
        if self.sessions and self.rng.random() < 0.7:
            i = self.rng.randrange(len(self.sessions))
            context = self.sessions[i] + self.ids(self.rng.randint(8, 40))
            if len(context) > 3000:
                context = context[-1500:]
            out = self._generate("resume", context, 8)
            if out is not None:
                self.sessions[i] = context + out
            return
        context = self.ids(self.rng.randint(200, 800))
        out = self._generate("session", context, 8)
        if out is not None:
            self.sessions.append(context + out)
            del self.sessions[:-6]

    def subagents(self) -> None:
        """Two to four sub-agent turns at once, sharing the system prompt."""
        tasks = [self.system + self.ids(self.rng.randint(16, 64)) for _ in range(self.rng.randint(2, 4))]
        threads = [threading.Thread(target=self._generate, args=("subagent", t, 6)) for t in tasks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout_s + 10)

    def _streams(self, tag: str, n: int, max_new: int) -> list[Any]:
        from devkit.engine_kit import client

        return [client.Stream(self.base_url, self.rid(f"{tag}{i}"), self.ids(self.rng.randint(16, 48)), max_new,
                              self.timeout_s).start() for i in range(n)]

    def _end_streams(self, scenario: str, streams: list[Any]) -> None:
        from devkit.engine_kit import client

        for s in streams:
            try:
                client.abort(self.base_url, s.rid)
            except Exception:  # it may have finished already
                pass
        for s in streams:
            if not s.join(60):
                self.tally.fail(scenario, f"stream {s.rid} did not end after its abort")
            elif s.error:
                self.tally.fail(scenario, f"stream {s.rid}: {s.error}"[:300])
            elif not s.ticks:
                self.tally.fail(scenario, f"stream {s.rid} produced nothing")
            else:
                self.tally.timed(0.0, s.ticks, first=False)  # decode streams: their gaps (ITL) only
                self.tally.ok(scenario)

    def long_beside_streams(self) -> None:
        """A long prompt prefilled in chunks while streams decode."""
        from devkit.engine_kit import client

        streams = self._streams("ls", 2, 400)
        try:
            client.wait_until(lambda: all(s.tokens >= 2 or s.error for s in streams), self.timeout_s, "streams")
            self._generate("long", self.ids(self.rng.randint(600, 1500)), 4)
        except Exception as exc:
            self.tally.fail("long", f"{type(exc).__name__}: {exc}"[:300])
        finally:
            self._end_streams("stream", streams)

    def cone(self) -> None:
        """Branch a session inside its context (an agent retrying from mid-answer)."""
        if not self.sessions:
            return self.session()
        context = self.rng.choice(self.sessions)
        if len(context) < 160:
            return self.session()
        at = self.rng.randint(96, len(context) - 8)
        self._generate("cone", context[:at] + self.ids(16), 6)

    def disconnect(self) -> None:
        """The client goes away mid-stream (the connection is closed after a few chunks)."""
        import requests

        body = {"input_ids": self.ids(self.rng.randint(32, 200)), "stream": True, "rid": self.rid("dc"),
                "sampling_params": {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True}}
        try:
            with requests.post(self.base_url + "/generate", json=body, stream=True, timeout=self.timeout_s) as r:
                r.raise_for_status()
                chunks = 0
                for line in r.iter_lines():
                    if line.startswith(b"data: "):
                        chunks += 1
                    if chunks >= self.rng.randint(2, 6):
                        break
        except Exception as exc:
            self.tally.fail("disconnect", f"{type(exc).__name__}: {exc}"[:300])
            return
        self.tally.ok("disconnect", aborted=True)

    def abort_while_prefilling(self) -> None:
        """``/abort_request`` of a long prompt while it prefills in chunks beside streams."""
        from devkit.engine_kit import client

        streams = self._streams("ab", 2, 400)
        long = client.Stream(self.base_url, self.rid("abort"), self.ids(self.rng.randint(1500, 3000)), 4, self.timeout_s)
        try:
            client.wait_until(lambda: all(s.tokens >= 2 or s.error for s in streams), self.timeout_s, "streams")
            long.start()
            time.sleep(self.rng.uniform(0.2, 1.5))
            client.abort(self.base_url, long.rid)
            if not long.join(60):
                self.tally.fail("abort", "the aborted prompt's request did not end")
            elif long.error:
                self.tally.fail("abort", f"aborted prompt: {long.error}"[:300])
            else:
                self.tally.ok("abort", aborted=long.tokens < 4)
        except Exception as exc:
            self.tally.fail("abort", f"{type(exc).__name__}: {exc}"[:300])
        finally:
            self._end_streams("stream", streams)

    def idle(self) -> None:
        """Nothing to run: the scheduler's idle checks (leak, tree sanity) run."""
        time.sleep(self.rng.uniform(0.5, 2.0))

    SCENARIOS: tuple[tuple[str, int], ...] = (
        ("session", 6), ("subagents", 3), ("long_beside_streams", 2), ("cone", 3),
        ("disconnect", 2), ("abort_while_prefilling", 1), ("idle", 2),
    )

    def next_scenario(self) -> str:
        names = [n for n, _ in self.SCENARIOS]
        return self.rng.choices(names, weights=[w for _, w in self.SCENARIOS])[0]

    def run(self, seconds: float, on_tick: Callable[[], None] | None = None) -> Tally:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.tally.total < MAX_REQUESTS:
            getattr(self, self.next_scenario())()
            if on_tick is not None:
                on_tick()
        return self.tally
