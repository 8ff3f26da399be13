"""``bench chat-latency``'s entry: the rows A B A B (:func:`devkit.bench.chat_latency.run`), or with ``--sweep``
stock, yield and the shipped profile at offered loads up to the kit's stock capacity
(:func:`devkit.bench.chat_latency.sweep.run`). Its own module so that the package and the sweep, which
imports the package, import no circle."""

from __future__ import annotations

from typing import Any

from devkit.bench import chat_latency
from devkit.bench.chat_latency import sweep as load_sweep


def run(quick: bool = False, model: str = "mellum", rounds: int | None = None, varied: bool = False,
        sweep: bool = False) -> dict[str, Any]:
    if sweep:
        return load_sweep.run(quick, model)
    return chat_latency.run(quick, model, rounds, varied)
