"""SGLang's own DeepSeek-V4 KV pool for ``simulate`` at the DeepSeek-V4 family's geometry.

What is SGLang's: the sizes (``DSV4PoolConfigurator``, the configurator a DSV4 boot builds, run at
the model's compression ratios, page, window, chunk, running requests and ``--swa-prefix-tails``:
``calculate_pool_sizes_from_max_tokens`` for the Full, SWA, C4, C128 and C4-state pools and
``finalize_with_max_running_requests`` for the C128 state), the pool (``DeepSeekV4TokenToKVPool``
with its SWA pool, C4 + indexer pools, C4 / C4-indexer compress-state pools and C128 + state pools,
built with the arguments ``KVCacheConfigurator._build_dsv4_kv_pool`` passes) and the allocator
(``SWATokenToKVPoolAllocator`` over that pool, as ``_build_token_to_kv_pool_allocator`` builds it for
a paged-SWA DSV4 pool). With HiCache attached, ``init_hicache`` on that pool selects SGLang's
DeepSeek-V4 host stack itself (``build_deepseek_v4_hicache_stack``: a ``LogicalHostPool`` anchor,
``DeepSeekV4PagedHostPool`` for SWA, C4, C4 indexer and C128, ``DeepSeekV4StateHostPool`` for the C4
states).

What stands in: the layers. The allocators count Full and SWA slots; the compressed pools have no
allocator of their own (their slots follow the Full index: ``loc // ratio``; the C4 states follow the
SWA page), so the accounting is the same for any number of layers. The pool is built with one layer
per compression ratio the model has (:func:`stand_in_ratios`: DeepSeek-V4.1's 61 layers, 60 C4 and
one C128, become two), which is what lets a fleet-sized pool (4M Full tokens) fit in a CPU machine's
memory; every pool keeps the size the configurator gave it. No KV is written (no forward runs).

Invariants (checked by ``tests/upstream/test_simulate_dsv4_pool.py``): the pool is
``DeepSeekV4TokenToKVPool``; its SWA size is what the configurator gives for the fleet's tails (equal
to its cap-mode formula, :func:`.swa_pool.swa_pool_for_tails`); after the same requests its
allocator's free and the tree's evictable Full and SWA slots equal those the engine's scheduler leaves
on its own DSV4 pool.

Everything called with a fixed signature is pinned in :data:`PINS`; a drifted target refuses with
:class:`PoolRefused` naming it, before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

# DeepSeek-V4's latent geometry: SGLang's V4 layout fixes it (584-byte rows: 448 nope + 64 rope).
QK_NOPE_HEAD_DIM, QK_ROPE_HEAD_DIM, INDEX_HEAD_DIM = 448, 64, 128
KV_CACHE_DTYPE = "fp8_e4m3"  # what SGLang's DSV4 overrides resolve --kv-cache-dtype auto to

_CFG = "sglang.srt.model_executor.pool_configurator"
_POOL = "sglang.srt.mem_cache.deepseek_v4_memory_pool"
_KVC = "sglang.srt.mem_cache.kv_cache_configurator"
_HOST = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"
PINS = {
    # the sizes: the configurator a DSV4 boot builds, and what gives the pool sizes (tails in cap mode)
    f"{_CFG}:DSV4PoolConfigurator.__init__": "bfa7e9dd41c21d6f36a0c31292aa94ec61b8662a610d6425d78587d8b08c1059",
    f"{_CFG}:DSV4PoolConfigurator.calculate_pool_sizes_from_max_tokens": (
        "c92cde13ed72cba01604e77cdf9a11cf7f44ba79105ffc9e3eb19ab0b5044850"),
    f"{_CFG}:DSV4PoolConfigurator.finalize_with_max_running_requests": (
        "be64fa68f4456c055f6e743e8b8426e8f923eac3beeb0216bae7985c1db6f40e"),
    f"{_CFG}:DSV4PoolConfigurator._compute_dsv4_sizes": (
        "06830ac00e5b1894643b7ea149b133faefa4400913cf73d45abc0a85e5d77f0e"),
    f"{_CFG}:DSV4PoolConfigurator._resolve_swa_cap_tokens": (
        "ab17ab73ad147c662b052451d745c8ae10cff86eb8cf3af6c706aaf32388cfe8"),
    # the pool and the allocator, built as the engine's KV cache configurator builds them
    f"{_POOL}:DeepSeekV4TokenToKVPool.__init__": "2d9d15898f70c7814f372524bf99c9cfaabb9c44b385d61245396a9c91040ad4",
    f"{_KVC}:KVCacheConfigurator._build_dsv4_kv_pool": (
        "9c8be23a7d4cbfe51379c0393169949fa41d2fa99f2442d6663b5d1ffc62469f"),
    f"{_KVC}:KVCacheConfigurator._build_token_to_kv_pool_allocator": (
        "a0bc1c4af3054a7b01af841b7911a6c8e9718204e75f3d81539f9a1ceb57162e"),
    "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator.__init__": (
        "afacb9cfb673a688360595c8642a89b97a50de2d6453c7bcfc6f862c41a3494a"),
    # +hicache: the DSV4 host stack init_hicache selects for this pool
    f"{_HOST}:_DeepSeekV4Strategy.matches": "8e96ee470e6aea382285b2cbf31ada1381644be2d6c8efbdb1c56cd218125298",
    f"{_HOST}:build_deepseek_v4_hicache_stack": "e5f13dc15ba71288bb271cce4f707a59a296c8eb36dbef0ac63eb019fb5e1039",
}


class PoolRefused(RuntimeError):
    """An upstream call this module makes drifted from its pin: the DSV4 pool cannot be built as pinned."""


def check_pins(pins: dict[str, str] | None = None) -> None:
    """Raise :class:`PoolRefused` naming every drifted pin in ``pins`` (default :data:`PINS`)."""
    from adapter.core.pins import drifted

    found = drifted(PINS if pins is None else pins)
    if found:
        raise PoolRefused(f"simulate's DeepSeek-V4 pool refused: {'; '.join(found)}")


def stand_in_ratios(ratios: tuple[int, ...]) -> tuple[int, ...]:
    """One layer per compression ratio the model has, in the order they first appear."""
    return tuple(dict.fromkeys(ratios))


@dataclass(frozen=True)
class Dsv4Pool:
    """The pool sizes SGLang's configurator gives at the fleet's geometry, and the layers standing in."""

    full: int
    swa: int
    c4: int
    c128: int
    c4_state: int
    c128_state: int
    ratios: tuple[int, ...]  # the model's layers' compression ratios
    layers: tuple[int, ...]  # the stand-in layers' ratios
    kv_sources: tuple[int, ...] = ()  # the model's kv_source_layer_ids (ratios 1 and 2 share KV)
    window: int = 128
    page: int = 256
    max_running: int = 64

    def describe(self) -> str:
        counts = ", ".join(f"{self.ratios.count(r)} {_name(r)}" for r in self.layers)
        return (f"SGLang's DeepSeekV4TokenToKVPool sized by its DSV4PoolConfigurator: Full {self.full:,}, "
                f"SWA {self.swa:,}, C4 {self.c4:,}, C128 {self.c128:,}, C4 state {self.c4_state:,}, "
                f"C128 state {self.c128_state:,}; {len(self.layers)} layers "
                f"({', '.join(_name(r) for r in self.layers)}) stand in for the model's {len(self.ratios)} "
                f"({counts})")

    def stand_in_sources(self) -> list[int]:
        """The stand-in layers that own shared KV (ratios 1 and 2: those the model lists as sources)."""
        owned = {self.ratios[i] for i in self.kv_sources if 0 <= i < len(self.ratios)}
        return [i for i, r in enumerate(self.layers) if r in (1, 2) and r in owned]


def _name(ratio: int) -> str:
    return "SWA-only" if ratio == 0 else f"C{ratio}"


def configure(*, ratios: tuple[int, ...], kv_sources: tuple[int, ...], window: int, page: int, chunk: int,
              max_running: int, tails: int, full_tokens: int) -> Dsv4Pool:
    """The pool sizes SGLang's ``DSV4PoolConfigurator`` gives for ``full_tokens`` Full tokens at this
    geometry (publishes the process-global ServerArgs it reads: page, chunk, running requests, tails)."""
    from sglang.srt.model_executor.pool_configurator import DSV4PoolConfigurator
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    check_pins()
    set_global_server_args_for_scheduler(ServerArgs(
        model_path="dummy", page_size=page, chunked_prefill_size=chunk, max_running_requests=max_running,
        swa_prefix_tails=tails))
    model = SimpleNamespace(  # what the configurator reads of ModelConfig
        qk_nope_head_dim=QK_NOPE_HEAD_DIM, qk_rope_head_dim=QK_ROPE_HEAD_DIM, index_head_dim=INDEX_HEAD_DIM,
        context_len=full_tokens, compress_ratios=list(ratios), window_size=window,
        hf_config=SimpleNamespace(kv_source_layer_ids=list(kv_sources)))
    kvc = SimpleNamespace(  # ... and of the KV cache configurator: one rank, no PP, no speculative decoding
        kv_cache_dtype_str=KV_CACHE_DTYPE, model_config=model, pp_size=1, attn_dp_size=1, page_size=page,
        layer_info=SimpleNamespace(start_layer=0, end_layer=len(ratios)), sliding_window_size=window,
        spec_algorithm=SpeculativeAlgorithm.NONE, spec_aux_config=None)
    configurator = DSV4PoolConfigurator(kvc)
    config = configurator.calculate_pool_sizes_from_max_tokens(full_tokens, page)
    config.max_running_requests = max_running
    config = configurator.finalize_with_max_running_requests(config)
    return Dsv4Pool(full=config.full_max_total_num_tokens, swa=config.swa_max_total_num_tokens,
                    c4=config.c4_max_total_num_tokens, c128=config.c128_max_total_num_tokens,
                    c4_state=config.c4_state_pool_size, c128_state=config.c128_state_pool_size,
                    ratios=tuple(ratios), layers=stand_in_ratios(tuple(ratios)), kv_sources=tuple(kv_sources),
                    window=window, page=page, max_running=max_running)


def build_kv(sizes: Dsv4Pool, req_to_token_pool: Any) -> tuple[Any, Any]:
    """``DeepSeekV4TokenToKVPool`` (the stand-in layers, every pool at its configured size) and its
    ``SWATokenToKVPoolAllocator``, with the arguments the engine's KV cache configurator passes on one
    rank without speculative decoding. Call after the process-global ServerArgs are published."""
    import torch
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    check_pins()
    layers = len(sizes.layers)
    pool = DeepSeekV4TokenToKVPool(
        max_num_reqs=sizes.max_running, num_req_slots=req_to_token_pool.req_to_token.shape[0],
        swa_size=sizes.swa, c4_size=sizes.c4, c128_size=sizes.c128, c4_state_pool_size=sizes.c4_state,
        c128_state_pool_size=sizes.c128_state, page_size=sizes.page, swa_page_size=sizes.page,
        sliding_window=sizes.window, dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
        c128_state_dtype=torch.float32, qk_nope_head_dim=QK_NOPE_HEAD_DIM, qk_rope_head_dim=QK_ROPE_HEAD_DIM,
        indexer_head_dim=INDEX_HEAD_DIM, layer_num=layers, device="cpu", enable_memory_saver=False,
        compression_ratios=list(sizes.layers), start_layer=0, end_layer=layers,
        kv_source_layers=sizes.stand_in_sources(), full_size=sizes.full)
    if not pool.needs_paged_swa_allocator or pool.swa_kv_pool is None:
        raise PoolRefused("simulate models the paged SWA pool of DeepSeek-V4 (no encoder SWA bounded replay, "
                          "no unified KV ring): this process's SGLang settings built another")
    allocator = SWATokenToKVPoolAllocator(
        sizes.full, sizes.swa, page_size=sizes.page, dtype=torch.float8_e4m3fn, device="cpu", kvcache=pool,
        need_sort=False, req_to_token_pool=req_to_token_pool)
    return pool, allocator


def host_stack(cache: Any) -> list[tuple[str, str]]:
    """(pool name, host pool class) of each entry of the cache's HiCache host stack."""
    group = getattr(cache, "host_pool_group", None)
    if group is None:
        return []
    return [(str(getattr(e.name, "value", e.name)), type(e.host_pool).__name__) for e in group.entries]
