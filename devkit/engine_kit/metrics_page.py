"""A kit server's ``/metrics`` page (SGLang's ``--enable-metrics``): the summed value of each named
counter over its label sets, read with prometheus_client's own text parser."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable


def counter_sums(text: str, names: Iterable[str]) -> dict[str, float]:
    """Each of ``names`` (a counter's sample name, ``_total`` included) summed over its label sets
    (SGLang labels every scheduler's series); 0.0 for a counter the page does not carry (a switch
    that never counted is never registered)."""
    from prometheus_client.parser import text_string_to_metric_families

    sums = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
    return sums


def read_counters(base_url: str, names: Iterable[str], timeout_s: float = 30.0) -> dict[str, float]:
    """:func:`counter_sums` of the server's page now."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=timeout_s) as response:
        return counter_sums(response.read().decode(), names)
