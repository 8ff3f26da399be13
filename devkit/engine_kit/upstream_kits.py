"""SGLang's own server test kits (shipped in the wheel) run against a kit server: what each gave.

* KL (``sglang.test.kl_multiturn_utils``): a cached path's output logprobs against a fresh replay's
  input logprobs (the helpers flush the cache and prefill the whole sequence), in four flows:
  ``multiturn`` (the plain helper), ``prefill_hit`` (prefixes seeded, then a cache hit at turn 0),
  ``decode_hit`` (branches of one first turn, the next turns interleaved across them) and
  ``decode_hit_swa`` (the same with more and longer prompts than the SWA pool holds). Every helper
  replays its last turn only, so each flow runs once per turn count: every turn is replayed.
  The cache asserts are SGLang's defaults (``default_prefill_cache_assert``,
  ``default_decode_cache_assert`` at the server's page), called and recorded, not raised: cached /
  expected per turn.
* ``cache_hit_kit.run_multiturn_cache_hit_test``: clients in rounds on a local ShareGPT-format file
  (:func:`write_sharegpt`, words of the kit's vocabulary; nothing downloaded). Run with a tolerance
  no round can miss, so every round is measured; the kit's own bound at its default tolerance
  (``(prev_prompt + output - 1) // page * page``) is applied here per client: cached / expected.
* ``radix_cache_server_kit.run_radix_attention_test``: its random radix tree (smaller, token ids
  below the kit's vocabulary) in one batched call; the server must answer 200.
* ``abort_timeout_kit.AbortAllMixin.test_abort_all``: requests aborted with ``abort_all``.
* ``streaming_session_kit.StreamingSessionKitMixin.test_kv_cache_inheritance`` (the boot needs
  ``--enable-streaming-session``).

:func:`run_all` returns one JSON-ready dict; :func:`table` prints stock beside a profile.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import random
import unittest
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KL_THRESHOLD = 1e-3  # upstream's KL tests use per-model thresholds of this order


def _import_test_utils() -> None:
    """``sglang.test.test_utils`` (which every kit imports) reads ``CUDA_VISIBLE_DEVICES[0]`` when it is
    imported, for its test port; the CPU test runner sets it to "" (no GPU), where that raises
    IndexError. Imported once here with "0" in its place, the runner's value put back after."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if saved == "":
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    try:
        importlib.import_module("sglang.test.test_utils")
    finally:
        if saved == "":
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


_import_test_utils()


@dataclass(frozen=True)
class Sizes:
    """A workload's sizes for one kit (page-multiple where the kit's page is large)."""

    vocab: int
    prompt: int  # a first turn's prompt tokens
    suffix: int  # a later turn's new tokens
    out: int  # output tokens per turn
    pressure_prompt: int  # decode_hit_swa: prompts whose sum outruns the SWA pool
    pressure_samples: int
    request_length: int  # cache_hit_kit
    clients: int
    radix_nodes: int
    radix_chunk: int


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(8, vocab) for _ in range(n)]


class _Recorder:
    """Upstream's cache asserts, called per turn and recorded (label, cached, passed)."""

    def __init__(self, page: int):
        from sglang.test import kl_multiturn_utils as kl

        self.rows: list[dict[str, Any]] = []
        self._prefill = kl.default_prefill_cache_assert
        self._decode = functools.partial(kl.default_decode_cache_assert, page_size=page)

    def _record(self, check, result: dict, expected: int, label: str, *args: int) -> None:
        try:
            check(result, *args, label)
            passed = True
        except AssertionError:
            passed = False
        self.rows.append({"label": label, "cached": result["meta_info"]["cached_tokens"], "expected": expected,
                          "passed": passed})

    def prefill(self, result: dict, prefix_len: int, label: str) -> None:
        self._record(self._prefill, result, prefix_len, label, prefix_len)

    def decode(self, result: dict, history_len: int, output_len: int, label: str) -> None:
        self._record(self._decode, result, history_len + output_len, label, history_len, output_len)


@contextlib.contextmanager
def _kl_values():
    """The ``avg_kl_div`` each KL comparison prints (upstream's own figure), collected."""
    from sglang.test import kl_test_utils

    values: list[float] = []

    def capture(*args: Any, **kwargs: Any) -> None:
        text = " ".join(str(a) for a in args)
        if text.startswith("avg_kl_div="):
            values.append(float(text.split("=", 1)[1]))

    kl_test_utils.print = capture  # module global: shadows the builtin for that module only
    try:
        yield values
    finally:
        del kl_test_utils.print


def run_kl(base_url: str, page: int, sizes: Sizes, seed: int = 0) -> dict[str, Any]:
    """The four KL flows, every turn replayed: per flow the KL per turn (None where the helper
    raised), the cache asserts' rows and errors."""
    from sglang.test import kl_multiturn_utils as kl

    rng = random.Random(seed)
    v = sizes.vocab
    firsts = [_ids(rng, sizes.prompt, v) for _ in range(4)]
    suffixes = [[_ids(rng, sizes.suffix, v) for _ in range(4)] for _ in range(3)]
    prefixes = [firsts[0][: sizes.prompt // 2]] * 2 + [firsts[1][: sizes.prompt // 2]] * 2
    fulls = [p + _ids(rng, sizes.suffix, v) for p in prefixes]
    branches = [firsts[0], firsts[0], firsts[1], firsts[1]]  # two groups of two branches
    heavy = [_ids(rng, sizes.pressure_prompt, v) for _ in range(sizes.pressure_samples)]
    heavy_suffixes = [[_ids(rng, sizes.suffix, v) for _ in heavy] for _ in range(2)]
    common = {"max_new_tokens": sizes.out, "kl_threshold": KL_THRESHOLD, "model_name": "kit"}
    flows = {
        "multiturn": [functools.partial(kl.test_input_output_logprobs_match_helper, input_ids=firsts,
                                        turn_suffixes=suffixes[:k] or None) for k in range(3)],
        "prefill_hit": [functools.partial(kl.test_input_output_logprobs_match_prefill_cache_hit_helper,
                                          prefix_input_ids=prefixes, full_input_ids=fulls,
                                          turn_suffixes=suffixes[:k] or None) for k in range(3)],
        "decode_hit": [functools.partial(kl.test_input_output_logprobs_match_decode_cache_hit_helper,
                                         first_turn_input_ids=branches, turn_suffixes=suffixes[:k],
                                         branches_per_group=2) for k in range(1, 4)],
        "decode_hit_swa": [functools.partial(kl.test_input_output_logprobs_match_decode_cache_hit_helper,
                                             first_turn_input_ids=heavy, turn_suffixes=heavy_suffixes[:k])
                           for k in range(1, 3)],
    }
    out: dict[str, Any] = {}
    for name, runs in flows.items():
        rec = _Recorder(page)
        kls, errors = [], []
        for run in runs:
            asserts = {"assert_decode_cached_tokens": rec.decode}
            if name == "prefill_hit":
                asserts["assert_prefill_cached_tokens"] = rec.prefill
            if name == "multiturn":
                asserts = {"assert_decode_cached_tokens": rec.decode} if run.keywords["turn_suffixes"] else {}
            with _kl_values() as values:
                try:
                    run(base_url, label=f"{name}[{len(kls)}]", **common, **asserts)
                except AssertionError as exc:
                    errors.append(str(exc).splitlines()[0])
            kls.append(values[-1] if values else None)
        out[name] = {"kl": kls, "cache": _dedup_last(rec.rows), "errors": errors}
    return out


def _dedup_last(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each (turn, sample) label once: the run with the most turns repeats the earlier turns."""
    seen: dict[str, dict[str, Any]] = {}
    for r in rows:
        seen[r["label"].split("]", 1)[1]] = r
    return list(seen.values())


def write_sharegpt(path: Path, words: list[str], conversations: int = 64, seed: int = 0) -> Path:
    """A ShareGPT-format file (human/gpt turns) of ``words``: what ``sample_random_requests`` reads."""
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    rows = [{"id": str(i), "conversations": [{"from": "human", "value": text(rng.randrange(40, 120))},
                                             {"from": "gpt", "value": text(rng.randrange(20, 60))}]}
            for i in range(conversations)]
    path.write_text(json.dumps(rows))
    return path


def run_cache_hit(base_url: str, model_path: str, dataset: Path, page: int, sizes: Sizes) -> dict[str, Any]:
    """``run_multiturn_cache_hit_test`` with every round measured: per round cached / expected
    (the kit's bound at its default tolerance of 1) and the clients under it."""
    from sglang.test.kits import cache_hit_kit

    lines: list[str] = []
    cache_hit_kit.print = lambda *a, **k: lines.append(" ".join(str(x) for x in a))
    try:
        cache_hit_kit.run_multiturn_cache_hit_test(base_url, model_path, num_clients=sizes.clients, num_rounds=3,
                                                  request_length=sizes.request_length, output_length=sizes.out,
                                                  miss_tolerance=10**9, dataset_path=str(dataset))
    finally:
        del cache_hit_kit.print
    rounds: dict[int, dict[str, int]] = {}
    for line in lines:
        if not line.startswith("Round ") or "cached_tokens=" not in line:
            continue
        r = int(line.split()[1].rstrip(","))
        fields = dict(f.split("=") for f in line.replace("(", " ").replace(")", " ").replace(",", " ").split()
                      if "=" in f)
        cached, prev = int(fields["cached_tokens"]), int(fields["prev_prompt"])
        expected = 0 if r == 0 else (prev + int(fields["output"]) - 1) // page * page
        row = rounds.setdefault(r, {"cached": 0, "expected": 0, "clients_under": 0})
        row["cached"] += cached
        row["expected"] += expected
        row["clients_under"] += cached < expected
    return {"rounds": rounds, "passed": all(r["clients_under"] == 0 for r in rounds.values())}


def run_radix(base_url: str, sizes: Sizes, seed: int = 0) -> dict[str, Any]:
    """``run_radix_attention_test`` on a smaller tree with token ids below the kit's vocabulary."""
    from sglang.test.kits import radix_cache_server_kit as kit

    rng = random.Random(seed)
    low = type("Rng", (), {"randint": staticmethod(lambda a, b: rng.randint(a, min(b, sizes.vocab - 1))),
                           "choice": staticmethod(rng.choice), "shuffle": staticmethod(rng.shuffle)})
    real_gen, real_random = kit.gen_radix_tree, kit.random
    kit.random = low
    kit.gen_radix_tree = functools.partial(real_gen, num_nodes=sizes.radix_nodes, chunk_len=sizes.radix_chunk)
    try:
        kit.run_radix_attention_test(base_url)
        return {"passed": True}
    except AssertionError as exc:
        return {"passed": False, "error": str(exc)}
    finally:
        kit.gen_radix_tree, kit.random = real_gen, real_random


def _unittest_case(mixin: type, method: str, **attrs: Any) -> dict[str, Any]:
    """One ``test_*`` method of an upstream kit mixin, as its fixture would run it."""
    case_type = type("KitCase", (mixin, unittest.TestCase), dict(attrs))
    result = unittest.TestResult()
    case_type(method).run(result)
    problems = [str(err).splitlines()[-1] for _, err in result.failures + result.errors]
    return {"passed": result.wasSuccessful(), "errors": problems}


def run_abort_all(base_url: str, process: Any, requests: int = 8, max_new_tokens: int = 4000) -> dict[str, Any]:
    from sglang.test.kits.abort_timeout_kit import AbortAllMixin

    return _unittest_case(AbortAllMixin, "test_abort_all", base_url=base_url, process=process,
                          abort_all_num_requests=requests, abort_all_max_new_tokens=max_new_tokens)


def run_streaming_session(base_url: str, tokenizer: Any) -> dict[str, Any]:
    from sglang.test.kits.streaming_session_kit import StreamingSessionKitMixin

    return _unittest_case(StreamingSessionKitMixin, "test_kv_cache_inheritance", base_url=base_url,
                          tokenizer=tokenizer)


def table(results: dict[str, dict[str, Any]]) -> str:
    """Stock beside each profile: KL per flow (max over turns), cached / expected, pass or fail."""
    names = list(results)
    lines = ["check".ljust(34) + "".join(n.ljust(34) for n in names)]

    def cell(value: Any) -> str:
        return str(value)[:33].ljust(34)

    first = results[names[0]]
    for flow in first["kl"]:
        kls = {n: results[n]["kl"][flow]["kl"] for n in names}
        lines.append(f"KL {flow} (max over turns)".ljust(34) + "".join(
            cell(f"{max((k for k in kls[n] if k is not None), default=float('nan')):.2e}"
                 f" {'pass' if all(k is not None and k < KL_THRESHOLD for k in kls[n]) else 'FAIL'}") for n in names))
        cache = {n: results[n]["kl"][flow]["cache"] for n in names}
        if cache[names[0]]:
            lines.append(f"  cached / expected ({flow})".ljust(34) + "".join(
                cell(f"{sum(r['cached'] for r in cache[n])} / {sum(r['expected'] for r in cache[n])}"
                     f" {sum(r['passed'] for r in cache[n])}/{len(cache[n])} ok") for n in names))
    for r in first["cache_hit"]["rounds"]:
        lines.append(f"cache_hit_kit round {r} cached/expected".ljust(34) + "".join(
            cell(f"{results[n]['cache_hit']['rounds'][r]['cached']} / {results[n]['cache_hit']['rounds'][r]['expected']}"
                 f" ({results[n]['cache_hit']['rounds'][r]['clients_under']} under)") for n in names))
    for check in ("radix", "abort_all", "streaming_session"):
        if check in first:
            lines.append(check.ljust(34) + "".join(cell("pass" if results[n][check]["passed"] else "FAIL")
                                                   for n in names))
    return "\n".join(lines)
