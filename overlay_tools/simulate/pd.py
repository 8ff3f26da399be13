"""A DeepSeek-V4 PD decode node's retractions priced: SGLang's rebootstrap against KV parking (``--pd``).

What SGLang 0.5.23 does
    A decode node that retracts a request never copies a DeepSeek-V4 request's KV to host:
    ``dsv4_needs_rebootstrap`` (``srt/mem_cache/common.py``) is True for every
    ``DeepSeekV4TokenToKVPool``, so ``DecodePreallocQueue.add`` (``srt/disaggregation/decode.py``)
    re-enqueues it as a rebootstrap: the prefill peer is sent the prompt plus every generated token
    (``Req.build_rebootstrap_payload``, ``max_new_tokens=1``), prefills all of them
    (``_rebootstrap_prefill_len``: ``len(origin_input_ids) + len(output_ids)``, the boundary token popped)
    and sends their KV again.
What ``DSV41_KV_PARK`` changes there
    The decode node's own offload runs through the copy engine
    (``adapter/switches/kv_park/dsv4_offload.py``): the same ``seqlen - 1`` tokens' full-page regions and
    the SWA-page regions of the window are copied to host and back; nothing is prefilled or sent again.

Priced per retraction the replay records (the prompt and the tokens decoded when it was retracted), in
tokens and in modelled seconds: the recompute at the replay's cost model, the bytes at the link and host
bandwidths given (assumptions the output prints; no GPU figure is measured here). The bytes are those of
the replayed pool's own layout (:func:`adapter.switches.kv_park.regions.dsv4_full_layout` /
``dsv4_swa_layout``: the buffers of ``get_contiguous_buf_infos`` / ``get_state_buf_infos``, what PD ships),
scaled from the stand-in layers to the model's layer count per compression ratio.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

GB = 10**9
LINK_GBPS = 50.0  # prefill -> decode KV transfer: one 400 Gb/s NIC (an assumption; --pd-link-gbps)
HOST_GBPS = 25.0  # decode node device <-> pinned host copies (an assumption; --pd-host-gbps)

_RATIO = re.compile(r"^c(\d+)_")
_SWA_LAYER = re.compile(r"^swa_kv\.(\d+)$")


@dataclass(frozen=True)
class KvBytes:
    """What one request's KV weighs on the model's layers: a full page, and an SWA page (window)."""

    full_page: int  # compressed KV + indexer rows of one page, every layer of the model
    swa_page: int  # SWA main-cache page + page-scoped compressor states, every layer of the model
    page: int
    window: int

    def of(self, tokens: int) -> int:
        """Bytes of ``tokens`` tokens: every page they touch, and the SWA pages of the window."""
        pages = -(-tokens // self.page)
        return pages * self.full_page + min(pages, -(-self.window // self.page) + 1) * self.swa_page


def kv_bytes(pool: Any, dsv4: Any) -> KvBytes:
    """:class:`KvBytes` of ``pool`` (the replay's ``DeepSeekV4TokenToKVPool`` on its stand-in layers),
    each region scaled by how many of the model's layers (``dsv4.ratios``) its stand-in layer stands for."""
    from adapter.switches.kv_park import regions

    counts = {r: dsv4.ratios.count(r) for r in dsv4.layers}

    def weight(name: str) -> int:
        swa = _SWA_LAYER.match(name)
        if swa:
            return counts[dsv4.layers[int(swa.group(1))]]
        ratio = _RATIO.match(name)
        return counts.get(int(ratio.group(1)), 1) if ratio else 1

    def per_page(layout: Any) -> int:
        return sum(r.row_bytes * weight(r.name) for r in layout.regions)

    return KvBytes(per_page(regions.dsv4_full_layout(pool)), per_page(regions.dsv4_swa_layout(pool)),
                   dsv4.page, dsv4.window)


@dataclass(frozen=True)
class Retraction:
    """One retraction: the request's prompt and the tokens it had decoded."""

    prompt: int
    decoded: int

    @property
    def moved(self) -> int:
        """Tokens whose KV a rebootstrap recomputes and a park copies: ``seqlen - 1``."""
        return self.prompt + max(self.decoded - 1, 0)


def price(retractions: list[Retraction], kv: KvBytes, coef: Any, chunk: int,
          link_gbps: float = LINK_GBPS, host_gbps: float = HOST_GBPS) -> dict[str, Any]:
    """Both prices of the same retractions. Rebootstrap: the prefill peer prefills ``moved`` tokens in
    chunks of ``chunk`` (the cost model's ``chunk_cost``; its own prefix cache is not consulted: an upper
    bound) and sends their KV over the link. Parked: copied to host and back, nothing recomputed."""
    from adapter import cost_model

    recomputed = sum(r.moved for r in retractions)
    prefill_fs = 0
    for r in retractions:
        for start in range(0, r.moved, chunk):
            prefill_fs += cost_model.chunk_cost([(min(chunk, r.moved - start), start)], coef)
    moved_bytes = sum(kv.of(r.moved) for r in retractions)
    return {
        "pd_retractions": len(retractions),
        "pd_rebootstrap_recomputed_tokens": recomputed,
        "pd_rebootstrap_sent_gb": round(moved_bytes / GB, 3),
        "pd_rebootstrap_s_modelled": round(prefill_fs / 10**15 + moved_bytes / (link_gbps * GB), 3),
        "pd_parked_gb": round(moved_bytes / GB, 3),
        "pd_park_s_modelled": round(2 * moved_bytes / (host_gbps * GB), 3),
        "pd_park_recomputed_tokens": 0,
        "pd_assumed": {"link_gbps": link_gbps, "host_gbps": host_gbps, "full_page_bytes": kv.full_page,
                       "swa_page_bytes": kv.swa_page},
    }


def retractions(events: list[dict[str, Any]], requests: list[Any]) -> list[Retraction]:
    """The replay's retraction events as :class:`Retraction` rows (prompt from the request's own tokens)."""
    by_index = {r.index: r for r in requests}
    return [Retraction(by_index[e["retracted"]].prompt_len, int(e["decoded"])) for e in events if "retracted" in e]


def table(rows: dict[str, dict[str, Any]]) -> str:
    """The ``--pd`` table: per policy, each retraction priced both ways."""
    priced = {name: row for name, row in rows.items() if "pd_retractions" in row}
    if not priced:
        return ""
    a = next(iter(priced.values()))["pd_assumed"]
    lines = [f"--pd (a DeepSeek-V4 PD decode node's retractions): KV {a['full_page_bytes']:,} B a full page + "
             f"{a['swa_page_bytes']:,} B an SWA page over the model's layers; link {a['link_gbps']:g} GB/s, host "
             f"copies {a['host_gbps']:g} GB/s (assumed: --pd-link-gbps / --pd-host-gbps)",
             f"{'policy':<22}{'retractions':>12}{'rebootstrap tok.':>18}{'resent GB':>11}{'rebootstrap s':>15}"
             f"{'parked GB':>11}{'park s':>9}"]
    for name, r in priced.items():
        lines.append(f"{name:<22}{r['pd_retractions']:>12}{r['pd_rebootstrap_recomputed_tokens']:>18,}"
                     f"{r['pd_rebootstrap_sent_gb']:>11}{r['pd_rebootstrap_s_modelled']:>15}"
                     f"{r['pd_parked_gb']:>11}{r['pd_park_s_modelled']:>9}")
    return "\n".join(lines)


LEFT_OUT = ("--pd: the retractions are this replay's (prefill and decode on one pool); a PD decode node's pool "
            "holds no prefill, so its retractions come at other moments: the price per retraction is SGLang's, "
            "the count is the replay's; the prefill peer's own prefix cache is not consulted (the rebootstrap's "
            "recompute is an upper bound); the park's copies run off the scheduler thread (their time is host "
            "bandwidth, not a scheduler stall)")
