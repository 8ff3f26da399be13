"""Source pins: sha256 of every upstream function a switch wraps, for SGLang 0.5.23.

A pin is ``"module:qualname" -> sha256(inspect.getsource(inspect.unwrap(fn)))``. Unwrapping looks
through wrappers (ours, ``functools.wraps`` decorators), so two switches that wrap the same
function both pin the upstream original. ``python -m adapter pins`` prints the installed hashes;
a new pin is added here by hand after reading the function, never generated blindly.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from dataclasses import dataclass

UPSTREAM = {"sglang": "0.5.23", "flashinfer-python": "0.7.2", "torch": "2.14.1"}

PINS: dict[str, str] = {
    # autotune_keep
    "sglang.srt.model_executor.runner.flashinfer_autotune:_autotune_cache_digest": (
        "a45e23d0dd3c93eaf7895cb5051091c2ffffff7c1b1233bdef5168282b7c6c6b"
    ),
    "sglang.srt.model_executor.runner.flashinfer_autotune:flashinfer_autotune_context": (
        "0a4d2304bc899b5e8afec773d7333cd145b0171b30430a0c2b1e7dd7de93ea51"
    ),
    # -- end of pins (add new pins above this line, grouped under a comment naming the switch) --
}


def resolve(target: str) -> object:
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
        found = source_hash(resolve(target))
    except (AttributeError, ImportError, OSError, TypeError) as exc:
        found = f"<unreadable: {type(exc).__name__}: {exc}>"
    return PinCheck(target, expected, found)
