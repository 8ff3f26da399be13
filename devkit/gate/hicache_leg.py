"""The gate's HiCache leg (``gate --hicache``): the datacenter profile's HiCache, on a workload where
stock + HiCache loses the idle session.

Every boot (A1, B, A2) runs with the HiCache launch flags of :data:`PROFILE`'s ``LAUNCH_ARGS`` (read
with the project's env-file reader, as ``check`` reads them), so the leg runs what the profile runs:
its host ratio and its write policy. The kit sizes the workload's churn from them (Mellum:
:func:`devkit.engine_kit.model_kits.outrun_host_tier`; DSV4: the churn found per setting,
:data:`devkit.engine_kit.model_kits.DSV4_HICACHE_CHURN`) so that it outruns the device SWA pool and the
host tier together: the idle session's window is gone from both, stock + HiCache resumes it uncached,
and SWA thin's row passes only where thin kept it.

Then a host phase (:func:`devkit.engine_kit.workload.run_host_phase`): a session's turn, churn past
the device Full pool (:func:`devkit.engine_kit.model_kits.press_full_pool`) so its Full KV goes to host (the
write policy copied it there) and its window out of both tiers, and the session's resume. Stock +
HiCache cannot load that Full KV back without the window and re-prefills; the row
``cone_replay (Full KV from host)`` (:func:`devkit.gate.verdict.host_load_gaps`) passes only where the
cone's ``DSV41_SWA_CONE load`` line for that resume says the Full KV came back from host and its plan
replayed N.
"""

from __future__ import annotations

from pathlib import Path

PROFILE = Path(__file__).resolve().parents[2] / ".env.h200-hicache.example"  # the datacenter profile
ON = "--enable-hierarchical-cache"
PREFIX = "--hicache-"


def launch_args(profile: str | Path = PROFILE) -> tuple[str, ...]:
    """The HiCache flags of ``profile``'s launch arguments (``--enable-hierarchical-cache`` and every
    ``--hicache-*`` flag with its value), in the profile's order; a clear error when it has none."""
    from adapter.core import env
    from adapter.ops import check

    path = Path(profile)
    if not path.is_file():
        raise ValueError(f"the HiCache leg's profile {path} is missing: the leg runs that profile's HiCache flags")
    words = env.read_env_file(str(path)).get(check.LAUNCH_KEY, "").split()  # as check and $LAUNCH_ARGS split it
    args: list[str] = []
    for i, word in enumerate(words):
        previous = words[i - 1] if i else ""
        if word == ON or word.startswith(PREFIX):
            args.append(word)
        elif previous.startswith(PREFIX) and "=" not in previous and not word.startswith("-"):
            args.append(word)  # the value of the --hicache-* flag before it
    if ON not in args:
        raise ValueError(f"{path} {check.LAUNCH_KEY} has no {ON}: the HiCache leg needs a profile that runs HiCache")
    return tuple(args)


def host_ratio(args: tuple[str, ...]) -> float:
    """The host tier's size over the device KV pool (``--hicache-ratio``): the kit sizes the leg's
    churn from it, so a profile that sizes its host tier otherwise (``--hicache-size``, or SGLang's
    default that depends on the host memory mode) is a clear error."""
    from adapter.ops import check

    flags = check.parse_launch(list(args)).hicache or {}
    if flags.get("ratio") is None or flags.get("size_gb"):
        raise ValueError(f"HiCache flags {' '.join(args)!r} are invalid for the gate's HiCache leg: expected "
                         "--hicache-ratio R and no --hicache-size (the leg sizes its churn from the ratio)")
    return float(flags["ratio"])


def write_policy(args: tuple[str, ...]) -> str:
    """The host tier's write policy (``--hicache-write-policy``, SGLang's default where unset): the DSV4
    kit's churn was found per ratio and policy."""
    from adapter.ops import check

    return str((check.parse_launch(list(args)).hicache or {}).get("write_policy"))
