"""Keep KV-parking copies out of global-mode CUDA graph captures.

Why
---
SGLang 0.5.23 captures CUDA graphs after serving has started, on the scheduler thread, while the
park store's worker thread may be copying pages on the copy engine's stream:

* ``update_weights_from_disk(recapture_cuda_graph=True)``
  (``model_executor/model_runner_components/weight_updater.py``) -> ``recapture_decode_cuda_graph``
  -> ``init_decode_cuda_graph``;
* the PD role switch to decode (``disaggregation/role_switch.py``) ->
  ``ModelRunner.ensure_decode_cuda_graphs`` (first flip only);
* elastic EP scale-up -> ``ModelRunner._recapture_elastic_cuda_graphs``;
* the ViT graph runner (``multimodal/vit_cuda_graph_runner.py``) captures each new sequence-length
  key lazily, in the forward that first meets it.

These use ``torch.cuda.graph(...)`` with the default ``capture_error_mode="global"``: while such a
capture is open, CUDA refuses "potentially unsafe" calls on *every* thread (synchronous copies
into pageable memory, ``cudaMalloc``, stream and event synchronization, legacy-stream work), and
such a call can also invalidate the capture itself. A parking save is exactly such a call (a
device-to-host copy into pageable memory, then a stream synchronize). The captures SGLang takes
with ``capture_error_mode="thread_local"`` (the decode runner's metadata glue graphs, dspark's
accept graph) only restrict their own thread, and the piecewise (``tc_piecewise``) backend
captures only inside ``PiecewiseCudaGraphRunner.capture()`` at startup (a serving-time Dynamo
recompile runs eagerly), so neither needs anything here.

What
----
One process-wide :data:`CAPTURE_LOCK`: copies and global-mode captures exclude each other (many
copies, or many captures, at a time). Every device copy of a CUDA :class:`~.engine.CopyEngine` runs
inside ``CAPTURE_LOCK.copy()``; a global-mode capture runs between ``begin_capture()`` and
``end_capture()``, which :func:`locked_capture_begin` / :func:`locked_capture_end` call when wrapped
around ``torch.cuda.CUDAGraph.capture_begin`` / ``capture_end`` (``wrapt`` signature, as
``adapter.core.patching.Patch.wrap`` takes them). Invariants (tests check each one):

* A capture begins only when no copy is in flight (drain), and no copy starts while a capture is
  open (new copies wait for it to end): a copy and a global-mode capture never overlap.
* Thread-local and relaxed captures do not take the lock (they restrict only their own thread).
* A copy asked for on a thread that is itself capturing raises :class:`CaptureConflict` at once
  (it would be recorded into the graph, or deadlock waiting for its own capture).
* Waits are bounded (``wait_s``): a copy that waits longer raises :class:`CaptureConflict` (the
  store disables parking and the request recomputes); a capture that cannot drain in time logs
  one warning and proceeds, so parking can never stop a capture.

CPU engines do not use the lock (there is no capture). Importing this module imports no SGLang.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_log = logging.getLogger("dsv41")
LOCKED_MODES = frozenset({"global", "default"})  # torch's "default" is cudaStreamCaptureModeGlobal


class CaptureConflict(RuntimeError):
    """A parking copy could not run because a CUDA graph capture holds the device."""


class CaptureLock:
    """Mutual exclusion of copy-engine work and global-mode graph captures (many copies or many captures)."""

    def __init__(self, wait_s: float = 30.0):
        self.wait_s = float(wait_s)
        self._cond = threading.Condition()
        self._copies = 0  # copies in flight
        self._captures = 0  # captures begun and not yet ended (nested, or on several threads)
        self._capturing: dict[int, int] = {}  # thread id -> open captures on that thread
        self._locked_graphs: set[int] = set()  # id() of graphs whose capture_begin took the lock
        self.drains = 0  # captures that had to wait for copies in flight
        self.waits = 0  # copies that had to wait for a capture

    @property
    def copies_in_flight(self) -> int:
        return self._copies

    @property
    def captures_open(self) -> int:
        return self._captures

    @contextmanager
    def copy(self) -> Iterator[None]:
        """Hold the device for one copy: waits while a capture is open."""
        me = threading.get_ident()
        with self._cond:
            if self._capturing.get(me):
                raise CaptureConflict("a KV-parking copy was asked for on a thread that is capturing a CUDA graph")
            if self._captures:
                self.waits += 1
                if not self._cond.wait_for(lambda: self._captures == 0, timeout=self.wait_s):
                    raise CaptureConflict(f"a CUDA graph capture held the device for more than {self.wait_s:g} s")
            self._copies += 1
        try:
            yield
        finally:
            with self._cond:
                self._copies -= 1
                self._cond.notify_all()

    def begin_capture(self) -> None:
        """Hold new copies back, then wait (at most ``wait_s``) for the copies in flight."""
        me = threading.get_ident()
        with self._cond:
            self._captures += 1
            self._capturing[me] = self._capturing.get(me, 0) + 1
            if self._copies:
                self.drains += 1
                start = time.monotonic()
                if not self._cond.wait_for(lambda: self._copies == 0, timeout=self.wait_s):
                    _log.warning(
                        "[dsv41] kv_park capture_drain_timeout copies=%d waited_s=%.1f",
                        self._copies,
                        time.monotonic() - start,
                    )

    def end_capture(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._captures <= 0:
                return
            self._captures -= 1
            left = self._capturing.get(me, 0) - 1
            if left > 0:
                self._capturing[me] = left
            else:
                self._capturing.pop(me, None)
            self._cond.notify_all()

    @contextmanager
    def capture(self) -> Iterator[None]:
        """``begin_capture`` ... ``end_capture`` around a block (for callers that own the capture)."""
        self.begin_capture()
        try:
            yield
        finally:
            self.end_capture()


CAPTURE_LOCK = CaptureLock()


def _capture_mode(args: tuple, kwargs: dict) -> str:
    # CUDAGraph.capture_begin(self, pool=None, capture_error_mode="global", ...)
    if "capture_error_mode" in kwargs:
        return str(kwargs["capture_error_mode"])
    return str(args[1]) if len(args) > 1 else "global"


def locked_capture_begin(
    wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict, lock: CaptureLock | None = None
) -> Any:
    """Wrapper of ``torch.cuda.CUDAGraph.capture_begin``: drain parking copies before a global-mode capture."""
    lock = CAPTURE_LOCK if lock is None else lock
    if _capture_mode(args, kwargs) not in LOCKED_MODES:
        return wrapped(*args, **kwargs)
    lock.begin_capture()
    try:
        result = wrapped(*args, **kwargs)
    except BaseException:
        lock.end_capture()
        raise
    with lock._cond:
        lock._locked_graphs.add(id(instance))
    return result


def locked_capture_end(
    wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict, lock: CaptureLock | None = None
) -> Any:
    """Wrapper of ``torch.cuda.CUDAGraph.capture_end``: release the lock (also when ending fails)."""
    lock = CAPTURE_LOCK if lock is None else lock
    with lock._cond:
        locked = id(instance) in lock._locked_graphs
        lock._locked_graphs.discard(id(instance))
    try:
        return wrapped(*args, **kwargs)
    finally:
        if locked:
            lock.end_capture()
