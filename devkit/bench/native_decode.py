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

and runs the pure-torch reference decode (:mod:`devkit.reference.dsv4_decode`) on the in-place
256-token view and on the 64-token split: gathered bytes and outputs must be identical.

Nothing here is a speed figure: decode speed and bit identity on SM120/SM121 need that hardware
(the reference fleet measured +1.4 / +1.9 % greedy c1 with identical output bits; not measured here).
"""

from __future__ import annotations

import os

import torch

from devkit.reference import dsv4_decode as ref

LAYERS = 43  # decode-attention layers per step: the reference notes count 43 copy chains per c1 step
STOCK_LAUNCHES_PER_LAYER = 3  # _page_mark_kernel, mask.zero_(), _page_split_kernel
HEADS = 64
WINDOW = 128
TOPK = 512
MIN_CONTEXT, MAX_CONTEXT = 1024, 256 * 1024
KiB = 1024


def touched_pages_per_call(batch: int, draws: int, seed: int = 0) -> float:
    """Mean distinct SWA pages one layer call reads: each request's last ``WINDOW`` positions,
    mapped through its own random page table into a shared pool."""
    g = torch.Generator().manual_seed(seed)
    pages_per_request = MAX_CONTEXT // ref.SWA_PAGE
    total = 0
    for _ in range(draws):
        lengths = torch.randint(MIN_CONTEXT, MAX_CONTEXT + 1, (batch,), generator=g)
        table = torch.randperm(batch * pages_per_request, generator=g).reshape(batch, pages_per_request)
        positions = lengths.unsqueeze(1) - WINDOW + torch.arange(WINDOW)
        slots = table.gather(1, positions // ref.SWA_PAGE) * ref.SWA_PAGE + positions % ref.SWA_PAGE
        total += int(ref.touched_pages(slots, ref.SWA_PAGE).numel())
    return total / draws


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

    print(f"DSV4 decode, SWA window {WINDOW} on {ref.SWA_PAGE}-token pages, top-k {TOPK} (C4A, not copied), "
          f"{HEADS} heads, {LAYERS} layers/step, contexts {MIN_CONTEXT}-{MAX_CONTEXT} tokens, {draws} draws")  # fmt: skip
    print(f"{'batch':>5}  {'touched pages/call':>18}  {'stock KiB/layer':>15}  {'stock KiB/step':>14}  "
          f"{'native KiB/step':>15}  {'stock launches/step':>19}")  # fmt: skip
    for batch, touched, per_call, per_step in rows:
        print(f"{batch:>5}  {touched:>18.2f}  {per_call / KiB:>15.1f}  {per_step / KiB:>14.1f}  {0:>15}  "
              f"{STOCK_LAUNCHES_PER_LAYER * LAYERS:>19}")  # fmt: skip
    print("reference decode, in-place 256-token view vs 64-token split (touched pages only):")
    for batch, r in results:
        print(f"  batch {batch:>2}: touched {r['touched_pages']:>3} pages, gathered bytes identical "
              f"{r['bytes_identical']}, outputs identical {r['outputs_identical']}, max |diff| {r['max_abs_diff']}")  # fmt: skip
    print("speed / SM120 bit identity: GPU-unverified here (reference fleet: +1.4 / +1.9 % greedy c1)")

    by_batch = {str(batch): round(per_step) for batch, _, _, per_step in rows}
    c1 = next(per_step for batch, _, _, per_step in rows if batch == 1)
    return {
        "layers": LAYERS,
        "bytes_per_touched_page": per_page,
        "touched_pages_per_call": {str(b): round(t, 2) for b, t, _, _ in rows},
        "copied_bytes_per_step_stock": round(c1),
        "copied_bytes_per_step_stock_by_batch": by_batch,
        "copied_bytes_per_step_native": 0,
        "stock_launches_per_step": STOCK_LAUNCHES_PER_LAYER * LAYERS,
        "native_launches_per_step": 0,
        "bytes_identical": bytes_identical,
        "outputs_identical": outputs_identical,
        "max_abs_diff": max_abs_diff,
        "gpu_verified": False,
    }
