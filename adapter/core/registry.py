"""The switch registry: the one table that says which switch wraps which upstream function.

Each :class:`Switch` names its switch key (and option keys) with their parsers, the upstream
modules that must be imported before it installs, the pinned ``module:qualname`` functions it
wraps (``wraps``) and those it calls or reproduces without wrapping (``relies_on``), its install
function, whether its keys are volatile for the autotune fingerprint, what it requires, and its
role in the release gate. Nothing else in the overlay hard-codes a module name for a switch: the
import hook, the switch's own context (:class:`adapter.core.api.SwitchContext`), ``check``,
``receipts``, the release gate and the docs all read this table.

Every switch is off unless its switch key is set. Rollback is config only: unset the switch key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from adapter.core import env


@dataclass(frozen=True)
class Key:
    name: str
    parser: env.Parser[Any]
    doc: str
    default: str | None = None  # raw default, parsed like a set value; None = no default
    test_only: bool = False  # never in a production profile


@dataclass(frozen=True)
class GateRole:
    """How the release gate shows a switch acting on the CPU engine, or why it cannot.

    Exactly one of the three is set. ``acts``: what the release gate's row measures, with the keys
    its profile boot sets (``profile``); ``not_applicable``: why the switch cannot act on the CPU
    engine; ``not_in_profile``: why the production profile (and so the release gate) leaves it off,
    and where it is exercised instead.
    """

    acts: str = ""
    profile: tuple[tuple[str, str], ...] = ()
    not_applicable: str = ""
    not_in_profile: str = ""

    def __post_init__(self) -> None:
        if sum(map(bool, (self.acts, self.not_applicable, self.not_in_profile))) != 1:
            raise ValueError(f"GateRole needs exactly one of acts / not_applicable / not_in_profile: {self!r}")


@dataclass(frozen=True)
class Switch:
    name: str  # as it appears in receipts: "[dsv41] <name> installed ..."
    on_key: Key  # the switch key: the switch is on when it is set to a truthy value
    summary: str
    modules: tuple[str, ...]  # install runs once all of these are imported
    wraps: tuple[str, ...]  # pinned "module:qualname" functions it wraps
    install: str  # "adapter.switches.<module>:<function>"
    volatile: bool  # True: changes no tuned shape or kernel (left out of the autotune fingerprint)
    gate_role: GateRole
    # What ``python -m adapter check`` predicts beyond the install outcome: "module:function" in the
    # switch's own package, called with an ``api.Profile`` and returning an ``api.Prediction`` (a
    # receipt decided after install, warnings); None: the install outcome is what a boot logs, and
    # ``no_predictor`` says why (a switch that can refuse after install has a predictor).
    predict: str | None
    relies_on: tuple[str, ...] = ()  # pinned "module:qualname" functions it calls or reproduces, not wrapped
    options: tuple[Key, ...] = ()
    requires: tuple[str, ...] = ()  # switches turned on with this one
    no_predictor: str = ""  # why ``check`` needs no predictor (with ``predict`` None)

    def __post_init__(self) -> None:
        if bool(self.predict) == bool(self.no_predictor):
            raise ValueError(f"{self.name}: a switch has a predictor or says why it needs none (no_predictor), "
                             "not both and not neither")
        if self.on_key.default is not None:  # off unless set: a default would turn it on everywhere
            raise ValueError(f"{self.on_key.name} has a default ({self.on_key.default!r}); a switch key never does")

    @property
    def keys(self) -> tuple[Key, ...]:
        return (self.on_key, *self.options)

    @property
    def pinned(self) -> tuple[str, ...]:
        """Every upstream function whose drift refuses the switch: wrapped, then relied on."""
        return (*self.wraps, *self.relies_on)

    @property
    def module_file(self) -> str:
        """The overlay file of the install function (a package's module file), for docs."""
        return self.install.partition(":")[0].replace(".", "/") + ".py"

    def target(self, name: str) -> str:
        """``name`` as one of :attr:`pinned` (a full ``module:qualname``, or its unique qualname tail)."""
        if name in self.pinned:
            return name
        found = [t for t in self.pinned if t.endswith(":" + name) or t.endswith("." + name)]
        if len(found) != 1:
            raise KeyError(f"{name!r} names {len(found)} of {self.name}'s pinned targets (expected exactly one)")
        return found[0]


# Keys that belong to no switch.
STRICT = Key("DSV41_STRICT", env.flag(), "turn any refusal of a requested switch into a boot failure")
DEBUG_LOG = Key("DSV41_DEBUG_LOG", env.flag(), "log the overlay's DEBUG lines (per-window detail)")
GLOBAL_KEYS: tuple[Key, ...] = (STRICT, DEBUG_LOG)
# Environment keys outside DSV41_* that change nothing tuned (left out of the autotune fingerprint).
VOLATILE_EXTERNAL_KEYS = ("SGLANG_RUN_ID",)

_AUTOTUNE = "sglang.srt.model_executor.runner.flashinfer_autotune"
INSTALL_ONLY = "nothing is decided after install (it never refuses late): its install outcome is what a boot logs"

SWITCHES: tuple[Switch, ...] = (
    Switch(
        name="autotune_keep",
        on_key=Key("DSV41_AUTOTUNE_KEEP", env.flag(), "keep the FlashInfer autotune cache across boots of the same launch"),
        summary="keep the FlashInfer autotune cache when this rank saved it under the same launch (sglang#40320)",
        modules=(_AUTOTUNE,),
        wraps=(f"{_AUTOTUNE}:_autotune_cache_digest", f"{_AUTOTUNE}:flashinfer_autotune_context"),
        relies_on=(
            # Called with a fixed signature (found by tests/upstream/test_upstream_calls_are_pinned.py).
            "sglang.srt.model_executor.runner.flashinfer_autotune:flashinfer_autotune_cache_path",
        ),
        install="adapter.switches.autotune_keep:install",
        predict=None,
        no_predictor=INSTALL_ONLY,
        volatile=True,
        gate_role=GateRole(not_applicable="FlashInfer autotuning runs only on CUDA; the CPU engine never autotunes"),
    ),
    Switch(
        name="swa_native_decode",
        on_key=Key("DSV41_SWA_NATIVE_DECODE", env.flag(), "DSV4 decode reads 256-token SWA pages in place (SM120/SM121)"),
        summary="decode-sized DSV4 calls on SM120/SM121 go to a sha-checked decode-only FlashInfer module with "
        "the 256-token SWA pool view instead of copying each touched page into four 64-token pages",
        modules=("sglang.kernels.ops.attention.flash_mla_sm120",),
        wraps=(
            "sglang.kernels.ops.attention.flash_mla_sm120:_flash_mla_flashinfer",
            # decode-form calls of more than 64 rows (stock: the prefill kernel on the 64-token copy):
            # logged once as a fallback, and a V4.1-layout pool is refused loudly there too
            "sglang.kernels.ops.attention.flash_mla_sm120:_flash_mla_sm120_prefill",
        ),
        install="adapter.switches.native_decode.switch:install",
        predict="adapter.switches.native_decode.predict:predict",
        gate_role=GateRole(not_applicable="DSV4 decode kernel for SM120/SM121 GPUs; the CPU engine has no such device"),
        # Same kernel instance and the tactic FlashInfer's planner picks for the copy path; autotune
        # passes take the stock path, so no tuned shape or kernel depends on this key.
        volatile=True,
        options=(
            Key(
                "DSV41_NATIVE_DECODE_DIR",
                env.absolute_path(),
                "folder of the built module and its manifest (default: <overlay>/build/native_decode)",
            ),
            Key(
                "DSV41_NATIVE_DECODE_STANDIN",
                env.function_path(),
                "tests only: on the CPU engine (no SM120 device, no built module) the named stand-in (a function the "
                "tests supply) routes the DSV4 backend's decode to SGLang's SM120 entry and returns the module "
                "stand-in (the pure-torch reference on the pool view: served) or none (stock copy path)",
                test_only=True,
            ),
        ),
    ),
    Switch(
        name="decode_yield",
        on_key=Key("DSV41_DECODE_YIELD", env.percent(), "share (percent) of time running streams keep while a long prompt prefills in chunks"),
        summary="after each non-final chunk, defer the next prefill for N decode steps (from measured iteration "
        "times, closed on the measured share; floor --prefill-decode-interval, cap 128) so running streams keep their share",
        modules=("sglang.srt.managers.scheduler",),
        wraps=(
            "sglang.srt.managers.scheduler:Scheduler.get_next_batch_to_run",
            "sglang.srt.managers.scheduler:Scheduler._should_defer_prefill",
        ),
        relies_on=(
            # Called with a fixed signature (found by tests/upstream/test_upstream_calls_are_pinned.py).
            "sglang.srt.managers.schedule_batch:ScheduleBatch.batch_size",
            "sglang.srt.managers.schedule_batch:ScheduleBatch.is_empty",
            "sglang.srt.managers.schedule_batch:Req.finished",
            "sglang.srt.model_executor.forward_batch_info:ForwardMode.is_extend",
            # The interval arming (its counter is the floor) and the overlap loop's in-flight finishers.
            "sglang.srt.managers.scheduler:Scheduler._arm_prefill_decode_interval",
            "sglang.srt.managers.scheduler:Scheduler._reqs_finishing_inflight",
            # Sets tp_cpu_group, the gloo group rank 0's window is broadcast on (measured mode, TP > 1).
            "sglang.srt.managers.scheduler:Scheduler.init_model_worker",
            # Run on a deferred pass as a stock prefill attempt runs it (the waiting queue's order and
            # the recency of its cached prefixes).
            "sglang.srt.managers.schedule_policy:SchedulePolicy.calc_priority",
            # A waiting prompt's cache hit, read without touching the cache (cache_hit.py), on the key
            # the scheduler matches, on either tree core.
            "sglang.srt.mem_cache.common:_req_radix_key",
            "sglang.srt.managers.schedule_batch:Req._compute_max_prefix_len",
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.match_full_device_prefix",
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.swa_tombstone_ranges",
            "sglang.srt.mem_cache.rust_tree_core.adapter:RustUnifiedTreeCore.match_full_device_prefix",
            "sglang.srt.mem_cache.rust_tree_core.adapter:RustUnifiedTreeCore.swa_tombstone_ranges",
        ),
        install="adapter.switches.decode_yield.switch:install",
        predict="adapter.switches.decode_yield.switch:predict",
        volatile=True,
        gate_role=GateRole(acts="streams' decode share during a chunked prefill", profile=(("DSV41_DECODE_YIELD", "50"),)),
        options=(
            Key("DSV41_DECODE_YIELD_MODE", env.choice("measured", "model"),
                "measured: windows from this boot's measured iteration times, closed on the share the streams got; "
                "model: the open-loop integer cost model alone (the keys below; the previous behaviour)",
                default="measured"),
            Key("DSV41_DECODE_YIELD_LOAD_GUARD", env.flag(),
                "a diagnostic, not a tuning knob: 0 turns off the load guard (the share given shrinks to none as "
                "prefill arriving into the backlog nears the prefill rate), so the release gate can show what it prevents",
                default="1"),
            *(Key(f"DSV41_DECODE_YIELD_{name}", env.integer(0, 10**12, unit=unit),
                f"decode-yield cost model (model mode; the first windows of a boot in measured mode): {unit}")
            for name, unit in (  # defaults and their provenance: adapter/cost_model.py DEFAULTS
                ("CHUNK_US", "µs per prefill forward"),
                ("TOKEN_NS", "ns per prefill token"),
                ("PAIR_FS", "fs per causal attention pair"),
                ("TOPK_PAIR_PS", "ps per top-k attention pair"),
                ("STEP_US", "µs per decode step"),
                ("ROW_NS", "ns per decode row"),
                ("KV_PS", "ps per KV token read in decode"),
                ("TOPK_KV_PS", "ps per top-k KV token read in decode"),
                ("TOPK", "keys per query of the sparse attention; 0 = dense"),
                # besides the forward: what an iteration's scheduling and output cost
                ("CHUNK_SCHED_US", "µs per prefill iteration besides its forward"),
                ("TOKEN_SCHED_NS", "ns per prefill token besides the forward"),
                ("STEP_SCHED_US", "µs per decode iteration besides its forward"),
                ("ROW_SCHED_NS", "ns per decode row besides the forward"),
                ("SWITCH_US", "µs per window of alternating chunk and decode steps"),
            )),
        ),
    ),
    Switch(
        name="fast_tree_core",
        on_key=Key("DSV41_SWA_FAST_CORE", env.flag(),
                 "insert walk, prefix match and Full lock walks of the Python tree core without key copies"),
        summary="the Python UnifiedTreeCore insert walk advances a key offset instead of copying the key's rest "
        "at every node, finds children by scanning instead of hashing page-long tuple keys, and the match and "
        "Full lock walks run inlined (results identical to stock; turned on by SWA thin)",
        # The cache module, not the tree-core module: the cache imports the tree core mid-import, and a
        # switch must not install while the cache module is still partially initialized.
        modules=("sglang.srt.mem_cache.unified_radix_cache",),
        wraps=(
            *(
                f"sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.{fn}"
                for fn in ("_insert_walk_step", "_finish_insert_walk_node", "_insert_commit_step",
                           "_match_prefix_helper")
            ),
            "sglang.srt.mem_cache.unified_cache.components.full:FullComponent.acquire_component_lock",
            "sglang.srt.mem_cache.unified_cache.components.full:FullComponent.release_component_lock",
        ),
        relies_on=(
            # Called with a fixed signature (found by tests/upstream/test_upstream_calls_are_pinned.py).
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._build_backup_kv_action",
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._create_match_validators",
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._match_post_processor",
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._unevict_node_on_insert",
            "sglang.srt.mem_cache.unified_cache.components.base:TreeComponent.recover_after_unevict",
            "sglang.srt.mem_cache.unified_cache.components.swa:SWAComponent.recover_after_unevict",
            *(
                f"sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.{fn}"
                for fn in (
                    # the walk calls the first and inlines the second
                    "_insert_overlap_step", "_touch_node",
                    # the barrier rule the multi-node walk step keeps, the hit count and leaf-set tests
                    # it inlines, and every writer of a node's children (a child is filed under
                    # child_key of its own key: the scan's rule)
                    "_advance_insert", "_inc_hit_count_and_check", "_update_evictable_leaf_sets",
                    "_is_device_leaf", "_is_host_leaf", "_split_node", "_add_new_node", "insert_host",
                )
            ),
            # The component hooks the walk knows to be no-ops where it skips them.
            "sglang.srt.mem_cache.unified_cache.components.swa:SWAComponent.update_component_on_insert_overlap",
            "sglang.srt.mem_cache.unified_cache.components.swa:SWAComponent.refresh_lru",
            "sglang.srt.mem_cache.unified_cache.components.base:TreeComponent.update_component_on_insert_overlap",
            # Pinned, not wrapped: what the walks inline (node state, value lengths) or reproduce (the
            # child key a scan stands for, a whole-node match).
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeNode.evicted.fget",
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeNode.backuped.fget",
            "sglang.srt.mem_cache.unified_cache.components.base:TreeComponent.value_len",
            "sglang.srt.mem_cache.unified_cache.components.base:TreeComponent.reclaimable_value_len",
            "sglang.srt.mem_cache.radix_cache:RadixKey.child_key_at",
            "sglang.srt.mem_cache.radix_cache:RadixKey.match_at",
        ),
        install="adapter.switches.fast_tree_core:install",
        predict=None,
        no_predictor=INSTALL_ONLY,
        volatile=True,
        # No keys of its own in the release gate's profile: swa_thin turns it on.
        gate_role=GateRole(acts="turned on by swa_thin; results identical to stock by design"),
    ),
    Switch(
        name="swa_thin",
        on_key=Key("DSV41_SWA_THIN", env.flag(), "evict passed SWA checkpoints first so idle sessions keep their resume point"),
        summary="checkpoints a request has moved past go to the evict-first end of the SWA LRU, oldest first (Python tree core)",
        modules=("sglang.srt.mem_cache.unified_radix_cache",),
        wraps=(
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.checkpoint_into_tree",
            # The cache build: a tree without an SWA component refuses the switch there.
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.__init__",
            # HiCache write-back returns before counting a hit (and a new leaf's creator): counted here,
            # so the shared rule counts as under every other policy.
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._inc_hit_count_and_check",
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._should_backup_after_insert",
            # Every unlink from an LRU list: keeps the front of the demoted run (oldest demoted first).
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedLRUList._remove_node",
        ),
        relies_on=(
            # Called with a fixed signature (found by tests/upstream/test_upstream_calls_are_pinned.py).
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.is_root",
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.node_by_id",
            "sglang.srt.managers.schedule_batch:Req.finished",
            # The LRU primitive the demotion calls beside the unlink it wraps.
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedLRUList._add_node_after",
        ),
        install="adapter.switches.swa_thin:install",
        predict="adapter.switches.swa_thin:predict",
        volatile=True,
        gate_role=GateRole(acts="idle session's context cached on resume", profile=(("DSV41_SWA_THIN", "1"),)),
        requires=("fast_tree_core",),
    ),
    Switch(
        name="cone_replay",
        on_key=Key("DSV41_SWA_CONE_REPLAY", env.flag(), "replay only the last N tokens before a resume point whose SWA window was evicted"),
        summary="a match stopped only by an evicted SWA window at F resumes on Full KV at page_floor(F - N) and "
        "replays N tokens instead of re-prefilling from the stock match",
        modules=(
            "sglang.srt.mem_cache.unified_radix_cache",
            "sglang.srt.mem_cache.unified_cache.unified_tree_core",
            "sglang.srt.mem_cache.unified_cache.components.swa",
            "sglang.srt.mem_cache.common",
            "sglang.srt.managers.schedule_policy",
            "sglang.srt.managers.schedule_batch",
            "sglang.srt.model_executor.forward_batch_info",
            "sglang.srt.layers.radix_attention",
            "sglang.srt.model_executor.runner.prefill_cuda_graph_runner",
            "sglang.srt.model_executor.model_runner",
        ),
        wraps=(
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.__init__",
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.match_prefix",
            "sglang.srt.managers.schedule_policy:PrefillAdder.add_one_req",
            "sglang.srt.managers.schedule_policy:PrefillAdder._select_prefill_admission",
            "sglang.srt.managers.schedule_batch:ScheduleBatch.prepare_for_extend",
            "sglang.srt.model_executor.forward_batch_info:ForwardBatch.init_new",
            "sglang.srt.layers.radix_attention:RadixAttention.forward",
            "sglang.srt.model_executor.runner.prefill_cuda_graph_runner:PrefillCudaGraphRunner.can_run_graph",
            "sglang.srt.model_executor.model_runner:ModelRunner.forward",
            # Beside HiCache: the cone's load-back of F's Full KV leaves the SWA transfer out.
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.build_load_back_spec",
            "sglang.srt.mem_cache.unified_cache.components.swa:SWAComponent.build_hicache_transfers",
        ),
        relies_on=(
            # Called with a fixed signature (found by tests/upstream/test_upstream_calls_are_pinned.py).
            "sglang.srt.mem_cache.deepseek_v4_memory_pool:DeepSeekV4IndexerPool.contiguous_page_row_buffers",
            "sglang.srt.model_executor.forward_batch_info:ForwardMode.is_extend",
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.match_full_device_prefix",
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.collect_path_info",
            # Beside HiCache: the stock resume point B is where init_load_back's splice ends; the
            # cone's own load-back goes through it, after the adder's load-back budget, and the copy
            # waits for the batch's load event (LayerLoadingEvent.wait).
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.init_load_back",
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.is_full_device_evicted",
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.load_back",
            "sglang.srt.mem_cache.prefill_budget:PrefillBudget.prepare_load_back",
            "sglang.srt.mem_cache.prefill_budget:SharedSWAPrefillBudget.prepare_load_back",
            "sglang.srt.managers.cache_controller:LayerLoadingEvent.wait",
            "sglang.srt.mem_cache.unified_cache.components.full:FullComponent.build_hicache_transfers",
            "sglang.srt.mem_cache.swa_memory_pool:SWAKVPool.get_key_buffer",
            "sglang.srt.mem_cache.swa_memory_pool:SWAKVPool.get_value_buffer",
            "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator.get_kvcache",
            # F's definition, the fields a fallback restores, the anchor lock, the copy source.
            "sglang.srt.mem_cache.unified_cache.components.swa:SWAComponent.finalize_match_result_in_tree_core",
            "sglang.srt.mem_cache.common:match_kv_cache",
            "sglang.srt.managers.schedule_policy:PrefillAdder._commit_prefill_admission",
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.path_device_indices",
            # DeepSeek-V4: rows outside encoder_swa_compress_rows write their compressed KV, index keys
            # and compressor states to slot 0; every layer stores its caches, then reads them back.
            "sglang.srt.layers.attention.deepseek_v4_backend:DeepseekV4AttnBackend._compressor_out_loc",
            "sglang.srt.layers.attention.deepseek_v4_backend:DeepseekV4AttnBackend._forward_attention",
            # Decoder SWA bounded replay (the bound's tail): the last KV source compresses every row,
            # then the late layers run on each extend's last W rows, floored at seq_len - W.
            "sglang.srt.layers.attention.deepseek_v4_backend:DeepseekV4AttnBackend.write_tail_source_kv",
            "sglang.kernels.ops.attention.dsv4.attn_metadata_kernels:late_layer_tail_layout",
        ),
        install="adapter.switches.cone_replay.switch:install",
        predict="adapter.switches.cone_replay.predict:predict",
        volatile=True,
        # N = 64 on the release gate's engine: its bound is 63 (page 1, window 31, 2 SWA layers; cone_bound),
        # so 63 is the smallest accepted value and 64 keeps one token of margin.
        gate_role=GateRole(acts="tokens re-prefilled for a branch whose SWA window was evicted",
                           profile=(("DSV41_SWA_CONE_REPLAY", "1"), ("DSV41_SWA_CONE_TOKENS", "64"))),
        options=(
            Key("DSV41_SWA_CONE_TOKENS", env.integer(1, unit="tokens; a multiple of the page size, at least the bound"),
                "replay depth N (checked against the bound when the cache is built)", default="8192"),
            Key("DSV41_SWA_CONE_FORWARD_STANDIN", env.flag(),
                "tests only: act on DeepSeek-V4 KV layouts whose exactness is not shown (anything but the V4 "
                "584-byte layout with C0/C4/C128 layers); without it the switch refuses there at cache build",
                default="0", test_only=True),
        ),
    ),
    Switch(
        name="page_rounded_admission",
        on_key=Key("DSV41_PAGE_ROUNDED_ADMISSION", env.flag(), "charge KV in whole pages everywhere PrefillAdder admits"),
        summary="one page-rounded KV cost for running rows, mixed decode rows, the admission check, the "
        "reserve and the never-fits clip, so admission never overcommits the pool",
        # The scheduler alone: it imports schedule_policy, and while it executes it is already in
        # sys.modules, so listing both would install before Scheduler is defined.
        modules=("sglang.srt.managers.scheduler",),
        wraps=(
            "sglang.srt.managers.schedule_policy:PrefillAdder._get_running_request_total_token_offset",
            "sglang.srt.managers.schedule_policy:PrefillAdder.__init__",
            "sglang.srt.managers.schedule_policy:PrefillAdder._check_prefill_budget",
            "sglang.srt.managers.schedule_policy:PrefillAdder._update_prefill_budget",
            "sglang.srt.managers.scheduler:Scheduler.init_req_max_new_tokens",
        ),
        relies_on=(
            # Called with a fixed signature (found by tests/upstream/test_upstream_calls_are_pinned.py).
            "sglang.srt.managers.schedule_batch:Req.finished",
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.supports_mamba",
            # The arithmetic the wrappers replace exactly (stock reserve and check, the caller that
            # builds total_tokens, the stock never-fits bound).
            "sglang.srt.mem_cache.prefill_budget:PrefillBudget.reserve",
            "sglang.srt.mem_cache.prefill_budget:PrefillBudget.check_prefill",
            "sglang.srt.managers.schedule_policy:PrefillAdder.add_one_req",
            "sglang.srt.managers.schedule_policy:PrefillAdder._select_prefill_admission",
            "sglang.srt.mem_cache.allocator.base:BaseTokenToKVPoolAllocator.max_new_tokens_for_memory",
        ),
        install="adapter.switches.page_rounded_admission:install",
        predict=None,
        no_predictor=INSTALL_ONLY,
        volatile=True,
        # Not "not applicable": the DSV4 kit runs 256-token pages, where it would act.
        gate_role=GateRole(not_in_profile="not adopted by the production profile (whole-page charges admit fewer "
                           "requests: throughput); on the Mellum kit's page size 1 they equal token charges"),
    ),
    Switch(
        name="kv_park",
        on_key=Key("DSV41_KV_PARK", env.choice("ram"), "park a retracted request's KV pages in host RAM and restore them on re-admission"),
        summary="retraction saves the row's pages with a page-major copy engine (queued on the device) into a "
        "budgeted LRU host store; re-admission restores them as a cached prefix instead of a re-prefill",
        modules=(
            "sglang.srt.managers.schedule_batch",
            "sglang.srt.managers.scheduler",
            "sglang.srt.mem_cache.kv_cache_builder",
            "sglang.srt.mem_cache.deepseek_v4_memory_pool",
            "sglang.srt.mem_cache.deepseek_v4_compress_state",
            "sglang.srt.disaggregation.decode",
        ),
        wraps=(
            "sglang.srt.managers.schedule_batch:release_req",
            # SGLang's own DSV4 retraction offload (sglang#33385): the pool's CPU copy and load come
            # from the copy engine, and a DSV4 pool it moves no longer needs a rebootstrap.
            "sglang.srt.mem_cache.memory_pool:KVCache.get_cpu_copy",
            "sglang.srt.mem_cache.memory_pool:KVCache.load_cpu_copy",
            "sglang.srt.mem_cache.common:dsv4_needs_rebootstrap",
            "sglang.srt.disaggregation.decode:dsv4_needs_rebootstrap",
            "sglang.srt.managers.scheduler:Scheduler.get_next_batch_to_run",
            # The scheduler's KV cache is built: the park pool is pinned (or carved out of
            # HiCache's host pools) now, at boot, not on the first pass.
            "sglang.srt.mem_cache.kv_cache_builder:build_kv_cache",
            # torch 2.14.1's graph capture seam: a global-mode capture drains the parking copies in
            # flight and holds new ones back until it ends (SGLang captures while serving, e.g. on a
            # weight update with recapture); thread-local captures pass through.
            "torch.cuda.graphs:CUDAGraph.capture_begin",
            "torch.cuda.graphs:CUDAGraph.capture_end",
        ),
        relies_on=(
            # Called with a fixed signature (found by tests/upstream/test_upstream_calls_are_pinned.py).
            "sglang.srt.managers.schedule_batch:Req._compute_max_prefix_len",
            "sglang.srt.managers.schedule_batch:Req.finished",
            "sglang.srt.managers.schedule_batch:ReqKvInfo.set_evicted_seqlen",
            "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator.alloc_extend_swa_tail",
            "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator.available_size",
            "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator.alloc",
            "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator.free",
            "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator.free_swa",
            "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator.get_kvcache",
            "sglang.srt.mem_cache.common:evict_from_tree_cache",
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.insert",
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.lock",
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.unlock",
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.supports_mamba",
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.supports_prefix_sharing",
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.supports_swa",
            "sglang.srt.mem_cache.deepseek_v4_memory_pool:DeepSeekV4IndexerPool.contiguous_page_row_buffers",
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.match_prefix",
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.path_device_indices",
            # Restored pages stay pinned until admission unless the running rows' next decode needs them.
            "sglang.srt.managers.schedule_batch:ScheduleBatch.is_empty",
            "sglang.srt.managers.schedule_batch:ScheduleBatch.new_tokens_required_next_decode",
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.evictable_size",
            # A copy on the thread whose stream is capturing is refused before any copy.
            "torch.cuda.graphs:is_current_stream_capturing",
            # The DSV4 regions per page-id space, C4 state rows following SWA pages, and the retract
            # loop that rules out holding pages during a copy.
            "sglang.srt.mem_cache.deepseek_v4_memory_pool:DeepSeekV4TokenToKVPool.get_contiguous_buf_infos",
            "sglang.srt.mem_cache.deepseek_v4_memory_pool:DeepSeekV4TokenToKVPool.get_state_buf_infos",
            "sglang.srt.mem_cache.deepseek_v4_compress_state:CompressStatePool.translate_from_swa_loc_to_state_loc",
            "sglang.srt.managers.schedule_batch:ScheduleBatch.retract_decode",
            # The DSV4 offload: what calls the pool's CPU copy and load, the request-scoped state rings
            # it moves, and the SWA mapping of the pool.
            "sglang.srt.managers.schedule_batch:Req.offload_kv_cache",
            "sglang.srt.managers.schedule_batch:Req.load_kv_cache",
            "sglang.srt.mem_cache.deepseek_v4_memory_pool:DeepSeekV4TokenToKVPool.translate_loc_from_full_to_swa",
            "sglang.srt.mem_cache.deepseek_v4_compress_state:CompressStatePool.translate_from_req_position_to_state_loc",
            # HiCache's host pools the park pool is carved out of (their allocator hands the slots over).
            "sglang.srt.mem_cache.pool_host.base:HostKVCache.alloc",
            "sglang.srt.mem_cache.pool_host.base:HostKVCache.free",
            # Beside HiCache a restore brings the tree's host-only part back through HiCache's own
            # load-back before it writes the parked tail.
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.init_load_back",
            # Full KV the tree holds past a window it lost (a Full-only walk), and whether it still
            # holds a window page there, on the device or on host: never parked twice.
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.match_full_device_prefix",
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.get_component_device_value",
            "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.component_has_host_value_only",
            # The streams a copy follows: the forward's (run_batch, overlap loop), which HiCache's
            # device-to-host copy also follows (start_writing), so a restore's event orders both.
            "sglang.srt.managers.scheduler:Scheduler.run_batch",
            "sglang.srt.managers.cache_controller:HiCacheController.start_writing",
        ),
        install="adapter.switches.kv_park.switch:install",
        predict="adapter.switches.kv_park.predict:predict",
        volatile=True,  # host copies only: no tuned shape or kernel
        gate_role=GateRole(not_in_profile="not adopted by the production profile (never run on a GPU yet); "
                           "tests/engine/test_kv_park_server.py runs it on this engine with retractions forced"),
        options=(
            Key("DSV41_KV_PARK_GIB", env.integer(1, 4096, unit="GiB of host RAM for parked KV"),
                "host RAM budget of parked entries; least recently used entries are evicted beyond it",
                default="8"),
        ),
    ),
    # -- end of switches (in install order; the production profile lists its keys in this order) --
)

# The boot's own hook (no switch, no key): a scheduler process imports the switches' modules, and so
# installs the import-time switches, before SGLang publishes its rank (``run_scheduler_process``:
# ``publish(..., ranks=SpawnRanks(...))`` then ``configure_scheduler_process``, which "runs after
# publish"). Once that returns, the boot logs each switch's receipt again under the engine rank, so
# ``receipts --ranks N`` counts scheduler ranks (``tp<N>``), never the pids of the server's other
# processes (adapter.core.boot). Pinned like a switch's targets; drift leaves the hook off.
RANK_MODULE = "sglang.srt.managers.scheduler"
RANK_HOOK = f"{RANK_MODULE}:configure_scheduler_process"  # wrapped
RANK_RELIES_ON = (f"{RANK_MODULE}:run_scheduler_process",)  # publish() precedes the hook
BOOT_PINNED: tuple[str, ...] = (RANK_HOOK, *RANK_RELIES_ON)


def by_name(name: str) -> Switch:
    for switch in SWITCHES:
        if switch.name == name:
            return switch
    raise KeyError(name)


def all_keys() -> dict[str, Key]:
    keys = {key.name: key for key in GLOBAL_KEYS}
    for switch in SWITCHES:
        keys.update({key.name: key for key in switch.keys})
    return keys


def volatile_keys() -> frozenset[str]:
    keys = {key.name for key in GLOBAL_KEYS} | set(VOLATILE_EXTERNAL_KEYS)
    for switch in SWITCHES:
        if switch.volatile:
            keys.update(key.name for key in switch.keys)
    return frozenset(keys)


@dataclass
class Config:
    """The parsed ``DSV41_*`` configuration of one process."""

    values: dict[str, Any] = field(default_factory=dict)  # key -> parsed value (set keys and defaults)
    requested: list[Switch] = field(default_factory=list)  # in registry order, requirements included
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def strict(self) -> bool:
        return bool(self.values.get(STRICT.name))

    def __getitem__(self, key: str) -> Any:
        return self.values[key]


def _is_on(value: Any) -> bool:
    return value is not False and value is not None


def resolve(environ: Mapping[str, str]) -> Config:
    """Parse every ``DSV41_*`` key of ``environ`` and decide which switches are requested."""
    config = Config()
    known = all_keys()
    for name, raw in sorted(env.dsv41_items(environ).items()):
        key = known.get(name)
        if key is None:
            hint = env.closest_key(name, sorted(known))
            config.warnings.append(
                f"unknown key {name} ignored" + (f"; did you mean {hint}?" if hint else "")
            )
            continue
        try:
            config.values[name] = key.parser(name, raw)
        except env.ConfigError as exc:
            config.errors.append(str(exc))

    wanted = {s.name for s in SWITCHES if _is_on(config.values.get(s.on_key.name))}
    pending = list(wanted)
    while pending:  # requirements turn their switches on too
        for required in by_name(pending.pop()).requires:
            if required not in wanted:
                wanted.add(required)
                pending.append(required)
    config.requested = [s for s in SWITCHES if s.name in wanted]
    for switch in config.requested:
        for key in switch.options:
            if key.name not in config.values and key.default is not None:
                config.values[key.name] = key.parser(key.name, key.default)
    return config
