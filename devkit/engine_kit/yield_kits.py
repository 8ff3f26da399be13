"""The decode-yield workload's kits: 4 or 2 streams decoding while a long prompt prefills in chunks,
on the tiny Mellum kit or the DSV4 kit, as ``bench decode-yield-engine`` and ``bench
decode-yield-reference`` boot them (one server per boot; the model or checkpoint folder the gate
builds, once)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MAX_TOTAL_TOKENS = 32768  # the Mellum kit: 4 streams x (32 + 4000) + the long prompt, never short of KV


class MellumYieldKit:
    """The tiny Mellum kit (:mod:`devkit.engine_kit`): 4 streams, chunks of 64."""

    name, chunk, streams = "mellum", 64, 4

    def build(self, out: Path) -> Path:
        from devkit.engine_kit import model_kits

        return model_kits.kit("mellum").build(out)  # the gate's model folder beside out (in its parent), built once

    def server(self, model: Path, log: Path, profile: dict[str, str], extra: list[str], chunk: int) -> Any:
        from devkit.engine_kit import launcher

        args = launcher.server_args(model, launcher.free_port(), max_total_tokens=MAX_TOTAL_TOKENS, chunk=chunk,
                                    extra=extra)
        return launcher.Server(args, log, profile)

    def workload(self, long_tokens: int) -> Any:
        from devkit.engine_kit import workload as wl

        # Streams long enough never to run out during the slowest prefill (pct 70: ~3.5x stock's TTFT).
        return wl.Workload(streams=self.streams, stream_prompt_tokens=32, stream_max_tokens=4000,
                           long_prompt_tokens=long_tokens, before_s=2.0, after_s=2.0)


class Dsv4YieldKit:
    """The tiny DeepSeek-V4 kit (:mod:`devkit.engine_kit.dsv4`, the gate's DSV4 model: 3 layers
    C0/C4/C128, 256-token pages, fp8 KV): 2 streams, a prompt of 16 pages in chunks of one page
    (16 windows)."""

    name, chunk, streams = "dsv4", 256, 2

    def build(self, out: Path) -> Path:
        from devkit.engine_kit import model_kits

        return model_kits.kit("dsv4").build(out)  # the gate's checkpoint folder beside out (in its parent), built once

    def server(self, model: Path, log: Path, profile: dict[str, str], extra: list[str], chunk: int) -> Any:
        from devkit.engine_kit import model_kits
        from devkit.engine_kit.dsv4 import launch

        # the gate's pool and running rows (2 streams and the long prompt); the SWA share sized for the chunk
        return launch.server(model, log, profile, ready_timeout_s=600.0, max_total_tokens=model_kits.DSV4_MAX_TOTAL_TOKENS,
                             max_running=model_kits.DSV4_MAX_RUNNING, chunk=chunk, extra=extra)

    def workload(self, long_tokens: int) -> Any:
        from devkit.engine_kit import workload as wl

        return wl.Workload(streams=self.streams, stream_prompt_tokens=32, stream_max_tokens=1500,
                           long_prompt_tokens=long_tokens, before_s=3.0, after_s=3.0, timeout_s=900.0)
