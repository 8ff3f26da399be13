"""The DSV4 kit server with a probe inside its scheduler, for cone replay's exactness (devkit only).

Run as ``python -m devkit.engine_kit.dsv4.cone_probe <launch_server args>``: it installs the probe,
then runs ``sglang.launch_server``. SGLang starts its scheduler with multiprocessing ``spawn``,
which re-imports this main module in the child (as ``__mp_main__``), so the probe is installed in
the scheduler process too. Nothing here runs in production.

The probe, driven by ``$CONE_PROBE_DIR/control.json`` (re-read before every match and forward):

* ``{"dump": "name"}``: after every extend forward, write ``name-<k>.pt`` with, per request of the
  batch, the KV the forward left in the real ``DeepSeekV4TokenToKVPool`` for every whole page of
  its extend (positions, per layer: the SWA page bytes, and every Full-side page row the cone
  copies: C4 / C128 latents and C4 index keys), and the batch's next-token logits.
  ``{"dump": "name", "whole": true}``: every whole page from position 0 (the prefix the forward
  read too, e.g. what a HiCache load-back wrote); a page whose SWA rows are not mapped on device
  (outside the window) has ``"swa": None``.
* ``{"tokens": N}``: the cone's replay depth for the next matches (a test lowers it below the
  bound, which the switch refuses at boot); ``{"cone": false}``: the cache's cone is off (stock).
* ``{"mask": false}``: the cone's DSV4 write mask is not applied (the negative control).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from devkit.engine_kit.dsv4 import probe_hook

_COUNT = [0]


def _control() -> dict[str, Any]:
    path = Path(os.environ["CONE_PROBE_DIR"]) / "control.json"
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _pages_of(fb: Any, i: int, page: int, whole: bool = False) -> tuple[int, int]:
    prefix = 0 if whole else int(fb.extend_prefix_lens_cpu[i])
    seq = int(fb.seq_lens_cpu[i])
    return -(-prefix // page) * page, seq // page * page


def dump(runner: Any, fb: Any, out: Any, name: str, whole: bool = False) -> None:
    import torch

    from adapter.switches.cone_replay.copy import full_side_buffers

    pool = runner.token_to_kv_pool
    page = int(pool.page_size)
    req_to_token = runner.req_to_token_pool.req_to_token
    full = full_side_buffers(pool)
    reqs = []
    for i, row in enumerate(fb.req_pool_indices.tolist()):
        lo, hi = _pages_of(fb, i, page, whole)
        entry: dict[str, Any] = {"prefix": int(fb.extend_prefix_lens_cpu[i]), "seq": int(fb.seq_lens_cpu[i]),
                                 "pages": {}}
        for start in range(lo, hi, page):
            slots = req_to_token[row, start : start + page].to(torch.int64)
            full_page = int(slots[0]) // page
            swa = pool.translate_loc_from_full_to_swa(slots).to(torch.int64)
            swa_page = int(swa[0]) // page
            mapped = bool(torch.equal(swa, swa_page * page + torch.arange(page)))
            assert mapped or whole, "SWA page not contiguous"
            entry["pages"][start] = {
                "swa": [buf[swa_page].clone() for buf in pool.swa_kv_pool.kv_buffer] if mapped else None,
                "full": [buf[full_page * rows : (full_page + 1) * rows].clone() for buf, rows in full],
            }
        reqs.append(entry)
    logits = getattr(getattr(out, "logits_output", None), "next_token_logits", None)
    _COUNT[0] += 1
    path = Path(os.environ["CONE_PROBE_DIR"]) / f"{name}-{_COUNT[0]}.pt"
    torch.save({"reqs": reqs, "logits": None if logits is None else logits.float().clone()}, path)


def _dump_if_asked(runner: Any, fb: Any, out: Any) -> None:
    control = _control()
    if control.get("dump"):
        dump(runner, fb, out, control["dump"], bool(control.get("whole", False)))


def _patch_runner(module: Any) -> None:
    probe_hook.after_extend_forward(module, "_cone_probe", _dump_if_asked)


def _patch_switch() -> None:
    from adapter.switches.cone_replay import dsv4, geometry
    from adapter.switches.cone_replay import plan as plan_mod

    plan = plan_mod.plan
    apply = dsv4.apply

    def controlled_plan(cache, params, result):
        cfg = geometry.cache_config(cache)
        control = _control()
        if cfg is not None:
            if not hasattr(cfg, "_probe_tokens"):
                cfg._probe_tokens, cfg._probe_enabled = cfg.tokens, cfg.enabled
            cfg.tokens = int(control.get("tokens", cfg._probe_tokens))
            cfg.enabled = bool(control.get("cone", True)) and cfg._probe_enabled
        return plan(cache, params, result)

    def controlled_apply(forward_batch, layout, window, page):
        if _control().get("mask", True):
            return apply(forward_batch, layout, window, page)
        return 0

    plan_mod.plan = controlled_plan
    dsv4.apply = controlled_apply


def install() -> None:
    if "CONE_PROBE_DIR" not in os.environ:
        return
    _patch_switch()
    probe_hook.after_import(_patch_runner)


install()

if __name__ == "__main__":
    probe_hook.launch_server()
