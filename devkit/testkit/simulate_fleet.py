"""A small fleet for ``simulate``'s tests: page 16, window 8, chunk 128, a small SWA pool (other
traffic evicts windows) and a large Full pool (Full KV stays), and one policy's replay on it with
the leak check asserted."""

from __future__ import annotations

from typing import Any

from overlay_tools import simulate
from overlay_tools.simulate import fleet

PAGE, WINDOW, CHUNK, N = 16, 8, 128, 64


def small_fleet(swa_pool: int = 768, full_tokens: int = 1 << 16, hicache_ratio: float = 2.0,
                kv_park: bool = False, write_policy: str = "write_through") -> fleet.Fleet:
    return fleet.Fleet(page=PAGE, window=WINDOW, chunk=CHUNK, max_running=8, tails=0, swa_pool=swa_pool,
                       full_tokens=full_tokens, full_source="test", cone_tokens=N, cone_bound=32, model="test",
                       profile="test", hicache_ratio=hicache_ratio, hicache_write_policy=write_policy,
                       kv_park=kv_park)


def replay(policy: str, requests: list[Any], swa_pool: int = 768, **fleet_args: Any) -> tuple[list[Any], dict[str, Any]]:
    """``policy``'s turns and figures on :func:`small_fleet`; nothing leaked."""
    turns, row = simulate.run_policy(policy, small_fleet(swa_pool, **fleet_args), requests, progress=False)
    assert row["leak"] == 0, f"{policy}: slots leaked"
    return turns, row
