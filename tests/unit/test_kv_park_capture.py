"""The capture lock: parking copies and global-mode CUDA graph captures never overlap (CPU, no SGLang).

The device side of the same invariants is in ``test_kv_park_cuda.py`` (``-m cuda``).
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from adapter.switches.kv_park.capture import CaptureConflict, CaptureLock, locked_capture_begin, locked_capture_end
from adapter.switches.kv_park.engine import CopyEngine
from adapter.switches.kv_park.page_format import PageLayout, Region


def _on_thread(fn) -> tuple[threading.Thread, list]:
    box: list = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:
            box.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_a_copy_asked_for_while_a_capture_is_open_waits_until_it_ends():
    lock = CaptureLock(wait_s=5)
    entered = threading.Event()
    lock.begin_capture()

    def copy() -> float:
        with lock.copy():
            entered.set()
            return time.monotonic()

    t, box = _on_thread(copy)
    assert not entered.wait(0.1), "a copy ran inside an open capture"
    ended = time.monotonic()
    lock.end_capture()
    t.join(5)
    assert box and box[0] >= ended and lock.waits == 1 and lock.copies_in_flight == 0


def test_a_capture_begins_only_after_the_copies_in_flight_have_drained():
    lock = CaptureLock(wait_s=5)
    release, inside = threading.Event(), threading.Event()
    done_at: list[float] = []

    def copy() -> None:
        with lock.copy():
            inside.set()
            release.wait(5)
            done_at.append(time.monotonic())

    t, _ = _on_thread(copy)
    assert inside.wait(5)
    c, began = _on_thread(lambda: (lock.begin_capture(), time.monotonic())[1])
    time.sleep(0.1)
    assert not began, "the capture began while a copy was in flight"
    release.set()
    c.join(5)
    t.join(5)
    assert began[0] >= done_at[0] and lock.drains == 1 and lock.captures_open == 1
    lock.end_capture()
    assert lock.captures_open == 0


def test_a_copy_on_the_capturing_thread_is_refused_at_once():
    lock = CaptureLock(wait_s=30)
    with lock.capture():
        start = time.monotonic()
        with pytest.raises(CaptureConflict, match="thread that is capturing"), lock.copy():
            pass
        assert time.monotonic() - start < 1
    with lock.copy():  # the lock is free again
        pass


def test_waits_are_bounded_a_copy_raises_and_a_capture_proceeds_with_one_warning(caplog):
    lock = CaptureLock(wait_s=0.05)
    lock.begin_capture()
    t, box = _on_thread(lambda: lock.copy().__enter__())
    t.join(5)
    assert isinstance(box[0], CaptureConflict) and "more than 0.05 s" in str(box[0])
    lock.end_capture()

    release = threading.Event()

    def hold() -> None:
        with lock.copy():
            release.wait(5)

    h, _ = _on_thread(hold)
    while not lock.copies_in_flight:
        time.sleep(0.001)
    logger = logging.getLogger("dsv41")
    logger.addHandler(caplog.handler)
    try:
        lock.begin_capture()  # returns after wait_s although the copy still runs
    finally:
        logger.removeHandler(caplog.handler)
    assert lock.captures_open == 1
    assert [r.getMessage() for r in caplog.records if "capture_drain_timeout" in r.getMessage()]
    lock.end_capture()
    release.set()
    h.join(5)


class _FakeGraph:
    """Stands in for ``torch.cuda.CUDAGraph``: records how many captures held the lock when it began."""

    def __init__(self, lock: CaptureLock, fail_begin: bool = False, fail_end: bool = False):
        self.lock, self.fail_begin, self.fail_end = lock, fail_begin, fail_end
        self.seen: list[int] = []

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        self.seen.append(self.lock.captures_open)
        if self.fail_begin:
            raise RuntimeError("capture_begin failed")

    def capture_end(self) -> None:
        if self.fail_end:
            raise RuntimeError("capture invalidated")


def _begin(graph: _FakeGraph, *args, **kwargs) -> None:
    locked_capture_begin(graph.capture_begin, graph, args, kwargs, lock=graph.lock)


def _end(graph: _FakeGraph) -> None:
    locked_capture_end(graph.capture_end, graph, (), {}, lock=graph.lock)


@pytest.mark.parametrize(
    ("args", "kwargs", "locked"),
    [
        ((), {}, True),
        ((), {"capture_error_mode": "global"}, True),
        ((None, "default"), {}, True),
        ((), {"capture_error_mode": "thread_local"}, False),
        ((None, "relaxed"), {}, False),
    ],
    ids=["default-arg", "global", "default-positional", "thread_local", "relaxed"],
)
def test_only_global_mode_captures_take_the_lock(args, kwargs, locked):
    lock = CaptureLock(wait_s=1)
    graph = _FakeGraph(lock)
    _begin(graph, *args, **kwargs)
    assert graph.seen == [1 if locked else 0] and lock.captures_open == (1 if locked else 0)
    _end(graph)
    assert lock.captures_open == 0


def test_the_lock_is_released_when_capture_begin_or_capture_end_fails():
    lock = CaptureLock(wait_s=1)
    with pytest.raises(RuntimeError, match="capture_begin failed"):
        _begin(_FakeGraph(lock, fail_begin=True))
    assert lock.captures_open == 0
    graph = _FakeGraph(lock, fail_end=True)
    _begin(graph)
    with pytest.raises(RuntimeError, match="capture invalidated"):
        _end(graph)
    assert lock.captures_open == 0
    graph.fail_end = False
    _end(graph)  # a second end of the same graph does not release someone else's capture
    assert lock.captures_open == 0


def test_a_cpu_engine_does_not_use_the_capture_lock():
    rows = torch.arange(64, dtype=torch.uint8).view(8, 8)
    lock = CaptureLock(wait_s=0.01)
    engine = CopyEngine(PageLayout((Region("kv", rows),)), capture_lock=lock)
    assert engine._capture_lock is None
    with lock.capture():  # a capture elsewhere in the process does not hold up CPU copies
        assert torch.equal(engine.save([3, 1]), rows[[3, 1]])
