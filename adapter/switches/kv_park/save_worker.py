"""The park store's background save worker: queued copies run on one thread, off the caller's.

Cares about: no queued copy waited for forever (a worker that died or was stopped fails what it
left: each lands as a failed copy, which disables parking), and no thread left behind (the worker
starts on demand and exits after ``idle_exit_s`` without work; the stores stop it at exit).

In -> out: a :class:`SaveJob` (an entry's host rows, the engine, the page ids) -> the job run on
the worker's thread (``done`` set; ``error`` on a failed copy). Landing it (storing the entry,
``on_landed``) is the store's, on the caller's thread (:mod:`adapter.switches.kv_park.store`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from adapter.switches.kv_park.engine import CopyEngine


@dataclass
class SaveJob:
    entry: Any  # the store's Entry: the copy writes its ``rows``
    engine: CopyEngine
    page_ids: torch.Tensor
    after: object
    on_landed: Callable[[], None] | None
    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None


def run_save(job: SaveJob, events: list | None = None) -> None:
    """Copy the job's pages into its entry's rows (``events``: the engine's asynchronous form); a
    failure is kept on the job (``error``), never raised past it unless it is not an ``Exception``."""
    try:
        if events is None:
            job.engine.save(job.page_ids, out=job.entry.rows, after=job.after)
        else:
            job.engine.save(job.page_ids, out=job.entry.rows, after=job.after, events=events)
    except BaseException as exc:  # any failure disables parking; it never reaches the engine
        job.error = exc  # a BaseException too: the copy is unfinished, never a saved entry
        if not isinstance(exc, Exception):
            raise  # it ends the thread (or reaches the caller of a synchronous save)
    finally:
        job.done.set()


class SaveWorker:
    """One thread running queued :class:`SaveJob` s in order; ``enabled`` False: nothing is queued
    (the store copies on the caller's thread)."""

    def __init__(self, *, enabled: bool, queue_depth: int | None, idle_exit_s: float):
        self.enabled = bool(enabled)
        self.idle_exit_s = idle_exit_s
        self._queue: queue.Queue[SaveJob | None] = queue.Queue(maxsize=queue_depth or 0)  # 0: unbounded
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: SaveJob) -> bool:
        """Queue ``job`` for the thread; False when the worker is off or its queue is full (the
        caller copies synchronously)."""
        if not self.enabled:
            return False
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            return False
        self._ensure_thread()
        return True

    def _ensure_thread(self) -> None:
        # Started on demand; it exits after idle_exit_s without work, so an unused or
        # uninstalled store leaves no thread behind.
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name="dsv41-kv-park", daemon=True)
                self._thread.start()

    def _work(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=self.idle_exit_s)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            if job is None:  # stop()
                return
            try:
                run_save(job)
            except BaseException as exc:  # the worker dies: no queued copy may be waited for forever
                self._orphan_queue(f"the park worker died: {type(exc).__name__}: {exc}")
                return

    def _orphan_queue(self, why: str) -> None:
        """Fail every copy still queued (no thread will run them): each lands as a failed copy,
        which disables parking; later offers save synchronously."""
        with self._lock:
            self._thread = None
            self.enabled = False
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.error = RuntimeError(why)
                job.done.set()

    def wait(self, job: SaveJob, timeout: float | None) -> bool:
        """Wait for one copy; a copy left without a live worker fails instead of hanging the caller."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if job.done.wait(max(left, 0.0)):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            thread = self._thread
            if thread is None or not thread.is_alive():
                self._orphan_queue("a queued copy has no live park worker to run it")

    def stop(self, timeout: float) -> None:
        """End the thread once it has run what is queued (the caller has landed it first)."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                return
            thread.join(timeout)
