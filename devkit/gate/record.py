"""What one gate boot recorded: its profile, its log and the figures its workload measured.

Its own module so that the boots (:mod:`devkit.gate.boots`, which run them) and the judgement
(:mod:`devkit.gate.verdict`, which reads them) both import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Boot:
    label: str
    profile: dict[str, str]
    log: Path
    fpm_log: Path | None = None
    startup_s: float | None = None
    cache: dict[str, Any] = field(default_factory=dict)
    yield_: dict[str, Any] = field(default_factory=dict)
    host: dict[str, Any] = field(default_factory=dict)  # the host phase's figures (the HiCache leg's)
    yield_log_from: int = 0
    log_lines: list[str] = field(default_factory=list)
    leftover: list[int] = field(default_factory=list)
    launch_extra: tuple[str, ...] = ()  # server arguments this gate run adds to every boot (--hicache)

    @property
    def hicache(self) -> bool:
        return "--enable-hierarchical-cache" in self.launch_extra

    def outputs(self) -> dict[str, list[int]]:
        return {**self.cache.get("outputs", {}), **self.host.get("outputs", {}), **self.yield_.get("outputs", {})}
