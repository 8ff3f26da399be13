"""HTTP calls to a kit server: bounded in time, greedy, token ids in and out."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import requests

TIMEOUT_S = 300.0  # one request never waits longer than this


def greedy(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True, **extra}


def generate(base_url: str, input_ids: list[int], max_new_tokens: int, timeout_s: float = TIMEOUT_S,
             logprobs: bool = False, rid: str | None = None, session_id: str | None = None) -> dict[str, Any]:
    """One greedy ``/generate`` call; returns ``{"output_ids", "meta_info", "e2e_s"}`` (with
    ``logprobs``: ``meta_info["output_token_logprobs"]`` holds each output token's logprob; with
    ``rid``: the request runs under that id, which the server's log lines name).
    ``session_id``: the request's top-level ``GenerateReqInput.session_id`` (with
    ``--enable-session-radix-cache`` a radix-native session: the finished turn's KV is tagged with it)."""
    t0 = time.monotonic()
    body = _post_generate(base_url, input_ids, max_new_tokens, timeout_s, logprobs, rid, session_id)
    return {"output_ids": list(body["output_ids"]), "meta_info": body["meta_info"], "e2e_s": time.monotonic() - t0}


def generate_batch(base_url: str, prompts: list[list[int]], max_new_tokens: int,
                   timeout_s: float = TIMEOUT_S) -> list[dict[str, Any]]:
    """Greedy requests sent as one batched ``/generate`` call, one result per prompt in order
    (each result's ``e2e_s`` is the whole call's).

    Token-id prompts of a batch reach the scheduler as one message (SGLang's tokenizer manager sends
    them as one ``BatchTokenizedGenerateReqInput``), so they are queued in the same pass on every
    boot; requests sent from threads arrive a pass apart or not as the machine's timing falls, and
    which rows share a batch, and when the pool retracts one, then differs from boot to boot."""
    t0 = time.monotonic()
    bodies = _post_generate(base_url, prompts, max_new_tokens, timeout_s, False)
    e2e = time.monotonic() - t0
    return [{"output_ids": list(b["output_ids"]), "meta_info": b["meta_info"], "e2e_s": e2e} for b in bodies]


def _post_generate(base_url: str, input_ids: Any, max_new_tokens: int, timeout_s: float, logprobs: bool,
                   rid: str | None = None, session_id: str | None = None) -> Any:
    body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": greedy(max_new_tokens)}
    if logprobs:
        body["return_logprob"] = True
    if rid is not None:
        body["rid"] = rid
    if session_id is not None:
        body["session_id"] = session_id
    response = requests.post(base_url + "/generate", timeout=timeout_s, json=body)
    response.raise_for_status()
    return response.json()


def generate_streamed(base_url: str, input_ids: list[int], max_new_tokens: int, timeout_s: float = TIMEOUT_S,
                      session_id: str | None = None) -> dict[str, Any]:
    """One greedy streamed ``/generate`` call: ``{"output_ids", "meta_info", "ttft_s", "e2e_s"}``,
    ``ttft_s`` the client's time to the first streamed chunk (the first token), ``meta_info`` the
    last chunk's."""
    body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": greedy(max_new_tokens), "stream": True}
    if session_id is not None:
        body["session_id"] = session_id
    t0 = time.monotonic()
    ttft, last = None, None
    with requests.post(base_url + "/generate", json=body, stream=True, timeout=timeout_s) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            if ttft is None:
                ttft = time.monotonic() - t0
            last = json.loads(line[6:])
    if last is None:
        raise RuntimeError(f"/generate streamed no chunk for a {len(input_ids)}-token prompt")
    return {"output_ids": list(last.get("output_ids") or []), "meta_info": last["meta_info"], "ttft_s": ttft,
            "e2e_s": time.monotonic() - t0}


def close_session(base_url: str, session_id: str) -> None:
    """``/close_session``: with ``--enable-session-radix-cache`` it only dereferences the session's KV
    (``UnifiedSessionRefTracker.release_radix_session``); without it SGLang logs that no such session exists."""
    requests.post(base_url + "/close_session", json={"session_id": session_id}, timeout=60).raise_for_status()


def flush_cache(base_url: str, timeout_s: float = 120.0) -> None:
    """Empty the radix cache so a phase starts from the same tree on every boot; retried while SGLang
    refuses it (400: the scheduler is not idle yet, e.g. a HiCache write-through, load-back or L3
    backup still in flight after the last request answered, or the boot's health check)."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = requests.post(base_url + "/flush_cache", timeout=60)
        if response.status_code != 400 or time.monotonic() > deadline:
            response.raise_for_status()
            return
        time.sleep(0.5)


def abort(base_url: str, rid: str) -> None:
    requests.post(base_url + "/abort_request", json={"rid": rid}, timeout=30).raise_for_status()


def stop_streams(base_url: str, streams: list[Stream], join_s: float = 60) -> None:
    """Abort every stream (one may have finished already), then join each."""
    for s in streams:
        try:
            abort(base_url, s.rid)
        except Exception:  # it may have finished already
            pass
    for s in streams:
        s.join(join_s)


@dataclass
class Stream:
    """A streaming greedy request on its own thread: token counts with client-side arrival times."""

    base_url: str
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    timeout_s: float = TIMEOUT_S
    ticks: list[tuple[float, int]] = field(default_factory=list)  # (monotonic time, completion tokens)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: Any = None
    error: str | None = None
    _thread: threading.Thread | None = None

    def start(self) -> Stream:
        self._thread = threading.Thread(target=self._run, name=f"stream-{self.rid}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        body = {"input_ids": self.input_ids, "sampling_params": greedy(self.max_new_tokens), "stream": True,
                "rid": self.rid}
        try:
            with requests.post(self.base_url + "/generate", json=body, stream=True, timeout=self.timeout_s) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    meta = chunk.get("meta_info", {})
                    self.ticks.append((time.monotonic(), int(meta.get("completion_tokens", 0))))
                    if "output_ids" in chunk:
                        self.output_ids = list(chunk["output_ids"])
                    self.finish_reason = meta.get("finish_reason")
        except Exception as exc:  # reported to the caller, who decides
            self.error = f"{type(exc).__name__}: {exc}"

    @property
    def tokens(self) -> int:
        return self.ticks[-1][1] if self.ticks else 0

    def tokens_at(self, t: float) -> int:
        """Completion tokens received by time ``t``."""
        seen = 0
        for when, count in self.ticks:
            if when > t:
                break
            seen = count
        return seen

    def join(self, timeout_s: float) -> bool:
        assert self._thread is not None
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)
