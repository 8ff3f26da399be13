"""All-or-nothing wrapping of upstream attributes with ``wrapt``.

A switch's install function wraps through a :class:`Patch`; if anything in the install fails,
the boot reverts the patch, so the engine is left exactly on its stock path.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import wrapt

from adapter.core import pins
from adapter.core.errors import Refusal


class UndeclaredTarget(Refusal):
    """A switch tried to wrap a target that its registry record does not list in ``wraps``."""


class Patch:
    def __init__(self, switch: str, allowed: tuple[str, ...] | None = None):
        self.switch = switch
        self.allowed = allowed  # the record's wraps; None: any pinned target (tests of this class)
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, target: str, wrapper: Callable[..., Any]) -> object:
        """Wrap the pinned ``module:qualname`` with ``wrapper(wrapped, instance, args, kwargs)``."""
        if self.allowed is not None and target not in self.allowed:
            raise UndeclaredTarget(f"{self.switch} may not wrap {target}: it is not in the record's wraps")
        module_name, _, qualname = target.partition(":")
        owner_qualname, _, attr = qualname.rpartition(".")
        owner = pins.object_at(f"{module_name}:{owner_qualname}") if owner_qualname else importlib.import_module(module_name)
        # Read the raw attribute (not through the descriptor) so a revert restores it exactly.
        previous = vars(owner)[attr] if attr in vars(owner) else getattr(owner, attr)
        self._undo.append((owner, attr, previous))
        return wrapt.wrap_function_wrapper(owner, attr, wrapper)

    def set_attr(self, owner: object, attr: str, value: object) -> None:
        """Set a plain attribute (e.g. a class default) that the switch needs, revertibly."""
        self._undo.append((owner, attr, getattr(owner, attr, _MISSING)))
        setattr(owner, attr, value)

    def revert(self) -> None:
        while self._undo:
            owner, attr, previous = self._undo.pop()
            if previous is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, previous)


_MISSING = object()
