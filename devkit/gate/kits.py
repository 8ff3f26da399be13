"""The model kits the gate can boot: what model it builds, how a server of it starts, what workload fits.

* ``mellum``: the tiny hybrid SWA model (:mod:`devkit.engine_kit.model`; fp32, page 1, window 31,
  ``torch_native`` routed to SGLang's CPU backend).
* ``dsv4``: the tiny DeepSeek-V4.1 model (:mod:`devkit.engine_kit.dsv4.checkpoint`, the fleet's
  model type; bf16, fp8 KV, page 256, window 128, ``--attention-backend dsv4`` on the kit's
  pure-torch stand-ins, :mod:`devkit.engine_kit.dsv4.launch`). Its workload is sized in whole
  256-token pages and chunks, so the same phases act on the paged DeepSeek-V4 pool.

Every boot of one gate run shares the kit's model, seed, server arguments and workload; the boots
differ only in their ``DSV41_*`` profile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class Kit(Protocol):
    name: str

    def build(self, out: Path) -> Path: ...

    def describe(self) -> str: ...

    def server(self, model: Path, log: Path, profile: dict[str, str], extra: Sequence[str]) -> Any: ...

    def workload(self, quick: bool) -> Any: ...

    def profile_overrides(self) -> dict[str, str]: ...


@dataclass(frozen=True)
class MellumKit:
    name: str = "mellum"

    def build(self, out: Path) -> Path:
        from devkit.engine_kit import model as mk

        spec = mk.ModelSpec()
        return mk.make_model(out.parent / f"engine_kit_model_{spec.digest()}", spec)

    def describe(self) -> str:
        from devkit.engine_kit import model as mk

        return f"mellum (window {mk.ModelSpec().window}, page 1)"

    def server(self, model: Path, log: Path, profile: dict[str, str], extra: Sequence[str]) -> Any:
        from devkit.engine_kit import launcher

        args = launcher.server_args(model, launcher.free_port(), swa_ratio=0.1, extra=list(extra))
        return launcher.Server(args, log, profile)

    def workload(self, quick: bool) -> Any:
        from devkit.engine_kit import workload as wl

        return wl.Workload.quick() if quick else wl.Workload.full()

    def profile_overrides(self) -> dict[str, str]:
        return {}  # the registry's gate roles are set for this kit


# The DSV4 kit's pool: 128 pages of Full KV, room for the whole workload, so the churn evicts SWA
# windows only (at 64 pages it evicted the idle session's Full KV too, and nothing could act); SWA
# sized by the launcher's no-starvation rule for the yield phase's rows (4 streams + the long
# prompt + one spare).
DSV4_MAX_TOTAL_TOKENS = 128 * 256
DSV4_MAX_RUNNING = 6
# Four pages a chunk: a cone replay's first chunk must cover [s, F) (N = 768 plus the new message),
# else it falls back to the stock match (first_chunk_short, seen at 256).
DSV4_CHUNK = 4 * 256
# 20 SWA pages: every finished request's resume point fits (the churn's 6 leaves and both sessions'),
# the churn's passed chunk checkpoints do not, so stock's LRU order evicts the idle session's
# resume point and SWA thin's keeps it (the launcher refuses fewer than 17 for these rows and chunk).
DSV4_SWA_RATIO = 20 * 256 / DSV4_MAX_TOTAL_TOKENS


@dataclass(frozen=True)
class Dsv4Kit:
    name: str = "dsv4"
    model_type: str = "deepseek_v41"

    def build(self, out: Path) -> Path:
        from devkit.engine_kit.dsv4 import checkpoint

        return checkpoint.make_checkpoint(out.parent / f"dsv4_kit_model_{self.model_type}", model_type=self.model_type)

    def describe(self) -> str:
        return f"dsv4 ({self.model_type}, 3 layers C0/C4/C128, window 128, page 256, fp8 KV)"

    def server(self, model: Path, log: Path, profile: dict[str, str], extra: Sequence[str]) -> Any:
        from devkit.engine_kit.dsv4 import launch

        return launch.server(model, log, profile, ready_timeout_s=600.0, max_total_tokens=DSV4_MAX_TOTAL_TOKENS,
                             max_running=DSV4_MAX_RUNNING, chunk=DSV4_CHUNK, swa_ratio=DSV4_SWA_RATIO,
                             extra=list(extra))

    def workload(self, quick: bool) -> Any:
        from devkit.engine_kit import workload as wl

        page = 256
        # Whole pages everywhere: the idle session is one chunk, each churn request two (one passed
        # checkpoint, one leaf); the branched session's branch point sits 768 tokens past its prompt's
        # checkpoint; the long prompt prefills in 1024-token chunks beside the streams.
        return wl.Workload(
            session_tokens=4 * page, cone_prompt_tokens=page, cone_tokens=5 * page, cone_branch_at=4 * page,
            churn_requests=6 if quick else 10, churn_tokens=8 * page, turn_tokens=8, new_user_tokens=24,
            streams=4, stream_prompt_tokens=32, stream_max_tokens=600,
            long_prompt_tokens=(16 if quick else 32) * page, before_s=3.0, timeout_s=900.0,
            cone_followup_tokens=24,
        )

    def profile_overrides(self) -> dict[str, str]:
        # Replay depth: a page multiple at least the kit model's bound (cone_replay checks it at
        # cache build; 768 for 3 layers C0/C4/C128, window 128, page 256).
        return {"DSV41_SWA_CONE_TOKENS": "768"}


KITS: dict[str, Kit] = {"mellum": MellumKit(), "dsv4": Dsv4Kit()}


def kit(name: str) -> Kit:
    try:
        return KITS[name]
    except KeyError:
        raise ValueError(f"--model {name!r} is invalid: expected one of {', '.join(KITS)}") from None
