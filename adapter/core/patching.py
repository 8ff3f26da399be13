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


class Patch:
    def __init__(self, switch: str):
        self.switch = switch
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, target: str, wrapper: Callable[..., Any]) -> object:
        """Wrap the pinned ``module:qualname`` with ``wrapper(wrapped, instance, args, kwargs)``."""
        module_name, _, qualname = target.partition(":")
        owner_qualname, _, attr = qualname.rpartition(".")
        owner = pins.resolve(f"{module_name}:{owner_qualname}") if owner_qualname else importlib.import_module(module_name)
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
