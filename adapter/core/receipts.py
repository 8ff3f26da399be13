"""The ``[dsv41]`` log lines: one logger, one format, and its parser.

Format (one line each, machine-parseable; ``rank`` is always the last field)::

    [dsv41] <switch> installed [key=value ...] rank=<rank>
    [dsv41] <switch> refused: <reason> rank=<rank>
    [dsv41] <switch> <event> [key=value ...] rank=<rank>      # periodic or per-action lines

``rank`` is ``tp<N>`` (with ``pp<M>``/``dp<K>`` where they are non-zero) when the engine has told
the process its rank, else ``pid<PID>``. ``installed`` and ``refused`` are logged at most once per
switch per process and rank.

A scheduler process imports the switches' modules before SGLang publishes its rank, so a switch
installed at import logs ``rank=pid<PID>`` there, as it does in every other process that imports the
module (the server's main process, the detokenizer). Once the scheduler knows its rank, the boot
logs the receipt of each switch decided so far once more (``installed``, ``refused:`` or ``armed``)
under ``tp<N>`` (:func:`adapter.core.boot.announce_rank`). :func:`audit` therefore counts ranks from
``tp`` receipts only: a ``pid`` receipt never stands for a scheduler rank (its refusals still count).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from adapter.core import metrics

LOGGER_NAME = "dsv41"
TAG = "[dsv41]"

_logger = logging.getLogger(LOGGER_NAME)
_once: set[tuple[str, str, str]] = set()  # (switch, installed | refused, rank)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (it is replaced by daemons and test capture)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def logger() -> logging.Logger:
    """The overlay's logger; its own stderr handler so engine log setup cannot swallow receipts."""
    if not _logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        _logger.addHandler(handler)
        _logger.setLevel(logging.DEBUG if debug_log_enabled(os.environ) else logging.INFO)
        _logger.propagate = False
    return _logger


def debug_log_enabled(environ) -> bool:
    """``DSV41_DEBUG_LOG`` as its flag parser reads it (``1``, ``true``, ``on``, ``yes``, any case); a
    bad value is reported by the configuration check, and leaves DEBUG off here."""
    from adapter.core import env

    raw = environ.get("DSV41_DEBUG_LOG")
    if raw is None:
        return False
    try:
        return env.flag()("DSV41_DEBUG_LOG", raw)
    except env.ConfigError:
        return False


def current_rank() -> str:
    """The process's rank as the engine knows it, else its pid."""
    ranks = _engine_ranks()
    if ranks is None:
        return f"pid{os.getpid()}"
    tp, pp, dp = ranks
    return f"tp{tp}" + (f"pp{pp}" if pp else "") + (f"dp{dp}" if dp else "")


def _engine_ranks() -> tuple[int, int, int] | None:
    module = sys.modules.get("sglang.srt.runtime_context")
    if module is None:
        return None
    try:
        parallel = module.get_parallel()
        return int(parallel.tp_rank), int(parallel.pp_rank or 0), int(parallel.dp_rank or 0)
    except Exception:  # not published yet in this process: fall back to the pid
        return None


def _fields(params: dict[str, object]) -> str:
    return "".join(f" {k}={v}" for k, v in params.items())


def installed(switch: str, **params: object) -> None:
    rank = current_rank()
    if (switch, "installed", rank) in _once:
        return
    _once.add((switch, "installed", rank))
    logger().info("%s %s installed%s rank=%s", TAG, switch, _fields(params), rank)


def refused(switch: str, reason: str) -> None:
    rank = current_rank()
    if (switch, "refused", rank) in _once:
        return
    _once.add((switch, "refused", rank))
    reason = " ".join(reason.split())  # one line, always
    logger().warning("%s %s refused: %s rank=%s", TAG, switch, reason, rank)


def is_engine_rank(rank: str) -> bool:
    """``tp<N>[pp<M>][dp<K>]``: a rank the engine published (a scheduler), not a process id."""
    return re.fullmatch(r"tp\d+(pp\d+)?(dp\d+)?", rank) is not None


def event(switch: str, what: str, *, level: int = logging.INFO, **params: object) -> None:
    """A per-action or periodic line (not deduplicated); the metrics count the same event."""
    log = logger()
    if log.isEnabledFor(level):  # a dropped DEBUG line formats nothing (no rank lookup)
        log.log(level, "%s %s %s%s rank=%s", TAG, switch, what, _fields(params), current_rank())
    metrics.observe(switch, what, params)


def warn(message: str) -> None:
    logger().warning("%s %s", TAG, " ".join(message.split()))


def reset_for_tests() -> None:
    _once.clear()


@dataclass
class Receipt:
    switch: str
    event: str
    rank: str
    reason: str = ""
    params: dict[str, str] = field(default_factory=dict)

    @property
    def refusal(self) -> bool:
        """The ``<switch> refused: <reason>`` receipt (with the colon): the switch is not acting. A
        per-action line whose event word happens to be ``refused`` (no colon, key=value fields) is not."""
        return self.event == "refused" and bool(self.reason)


def parse_line(line: str) -> Receipt | None:
    """Parse one log line; None when it is not a ``[dsv41] <switch> ...`` receipt."""
    start = line.find(TAG)
    if start < 0:
        return None
    body, sep, rank = line[start + len(TAG) :].strip().rpartition(" rank=")
    if not sep or not rank or " " in rank:
        return None
    head, colon, reason = body.partition(": ")
    words = head.split()
    if len(words) < 2 or not re.fullmatch(r"[a-z0-9_]+", words[0]):
        return None
    if colon and words[1:] != ["refused"]:  # ": " inside a per-action line is not a reason
        head, reason, colon = body, "", ""
        words = head.split()
    event_words = [w for w in words[1:] if "=" not in w]
    params = dict(w.split("=", 1) for w in words[1:] if "=" in w)
    return Receipt(words[0], " ".join(event_words), rank, reason.strip() if colon else "", params)


def audit(lines: list[str], config: Any, ranks: int) -> list[str]:
    """The gaps between a profile (a resolved ``registry.Config``) and a boot's receipt lines, one
    sentence each, the switch's name first (empty: each of ``ranks`` scheduler ranks logged every
    requested switch as installed under its ``tp`` rank, and none refused). ``pid`` receipts never
    count as ranks (see the module docstring). ``receipts`` prints them; the release gate reads them."""
    installed: dict[str, set[str]] = {s.name: set() for s in config.requested}
    by_pid: dict[str, set[str]] = {s.name: set() for s in config.requested}
    armed: dict[str, set[str]] = {s.name: set() for s in config.requested}
    gaps = list(config.errors)
    for line in lines:
        if TAG in line and "configuration error" in line:
            gaps.append("boot logged a configuration error: " + line.strip())
        receipt = parse_line(line)
        if receipt is None or receipt.switch not in installed:
            continue
        if receipt.event == "installed":
            (installed if is_engine_rank(receipt.rank) else by_pid)[receipt.switch].add(receipt.rank)
        elif receipt.event == "armed":  # decided later (cone replay: at cache build)
            armed[receipt.switch].add(receipt.rank)
        elif receipt.refusal:
            gaps.append(f"{receipt.switch} refused on {receipt.rank}: {receipt.reason}")
    for name, seen in installed.items():
        undecided = sorted(r for r in armed[name] - seen if is_engine_rank(r))
        if undecided and not any(name in gap for gap in gaps):
            gaps.append(f"{name} armed on {', '.join(undecided)} but never installed (no cache was built?)")
        if len(seen) < ranks:
            shown = ", ".join(sorted(seen)) or (
                f"none; {len(by_pid[name])} pid receipt(s), which name no scheduler rank" if by_pid[name] else "none")
            gaps.append(f"{name} installed on {len(seen)} of {ranks} ranks ({shown})")
    return gaps
