"""The overlay's exceptions: what a switch may raise at install, and what stops a boot.

Their own module so that :mod:`adapter.core.api` (what a switch imports) and
:mod:`adapter.core.patching` (what wraps) both import them without importing each other.
"""

from __future__ import annotations


class BootError(RuntimeError):
    """The engine must not start: bad configuration, or a refusal under ``DSV41_STRICT=1``."""


class Refusal(Exception):
    """Raised by a switch's install function: the switch cannot act here (one-line reason)."""


class NotApplicable(Refusal):
    """A refusal because this machine or model cannot use the switch (e.g. no CUDA device).

    A boot logs it as a refusal like any other; ``check`` on a build machine reports it as ``n/a``
    instead of a failure, since the profile itself is fine.
    """
