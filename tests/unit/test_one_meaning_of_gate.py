"""In the serving code "gate" means the release gate alone (``python -m adapter gate``,
``devkit/gate/``, a record's ``gate_role``). KV parking's CUDA-graph exclusion is the capture lock and
page-rounded admission's never-fits bound is the clip. The one other use left mirrors upstream's
names (``gates_prefix_match``, so cone replay's ``swa_gates_match``); docs/contributing.md ("Words")
says why. The DeepSeek-V4 MoE ``gate`` weights (checkpoint tensor names) live in devkit, not here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVING = [*sorted((ROOT / "adapter").rglob("*.py")), ROOT / "sitecustomize.py"]

# Taken out before the scan: the release gate and its CLI command, and upstream's SWA field as
# cone replay mirrors it (a name, or in words: "does not gate prefix matches").
ALLOWED = re.compile(
    r'release gate|gate_role|GateRole|devkit[./]gate|adapter gate|"gate"'
    r"|gates_prefix_match|swa_gates_match|swa_not_gating"
    r"|gates?[\s#]+(?:the[\s#]+)?(?:prefix[\s#]+)?match"
)
# The word or a part of a name (CaptureGate, GATE, _gate, gated_capture_begin), never the letters
# inside another word (propagate, delegates).
GATE_WORD = re.compile(
    r"(?:(?<![A-Za-z])[Gg]|(?<=[a-z0-9])G)at(?:e|es|ed|ing)(?![a-z])|(?<![A-Za-z])GAT(?:E|ES|ED|ING)(?![A-Z])"
)


def other_meanings(text: str) -> list[tuple[int, str]]:
    """``(line number, word)`` of each "gate" left once the allowed phrases are taken out."""
    kept = ALLOWED.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)  # same offsets, same lines
    return [(kept.count("\n", 0, m.start()) + 1, m.group()) for m in GATE_WORD.finditer(kept)]


def test_serving_modules_use_gate_only_for_the_release_gate_or_upstreams_names():
    found = []
    for path in SERVING:
        lines = path.read_text().splitlines()
        for number, word in other_meanings(path.read_text()):
            found.append(f"{path.relative_to(ROOT)}:{number}: {word!r} in {lines[number - 1].strip()[:100]}")
    assert found == [], "another meaning of 'gate' (name it for what it does, or see docs/contributing.md Words)"


def test_the_scan_finds_other_meanings_but_not_the_release_gate_upstreams_names_or_longer_words():
    for other in ("class CaptureGate:", "GATE = CaptureGate()", "def _gate(wrapped):", "gated_capture_begin",
                  "the never-fits gate", "env-gated wrappers", "GATED_MODES", "a gate key"):
        assert other_meanings(other), other
    for allowed in ("s.gate_role", "GateRole(acts=...)", "the release gate's row", "python -m adapter gate",
                    '("gate", "devkit.gate", ...)', "swa_gates_match=True", "c.gates_prefix_match",
                    "reason swa_not_gating", "does not gate prefix matches", "does not gate the\n    # match",
                    "logger.propagate = False", "Delegates to the loader", "aggregate", "navigated", "gateway"):
        assert other_meanings(allowed) == [], allowed
