"""The fleet's geometry (from a profile and a model config) and one real cache per policy.

Geometry: page, chunk, ``--swa-prefix-tails`` and ``--max-running-requests`` from the profile's
launch line (SGLang's own parser, :func:`adapter.ops.check.parse_launch`); the sliding window, layer
count and the cone's bound from the model's ``config.json`` (``check.read_model`` /
cone replay's own predictor and decision); for a DeepSeek-V4 model every pool from SGLang's
``DSV4PoolConfigurator`` at the model's compression ratios (:func:`.dsv4_pool.configure`; the replay
runs on SGLang's ``DeepSeekV4TokenToKVPool``, one layer per ratio standing in), for another SWA model
the SWA pool from the configurator's cap-mode formula (``DSV4PoolConfigurator._resolve_swa_cap_tokens``
for that many tails at that many running requests, :func:`.swa_pool.swa_pool_for_tails`) on a
one-layer ``SWAKVPool``; the Full pool from ``--kv-tokens``, else the
launch line's ``--max-total-tokens``, else :data:`DEFAULT_FULL_TOKENS` (an assumption, said in the
output). Without a model folder the production profile's DeepSeek-V4.1 is assumed: window 128, 61
layers, the last one C128, last KV source at layer 10, decoder SWA bounded replay on as SGLang
resolves it on CUDA (bound 2,048; the shape ``tests/upstream/test_cone_replay_dsv4_seams.py``
checks).

Policies (the switches installed through the registry's boot, as a serving process does):

* ``stock``: SGLang's defaults (the Rust tree core, stock LRU order); nothing installed.
* ``thin``: ``DSV41_SWA_THIN=1`` (which turns on the Python core and ``fast_tree_core``).
* ``thin+cone``: ``DSV41_SWA_THIN=1 DSV41_SWA_CONE_REPLAY=1 DSV41_SWA_CONE_TOKENS=N``.
* ``stock+hicache``, ``thin+cone+hicache``: the same with HiCache's host tier attached
  (``init_hicache`` as ``--enable-hierarchical-cache`` does; :class:`.cache_kit.HiCache`; on the DSV4
  pool SGLang selects its DeepSeek-V4 host stack):
  host pools of ``--hicache-ratio`` x each device pool, ``--hicache-write-policy`` from the launch
  line (SGLang's defaults: ratio 2, write_through), and the admission's load-back of host hits.
  Run by default only when the profile's launch line enables HiCache (:func:`default_policies`).
"""

from __future__ import annotations

import importlib
import os
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from adapter.core import env

POLICIES = ("stock", "thin", "thin+cone", "stock+hicache", "thin+cone+hicache")
HICACHE_SUFFIX = "+hicache"
REPO = Path(__file__).resolve().parents[2]
DEFAULT_PROFILE = REPO / ".env.tp4.example"
DEFAULT_FULL_TOKENS = 4 * 1024 * 1024  # cache_kit.DSV4's Full pool: an assumption
BACKEND_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"
TOKENS_KEY = "DSV41_SWA_CONE_TOKENS"
DSV4_MAX_RUNNING = 256  # SGLang's DeepSeek-V4 default max_running_requests (arg_groups/deepseek_v4_hook.py)

# DeepSeek-V4.1 as the production profile serves it, when no model folder is given.
V41_CONFIG = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v41", "num_hidden_layers": 61,
              "sliding_window": 128, "compress_ratios": [4] * 60 + [128], "kv_source_layer_ids": [10]}


@dataclass(frozen=True)
class Fleet:
    page: int
    window: int
    chunk: int
    max_running: int
    tails: int
    swa_pool: int
    full_tokens: int
    full_source: str  # --kv-tokens | launch line | assumed
    cone_tokens: int
    cone_bound: int
    model: str  # the model folder, or the assumed DeepSeek-V4.1
    profile: str
    hicache_ratio: float = 2.0  # host pool tokens per device pool token (the +hicache policies)
    hicache_write_policy: str = "write_through"
    hicache_on: bool = False  # the launch line has --enable-hierarchical-cache
    kv_park: bool = False  # the profile sets DSV41_KV_PARK: a retracted request is parked, not recomputed
    dsv4: Any = None  # the model is DeepSeek-V4: SGLang's DSV4 pool at these sizes (a dsv4_pool.Dsv4Pool)

    def describe(self) -> str:
        return (f"page {self.page}, window {self.window}, chunk {self.chunk}, max running {self.max_running}, "
                f"--swa-prefix-tails {self.tails} -> SWA pool {self.swa_pool:,} slots (SGLang's configurator), "
                f"Full pool {self.full_tokens:,} tokens ({self.full_source}), cone N {self.cone_tokens} "
                f"(bound {self.cone_bound}); HiCache (+hicache policies): ratio {self.hicache_ratio:g}, "
                f"{self.hicache_write_policy} ({'on' if self.hicache_on else 'off'} in the launch line); "
                f"retraction: {'parked (DSV41_KV_PARK)' if self.kv_park else 'recomputed'}; "
                f"model: {self.model}; profile: {self.profile}"
                + (f"; pool: {self.dsv4.describe()}" if self.dsv4 is not None else ""))

    def default_policies(self) -> tuple[str, ...]:
        """Without ``--policies``: the +hicache policies only when the launch line enables HiCache
        (the operator's own setup first; ``--hicache`` adds them to any profile)."""
        return POLICIES if self.hicache_on else tuple(p for p in POLICIES if not p.endswith(HICACHE_SUFFIX))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _model(path: str | None) -> tuple[Any, str]:
    from adapter.ops import check

    if path:
        return check.read_model(path), path
    return check.Model("(assumed)", V41_CONFIG["architectures"][0], "DeepSeekV4TokenToKVPool", 128, 61, 61,
                       tuple(V41_CONFIG["compress_ratios"]), "deepseek_v41", (10,)), \
        "DeepSeek-V4.1 assumed (61 layers, window 128, last KV source 10)"


RATIO_FLAG = "--swa-full-tokens-ratio"  # SGLang's ratio mode for the SWA pool: not modelled


def resolve(env_file: str | None = None, model_path: str | None = None, kv_tokens: int | None = None,
            tails: int | None = None, cone_tokens: int | None = None, hicache_ratio: float | None = None) -> Fleet:
    """The geometry of one run; bad values are a ``ConfigError`` naming the flag or key."""
    from adapter.core import api
    from adapter.ops import check
    from adapter.switches.cone_replay import predict as cone_predict
    from overlay_tools.simulate.swa_pool import swa_pool_for_tails

    if env_file is None and not DEFAULT_PROFILE.is_file():
        raise env.ConfigError("--env-file", "(not given)", "a profile (KEY=VALUE lines, the launch line in "
                              f"{check.LAUNCH_KEY}): the default, the checkout's {DEFAULT_PROFILE.name}, is not here")
    profile = str(env_file or DEFAULT_PROFILE)
    environ = check.profile_environ(profile)
    words = shlex.split(environ.get(check.LAUNCH_KEY, ""))
    if any(w.split("=", 1)[0] == RATIO_FLAG for w in words):
        raise env.ConfigError(check.LAUNCH_KEY, RATIO_FLAG, "a launch line without it: simulate sizes the SWA pool "
                              "as SGLang does without it (from --swa-prefix-tails), not by a Full-pool ratio; "
                              "simulate a copy of the profile without the flag")
    launch = check.parse_launch(words)
    ns = launch.namespace
    folder = model_path or (launch.model_path if launch.model_path and Path(launch.model_path).is_dir() else None)
    model, model_name = _model(folder)
    if model.pool == "none":
        raise env.ConfigError("--model", str(folder), "a model with sliding-window layers (this one has none: "
                              "no SWA cache, nothing to simulate)")
    page = cone_predict.DSV4_PAGE if model.pool == "DeepSeekV4TokenToKVPool" else int(launch.page_size or 1)
    chunk = int(ns.chunked_prefill_size or 8192)
    max_running = int(launch.max_running_requests or DSV4_MAX_RUNNING)
    tails = int(tails if tails is not None else (ns.swa_prefix_tails if ns.swa_prefix_tails is not None else 128))
    if tails < 0:
        raise env.ConfigError("--swa-prefix-tails", str(tails), "a count >= 0")
    n = int(cone_tokens if cone_tokens is not None else environ.get(TOKENS_KEY) or 8192)
    if model.model_type == "deepseek_v41" and "--no-enable-decoder-swa-bounded-replay" not in words:
        words = [*words, "--enable-decoder-swa-bounded-replay"]  # SGLang's resolution on the fleet's CUDA
        launch = check.parse_launch(words)
    said = cone_predict.predict(api.Profile({}, {TOKENS_KEY: n}, tuple(words), launch.namespace, model, "armed"))
    receipt, bound = said.receipt, int(said.params.get("bound") or 0)
    if n % page or n < bound:
        raise env.ConfigError(TOKENS_KEY, str(n), f"a multiple of the page {page} and at least the cone's bound "
                              f"{bound} ({receipt})")
    window = int(model.window)
    if kv_tokens is not None:
        full, source = kv_tokens, "--kv-tokens"
    elif getattr(ns, "max_total_tokens", None):
        full, source = int(ns.max_total_tokens), "--max-total-tokens of the launch line"
    else:
        full, source = DEFAULT_FULL_TOKENS, "assumed: set --kv-tokens to the boot log's max_total_num_tokens"
    if full < chunk or full % page:
        raise env.ConfigError("--kv-tokens", str(full), f"a multiple of the page {page}, at least one chunk ({chunk})")
    dsv4 = None
    if model.pool == "DeepSeekV4TokenToKVPool":  # SGLang's DSV4 configurator sizes every pool of it
        from overlay_tools.simulate import dsv4_pool

        if not model.compress_ratios:
            raise env.ConfigError("--model", str(folder), "a DeepSeek-V4 config.json with compress_ratios "
                                  "(the pool's layers)")
        dsv4 = dsv4_pool.configure(ratios=tuple(model.compress_ratios), kv_sources=tuple(model.kv_sources),
                                   window=window, page=page, chunk=chunk, max_running=max_running, tails=tails,
                                   full_tokens=full)
        swa = dsv4.swa
    else:
        swa = swa_pool_for_tails(tails, max_running=max_running, page=page, window=window, chunk=chunk)["swa_pool"]
    hicache = check.hicache_flags(ns)
    ratio = float(hicache_ratio if hicache_ratio is not None else (hicache or {}).get("ratio") or 2.0)
    if not ratio > 0:
        raise env.ConfigError("--hicache-ratio", str(ratio), "a positive factor (host pool tokens per device token)")
    policy = str((hicache or {}).get("write_policy") or "write_through")
    return Fleet(page, window, chunk, max_running, tails, swa, full, source, n, bound, model_name, profile,
                 ratio, policy, hicache is not None, bool(environ.get("DSV41_KV_PARK")), dsv4)


def with_tails(fleet: Fleet, tails: int) -> Fleet:
    """``fleet`` at another ``--swa-prefix-tails``: the SWA pool (and with it a DSV4 pool's C4 states)
    resized by SGLang's configurator."""
    import dataclasses

    from overlay_tools.simulate.swa_pool import swa_pool_for_tails

    if fleet.dsv4 is None:
        swa = swa_pool_for_tails(tails, max_running=fleet.max_running, page=fleet.page, window=fleet.window,
                                 chunk=fleet.chunk)["swa_pool"]
        return dataclasses.replace(fleet, tails=tails, swa_pool=swa)
    from overlay_tools.simulate import dsv4_pool

    d = fleet.dsv4
    pool = dsv4_pool.configure(ratios=d.ratios, kv_sources=d.kv_sources, window=d.window, page=d.page,
                               chunk=fleet.chunk, max_running=d.max_running, tails=tails, full_tokens=d.full)
    return dataclasses.replace(fleet, tails=tails, swa_pool=pool.swa, dsv4=pool)


def build_kit(policy: str, fleet: Fleet, max_ctx: int) -> Any:
    """A real cache for ``policy`` at ``fleet``'s geometry, with that policy's switches installed
    (and every other switch uninstalled)."""
    return build_kits(policy, fleet, max_ctx, 1)[0]


def build_kits(policy: str, fleet: Fleet, max_ctx: int, count: int) -> list[Any]:
    """``count`` real caches (one per instance of a fleet) under one install of ``policy``'s
    switches (a switch wraps module-level code: every instance of a fleet runs the same keys)."""
    from adapter.core import boot
    from adapter.switches.cone_replay.geometry import cache_config
    from adapter.switches.cone_replay.switch import reset_counters
    from overlay_tools.simulate import cache_kit as rc
    from overlay_tools.simulate import cone_turn as cone

    if policy not in POLICIES:
        raise env.ConfigError("--policies", policy, "one of " + ", ".join(POLICIES))
    hicache = None
    if policy.endswith(HICACHE_SUFFIX):
        policy = policy.removesuffix(HICACHE_SUFFIX)
        hicache = rc.HiCache(ratio=fleet.hicache_ratio, write_policy=fleet.hicache_write_policy)
    boot.uninstall()
    os.environ.pop(BACKEND_ENV, None)  # stock: SGLang's default core; thin sets the Python core itself
    geometry = rc.Geometry(fleet.page, fleet.window, fleet.chunk, full_tokens=fleet.full_tokens,
                           swa_tokens=fleet.swa_pool, max_reqs=fleet.max_running + 2, max_ctx=max_ctx)
    if policy == "stock":
        return [rc.build(geometry, backend=None, hicache=hicache, dsv4=fleet.dsv4) for _ in range(count)]
    if policy == "thin":
        state = boot.install({"DSV41_SWA_THIN": "1"})
        importlib.import_module("sglang.srt.mem_cache.unified_radix_cache")
    else:
        state = cone.install(fleet.cone_tokens, DSV41_SWA_THIN="1")
    for name in ("swa_thin", "fast_tree_core"):
        if state.outcomes[name].status != "installed":
            raise RuntimeError(f"simulate: {name} did not install: {state.outcomes[name].reason}")
    kits = [rc.build(geometry, backend=None, hicache=hicache, dsv4=fleet.dsv4) for _ in range(count)]
    if policy == "thin+cone":
        for kit in kits:
            cfg = cache_config(kit.cache)
            if cfg is None or not cfg.enabled:
                raise RuntimeError(f"simulate: cone replay refused on the simulated cache: {getattr(cfg, 'reason', '?')}")
        reset_counters()
    return kits


def uninstall() -> None:
    from adapter.core import boot

    boot.uninstall()
    os.environ.pop(BACKEND_ENV, None)
