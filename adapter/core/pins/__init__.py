"""Source pins: sha256 of every upstream function a switch wraps, for SGLang 0.5.23.

A pin is ``"module:qualname" -> sha256(inspect.getsource(inspect.unwrap(fn)))``. Unwrapping looks
through wrappers (ours, ``functools.wraps`` decorators), so two switches that wrap the same
function both pin the upstream original. ``python -m adapter pins`` prints the installed hashes;
the table itself is data, one module per pinned SGLang release (``sglang_0_5_23``).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from dataclasses import dataclass

# The table for the pinned release (one data module per SGLang release; moving to a new release
# adds a module and switches this import: docs/operating.md, "Moving to a new SGLang release").
from adapter.core.pins.sglang_0_5_23 import PINS, UPSTREAM

__all__ = ["PINS", "UPSTREAM", "PinCheck", "check", "drifted", "object_at", "source_hash"]

def object_at(target: str) -> object:
    """The object at ``module:qualname`` as the module holds it now (possibly wrapped)."""
    module_name, _, qualname = target.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def source_hash(fn: object) -> str:
    original = inspect.unwrap(fn)  # type: ignore[arg-type]
    original = getattr(original, "__func__", original)  # classmethod / bound method
    return hashlib.sha256(inspect.getsource(original).encode()).hexdigest()


@dataclass(frozen=True)
class PinCheck:
    target: str
    expected: str
    found: str

    @property
    def ok(self) -> bool:
        return bool(self.expected) and self.expected == self.found

    def describe(self) -> str:
        return f"{self.target} drifted from the pin: expected {self.expected[:16]}, found {self.found[:16]}"


def check(target: str, pins: dict[str, str] | None = None) -> PinCheck:
    table = PINS if pins is None else pins
    expected = table.get(target, "")
    try:
        found = source_hash(object_at(target))
    except (AttributeError, ImportError, OSError, TypeError) as exc:
        found = f"<unreadable: {type(exc).__name__}: {exc}>"
    return PinCheck(target, expected, found)


def drifted(pins: dict[str, str], prefix: str = "") -> list[str]:
    """What :meth:`PinCheck.describe` says of each target in ``pins`` (those starting with ``prefix``)
    whose installed source no longer matches its pin: empty when every one holds."""
    return [c.describe() for c in (check(t, pins) for t in pins if t.startswith(prefix)) if not c.ok]
