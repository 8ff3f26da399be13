"""What a boot sends besides the yield phase: the calibration requests, the lone long prompt (the
boot's own TTFT reference) and, under load, a competing process."""

from __future__ import annotations

import time
from typing import Any

from devkit.engine_kit.scheduler_clock import SchedulerClock


def calibration_requests(base_url: str, w: Any) -> None:
    """Single requests of several lengths: prefill chunks at many prefixes, decode at batch 1."""
    from devkit.engine_kit import client

    for i, n in enumerate((40, 300, 1000, 2500)):
        client.generate(base_url, w.ids(f"calib{i}", n), 24, w.timeout_s)


def lone_ttft(base_url: str, w: Any, tag: str, clock: SchedulerClock | None = None) -> tuple[float, float | None]:
    """The long prompt's TTFT alone (no streams) on this boot: decode yield leaves a lone prompt as
    stock, so it is the boot's own reference, free of the load drift between boots. A prompt of the
    same length and other tokens runs first, untimed, so the lone prompt is not the boot's first
    long prompt: timed cold, the stock boots' in-boot factor read 0.68-1.44 over four full Mellum
    runs, below 1.0 in 5 of 12 boots (the same prompt beside four nearly starved streams faster
    than alone), and a slow lone prompt flatters every in-boot factor of its boot."""
    from devkit.engine_kit import client

    client.flush_cache(base_url)
    client.generate(base_url, w.ids("warm", w.long_prompt_tokens), 1, w.timeout_s)
    client.flush_cache(base_url)
    long = client.Stream(base_url, f"{tag}-alone", w.ids("long", w.long_prompt_tokens), 1, w.timeout_s)
    t_send = time.monotonic()
    long.start()
    long.join(w.timeout_s)
    if long.error or not long.ticks:
        raise RuntimeError(f"the lone long prompt failed: {long.error}")
    time.sleep(0.05)  # one clock sample past the first token
    t_first = long.ticks[0][0]
    cpu = round(clock.at(t_first) - clock.at(t_send), 3) if clock is not None and clock.samples else None
    return t_first - t_send, cpu


def competing_process() -> Any:
    """A CPU-bound process (a Python busy loop) competing for a core; ``.kill()`` it when done."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", "while True: pass"])
