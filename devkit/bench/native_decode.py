"""``python -m adapter bench native-decode [--quick]``: what the stock DSV4 decode copies per step.

SGLang 0.5.23's SM120 DSV4 decode copies, per layer per step, every 256-token SWA page the step's
window rows touch into four 64-token pages (a mark kernel, a memset of the page mask and the split
launch come with it). With ``DSV41_SWA_NATIVE_DECODE=1`` a served call reads the pool in place:
0 bytes and 0 of those launches. This benchmark counts, on CPU, for DSV4 decode shapes (batch
1-64, one query row per request, SWA window 128 on 256-token pages, top-k 512 on the C4A cache,
which neither path copies):

* touched pages per layer call (mean over random context lengths 1K-256K and page tables),
* bytes the stock split writes per decode step (touched x 4 x 64 x 584 B, times the layers),
* the launches the split chain adds per step,
* per shape (decode batch 1 / 64 / 65 / 256, speculative verify with 5-token blocks at batch
  1 / 12 / 13 / 64) and for 43 and 61 layers: the bytes the whole copy chain reads and writes per
  step (page copy read + write, the mask memset over the whole pool, the mark kernel, the split
  grid's mask reads) on the stock path and what is left with the switch on. Calls of more than 64
  rows go to ``_flash_mla_sm120_prefill``, which copies too and which the switch does not serve,
  so those shapes keep their whole cost (a 5-token verify block passes 64 rows from batch 13);
* the persistent split buffer (4 x 37,440 B per SWA pool page) the first stock call allocates,

and runs the pure-torch reference decode (:mod:`devkit.reference.dsv4_decode`) on the in-place
256-token view and on the 64-token split: gathered bytes and outputs must be identical.

Nothing here is a speed figure: decode speed and bit identity on SM120/SM121 need that hardware
(the reference fleet measured +1.4 / +1.9 % greedy c1 with identical output bits; not measured here).
"""

from __future__ import annotations

import os

import torch

from devkit.reference import dsv4_decode as ref

LAYERS = 43  # decode-attention layers per step of DeepSeek-V4-Flash (every layer reads its SWA pages)
LAYER_COUNTS = (43, 61)  # V4-Flash / V4.1-Flash and the 61-layer V4 checkpoints
STOCK_LAUNCHES_PER_LAYER = 3  # _page_mark_kernel, mask.zero_(), _page_split_kernel
HEADS = 64
WINDOW = 128
TOPK = 512
MIN_CONTEXT, MAX_CONTEXT = 1024, 256 * 1024
KiB = 1024
MAX_DECODE_ROWS = 64  # SM120_DECODE_MAX_TOKENS: more rows go to _flash_mla_sm120_prefill (copies too)
VERIFY_TOKENS = 5  # a speculative verify block (4 draft tokens + 1): 5 query rows per request
POOL_PAGES = 4096  # SWA pool pages the mask memset and the split grid span (1,048,576 SWA tokens)
SPLIT_PAGE_BYTES = 4 * (64 * 576 + 64 * 8)  # 149,504 B read from the pool and as many written per touched page
BUFFER_BYTES_PER_POOL_PAGE = 4 * 37440  # the persistent split buffer: 4 padded 64-token pages per pool page
# (config name, requests, query rows per request)
SHAPES = (("decode", 1, 1), ("decode", 64, 1), ("decode", 65, 1), ("decode", 256, 1),
          ("verify", 1, VERIFY_TOKENS), ("verify", 12, VERIFY_TOKENS), ("verify", 13, VERIFY_TOKENS),
          ("verify", 64, VERIFY_TOKENS))  # fmt: skip


def touched_pages_per_call(batch: int, draws: int, seed: int = 0, span: int = WINDOW) -> float:
    """Mean distinct SWA pages one layer call reads: each request's last ``span`` positions (the window,
    plus ``q - 1`` for a ``q``-token verify block), mapped through its own random page table into a
    shared pool."""
    g = torch.Generator().manual_seed(seed)
    pages_per_request = MAX_CONTEXT // ref.SWA_PAGE
    total = 0
    for _ in range(draws):
        lengths = torch.randint(MIN_CONTEXT, MAX_CONTEXT + 1, (batch,), generator=g)
        table = torch.randperm(batch * pages_per_request, generator=g).reshape(batch, pages_per_request)
        positions = lengths.unsqueeze(1) - span + torch.arange(span)
        slots = table.gather(1, positions // ref.SWA_PAGE) * ref.SWA_PAGE + positions % ref.SWA_PAGE
        total += int(ref.touched_pages(slots, ref.SWA_PAGE).numel())
    return total / draws


def chain_bytes(rows: int, touched: float, pool_pages: int = POOL_PAGES) -> dict[str, float]:
    """Bytes one stock layer call moves before attention (read and write), by step of the copy chain."""
    return {
        "copy_read": touched * SPLIT_PAGE_BYTES,  # _page_split_kernel: data + scales of each touched page
        "copy_write": touched * SPLIT_PAGE_BYTES,  # ... into four 64-token pages of the persistent buffer
        "mask_zero_write": pool_pages,  # mask.zero_(): one byte per pool page, every call
        "mark_read": rows * WINDOW * 4,  # _page_mark_kernel reads every int32 SWA index
        "mark_write": rows * WINDOW,  # ... and stores one mask byte per valid index
        "split_mask_read": 4 * pool_pages,  # 4 x pool-pages split programs, each reads its page's mask byte
    }


def shape_costs(draws: int, pool_pages: int = POOL_PAGES) -> list[dict]:
    """Per shape and layer count: the stock chain's bytes per step and what is left with the switch on."""
    out = []
    for kind, batch, q in SHAPES:
        rows = batch * q
        touched = touched_pages_per_call(batch, draws, seed=1000 * q + batch, span=WINDOW + q - 1)
        per_call = chain_bytes(rows, touched, pool_pages)
        stock_call = sum(per_call.values())
        served = rows <= MAX_DECODE_ROWS  # the switch serves <= 64 rows in place; more keep the prefill copy
        for layers in LAYER_COUNTS:
            out.append({
                "shape": f"{kind} b{batch}", "rows": rows, "layers": layers, "touched_pages_per_call": round(touched, 2),
                "stock_path": "_flash_mla_flashinfer" if served else "_flash_mla_sm120_prefill",
                "stock_bytes_per_step": round(stock_call * layers),
                "stock_copy_rw_bytes_per_step": round((per_call["copy_read"] + per_call["copy_write"]) * layers),
                "switch_bytes_per_step": 0 if served else round(stock_call * layers),
                "stock_launches_per_step": STOCK_LAUNCHES_PER_LAYER * layers,
                "switch_launches_per_step": 0 if served else STOCK_LAUNCHES_PER_LAYER * layers,
                "split_grid_blocks_per_call": 4 * pool_pages,
            })  # fmt: skip
    return out


def run(quick: bool = False) -> dict:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    batches = (1, 4, 16, 64) if quick else (1, 2, 4, 8, 16, 32, 64)
    draws = 16 if quick else 64
    checks = (1, 8) if quick else (1, 16, 64)
    per_page = ref.split_copy_bytes(1)  # 4 x 64 x 584 = 149,504 B written (and as many read)

    rows = []
    for batch in batches:
        touched = touched_pages_per_call(batch, draws, seed=batch)
        per_call = touched * per_page
        rows.append((batch, touched, per_call, per_call * LAYERS))

    results = []
    for batch in checks:
        case = ref.decode_case(batch, heads=HEADS, window=WINDOW, topk=TOPK, pages_per_request=2, seed=100 + batch)
        results.append((batch, ref.compare_addressings(case)))
    bytes_identical = all(r["bytes_identical"] for _, r in results)
    outputs_identical = all(r["outputs_identical"] for _, r in results)
    max_abs_diff = max(r["max_abs_diff"] for _, r in results)

    costs = shape_costs(draws)
    print(f"DSV4 decode, SWA window {WINDOW} on {ref.SWA_PAGE}-token pages, top-k {TOPK} (C4A, not copied), "
          f"{HEADS} heads, {LAYERS} layers/step, contexts {MIN_CONTEXT}-{MAX_CONTEXT} tokens, {draws} draws")  # fmt: skip
    print("page-copy bytes WRITTEN per decode step (as many are read; full read + write table below):")
    print(f"{'batch':>5}  {'touched pages/call':>18}  {'stock KiB/layer':>15}  {'stock KiB/step':>14}  "
          f"{'native KiB/step':>15}  {'stock launches/step':>19}")  # fmt: skip
    for batch, touched, per_call, per_step in rows:
        print(f"{batch:>5}  {touched:>18.2f}  {per_call / KiB:>15.1f}  {per_step / KiB:>14.1f}  {0:>15}  "
              f"{STOCK_LAUNCHES_PER_LAYER * LAYERS:>19}")  # fmt: skip
    print(f"\nbytes the copy chain moves per decode step, read + write (page copy {SPLIT_PAGE_BYTES} B read and "
          f"{SPLIT_PAGE_BYTES} B written per touched page; mask {POOL_PAGES} B zeroed and {4 * POOL_PAGES} B read by "
          f"the {4 * POOL_PAGES}-block split grid per call for a {POOL_PAGES}-page SWA pool; mark: 4 B read + 1 B "
          f"written per SWA index); verify = {VERIFY_TOKENS}-token blocks; more than {MAX_DECODE_ROWS} rows go "
          f"to _flash_mla_sm120_prefill, which the switch does not serve")  # fmt: skip
    print(f"{'shape':>11} {'rows':>5} {'layers':>6} {'pages/call':>10} {'stock path':>25} {'stock MiB/step':>14} "
          f"{'switch MiB/step':>15} {'launches stock/switch':>21}")  # fmt: skip
    for c in costs:
        print(f"{c['shape']:>11} {c['rows']:>5} {c['layers']:>6} {c['touched_pages_per_call']:>10.2f} "
              f"{c['stock_path']:>25} {c['stock_bytes_per_step'] / 2**20:>14.2f} "
              f"{c['switch_bytes_per_step'] / 2**20:>15.2f} "
              f"{c['stock_launches_per_step']:>10}/{c['switch_launches_per_step']:<10}")  # fmt: skip
    print(f"persistent split buffer: {BUFFER_BYTES_PER_POOL_PAGE} B per SWA pool page "
          f"({POOL_PAGES * BUFFER_BYTES_PER_POOL_PAGE / 2**30:.2f} GiB for {POOL_PAGES} pages), allocated by the "
          f"first stock call; with the switch only a > 64-row call allocates it")  # fmt: skip
    print("reference decode, in-place 256-token view vs 64-token split (touched pages only):")
    for batch, r in results:
        print(f"  batch {batch:>2}: touched {r['touched_pages']:>3} pages, gathered bytes identical "
              f"{r['bytes_identical']}, outputs identical {r['outputs_identical']}, max |diff| {r['max_abs_diff']}")  # fmt: skip
    print("speed / SM120 bit identity: GPU-unverified here (reference fleet: +1.4 / +1.9 % greedy c1)")

    by_batch = {str(batch): round(per_step) for batch, _, _, per_step in rows}
    c1 = next(per_step for batch, _, _, per_step in rows if batch == 1)

    def remaining(shape: str, layers: int) -> int:
        return next(c["switch_bytes_per_step"] for c in costs if c["shape"] == shape and c["layers"] == layers)

    return {
        "layers": LAYERS,
        "bytes_per_touched_page": per_page,
        "touched_pages_per_call": {str(b): round(t, 2) for b, t, _, _ in rows},
        "copied_bytes_per_step_stock": round(c1),
        "copied_bytes_per_step_stock_by_batch": by_batch,
        "copied_bytes_per_step_native": 0,
        "stock_launches_per_step": STOCK_LAUNCHES_PER_LAYER * LAYERS,
        "native_launches_per_step": 0,
        "pool_pages_assumed": POOL_PAGES,
        "chain_rw_bytes_per_step": {f"{c['shape']} L{c['layers']}": c["stock_bytes_per_step"] for c in costs},
        "remaining_rw_bytes_per_step_with_switch": {
            f"{c['shape']} L{c['layers']}": c["switch_bytes_per_step"] for c in costs
        },
        "remaining_verify_b64_L61": remaining("verify b64", 61),
        "split_buffer_bytes_per_pool_page": BUFFER_BYTES_PER_POOL_PAGE,
        "bytes_identical": bytes_identical,
        "outputs_identical": outputs_identical,
        "max_abs_diff": max_abs_diff,
        "gpu_verified": False,
    }
