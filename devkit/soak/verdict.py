"""The soak's verdict and the parking budget it checks (pure: figures in, verdict out)."""

from __future__ import annotations

from typing import Any


def parked_bytes_bound(spec: Any, max_total_tokens: int) -> int:
    """What parking could ever hold at once: every KV byte of both pools of the kit's model (K and
    V of every layer, fp32/bf16), since only pages the pool had are parked."""
    width = 4 if spec.dtype == "float32" else 2
    return max_total_tokens * spec.layers * spec.kv_heads * spec.head_dim * 2 * width


def soak_verdict(passed: bool, memory_verdict: str) -> str:
    """FAIL on any failure (a leak included); else PASS only when memory was judged and passed:
    INCONCLUSIVE when the run was too short or too noisy to tell a leak (``inconclusive``,
    ``unjudged``), whatever else passed."""
    if not passed:
        return "FAIL"
    return "PASS" if memory_verdict == "pass" else "INCONCLUSIVE"


def parked_budget(f: dict[str, Any], bound: int | None) -> dict[str, Any]:
    """Parking stayed within its budget: no refusal over the budget, and the whole pool (what
    parking could ever hold at once) is under the smallest budget (``DSV41_KV_PARK_GIB=1``)."""
    gib = 1 << 30
    park = f.get("kv_park") or {}
    over = f.get("kv_park_over_budget", 0)
    respected = not over and (bound is None or bound <= gib) and not park.get("disabled")
    return {"respected": respected, "declined_over_budget": over, "pool_bytes_bound": bound, "budget_bytes": gib, "disabled": park.get("disabled", 0)}
