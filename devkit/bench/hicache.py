"""``python -m adapter bench hicache [--quick]``: an idle session's resumed turn on the Mellum kit's real
server, stock and the profile, each without and with SGLang's HiCache, side by side in one run.

One boot per row configuration (a boot is 1-3 minutes on this machine, so even ``--quick`` runs
several minutes: the figures need real servers), both workload forms on each boot (``/flush_cache``
between them). Geometry: a 2048-token pool, ``--swa-full-tokens-ratio 0.1`` (a 204-token SWA pool),
page 1, window 32. The session: a 600-token prompt, 8 greedy tokens; then churn; then the resumed
turn = the session's history + 24 new tokens, 2 greedy tokens with the whole vocabulary's logprobs.

* form ``swa``: four 150-token churn prompts overflow the SWA pool, not the Full pool: only the
  session's window is evicted;
* form ``full``: four 600-token churn prompts press the Full pool: the session's Full KV goes too.

Per row: history tokens prefilled again on the resumed turn (``recomputed``), tokens loaded from host
and from L3 (SGLang's ``cached_tokens_details``), the Full-pool bytes those loads moved host ->
device (``bytes_moved``: loaded tokens x 512, two Full layers x K and V x 2 heads x 16 dims x fp32;
the SWA window's rows, at most 32 tokens x 512 bytes more, are not counted), the turn's e2e time
(``ttft_s``: 2 output tokens, CPU, relative only), and the largest |logprob| difference over the
whole vocabulary of both output tokens against a full re-prefill of the same prompt on the same boot
(``logprob_max_diff``).

Rows: ``stock`` (no HiCache), ``stock_hicache`` (host 4x the device pool), ``stock_hicache_small``
(host = the device pool: the form ``full`` churn evicts host too), ``stock_hicache_l3`` (the small
host plus the ``file`` L3), ``profile`` (the gate's profile: every acting switch this build has) and
``profile_hicache`` (the profile, host 4x). ``--quick``: the four rows without ``_small`` / ``_l3``.
The DSV4 kits are not in this benchmark.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

KIT = "mellum"
SESSION, OUT, NEW = 600, 8, 24
FORMS = {"swa": (4, 150), "full": (4, 600)}
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # the Full pool: 2 layers x (K, V) x 2 heads x 16 dims x fp32


def _rows(quick: bool) -> list[tuple[str, bool, float | None, bool]]:
    """(name, profile, hicache ratio or None, L3)."""
    rows = [("stock", False, None, False), ("stock_hicache", False, 4.0, False)]
    if not quick:
        rows += [("stock_hicache_small", False, 1.0, False), ("stock_hicache_l3", False, 1.0, True)]
    return [*rows, ("profile", True, None, False), ("profile_hicache", True, 4.0, False)]


def _profile() -> dict[str, str]:
    from devkit.gate import kits
    from devkit.gate.verdict import build_profile

    profile = build_profile()
    profile.update({k: v for k, v in kits.kit(KIT).profile_overrides().items() if k in profile})
    return profile


def _form(url: str, form: str, tag: str) -> dict[str, Any]:
    from devkit.engine_kit import client
    from devkit.testkit import hicache as hc

    hc.flush(url)
    session = hc._ids(f"{tag}.session", SESSION)
    first = client.generate(url, session, OUT)
    history = session + first["output_ids"]
    count, tokens = FORMS[form]
    for i in range(count):
        client.generate(url, hc._ids(f"{tag}.churn{i}", tokens), 1)
    time.sleep(1.0)
    prompt = history + hc._ids(f"{tag}.new", NEW)
    resumed = hc.generate(url, prompt, 2)
    hc.flush(url)
    reference = hc.generate(url, prompt, 2)  # the full re-prefill
    details = resumed["details"]
    host, l3 = int(details.get("host", 0)), int(details.get("storage", 0))
    return {
        "recomputed": len(history) - min(resumed["cached_tokens"], len(history)),
        "loaded_from_host": host,
        "loaded_from_l3": l3,
        "bytes_moved": (host + l3) * KV_BYTES_PER_TOKEN,
        "ttft_s": resumed["e2e_s"],
        "logprob_max_diff": hc.max_logprob_diff(reference, resumed),
        "tokens_equal": resumed["tokens"] == reference["tokens"],
    }


def _boot_row(model: Path, work: Path, name: str, profiled: bool, ratio: float | None, l3: bool,
              profile: dict[str, str]) -> list[dict[str, Any]]:
    from devkit.engine_kit import launcher
    from devkit.testkit import hicache as hc

    extra = ["--swa-full-tokens-ratio", "0.1"]
    if ratio is not None:
        extra += hc.hicache_flags(ratio, work / f"{name}.l3" if l3 else None)
    args = launcher.server_args(model, launcher.free_port(), max_total_tokens=2048, extra=extra)
    server = launcher.Server(args, work / f"{name}.log", profile if profiled else {}, ready_timeout_s=600)
    out = []
    with server:
        for form in FORMS:
            row = {"name": name, "kit": KIT, "form": form, **_form(server.base_url, form, f"{name}.{form}")}
            out.append(row)
            print(f"[bench hicache] {name} {form}: recomputed {row['recomputed']} host {row['loaded_from_host']} "
                  f"l3 {row['loaded_from_l3']} ttft {row['ttft_s']} s diff {row['logprob_max_diff']:.3g}", flush=True)
    return out


def run(quick: bool = False) -> dict[str, Any]:
    from devkit.engine_kit import model as mk

    start = time.perf_counter()
    profile = _profile()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_hicache_") as tmp:
        work = Path(tmp)
        model = mk.make_model(work / "model")
        for name, profiled, ratio, l3 in _rows(quick):
            rows.extend(_boot_row(model, work, name, profiled, ratio, l3, profile))
    wall = time.perf_counter() - start

    print(f"HiCache beside the switches, {KIT} kit (pool 2048, SWA 204, page 1, window 32); session {SESSION} "
          f"+ {OUT}, resumed turn +{NEW}; profile: {' '.join(f'{k}={v}' for k, v in profile.items()) or '(empty)'}")
    print(f"{'row':<20} {'form':<5} {'recomputed':>10} {'from host':>9} {'from L3':>7} {'bytes':>9} "
          f"{'ttft_s':>7} {'logprob diff':>12} {'tokens':>6}")
    for r in rows:
        print(f"{r['name']:<20} {r['form']:<5} {r['recomputed']:>10} {r['loaded_from_host']:>9} "
              f"{r['loaded_from_l3']:>7} {r['bytes_moved']:>9} {r['ttft_s']:>7.3f} {r['logprob_max_diff']:>12.3g} "
              f"{'same' if r['tokens_equal'] else 'differ':>6}")
    print(f"wall {wall:.0f} s")
    return {"rows": rows, "profile": profile, "wall_s": round(wall, 1)}
