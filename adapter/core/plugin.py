"""The overlay as an SGLang general plugin: the ``sglang.srt.plugins`` entry point ``dsv41``.

SGLang 0.5.23's ``load_plugins`` (``sglang/srt/plugins/__init__.py``) calls :func:`load` once per
process, early in each process it starts (launcher, ``sglang serve``, ``Engine.__init__``, every
scheduler, the detokenizer, the DP controller; docs/plugin.md lists the call sites), when the wheel
is installed and ``SGLANG_PLUGINS`` is unset or names ``dsv41``. :func:`load` does what
``sitecustomize.py`` does: nothing without a ``DSV41_*`` key, else :func:`adapter.core.boot.install`.
The boot installs at once every switch whose upstream modules are already imported (the plugin runs
after them) and leaves its import hook for the modules imported later. A process that loads both ways
installs once: ``install`` is idempotent per process (one ``adapter`` package, one boot state).

Strictness: ``load_plugins`` catches ``Exception`` from a plugin and only logs it, so a
:class:`~adapter.core.errors.BootError` (a bad value, a refusal under ``DSV41_STRICT=1``) would let the
engine boot. :func:`load` turns it into ``SystemExit`` with the overlay's message: not an
``Exception``, so it passes through ``load_plugins``; Python prints the message and exits with status
1 in the launcher, and ``multiprocessing`` does the same in a scheduler or detokenizer (the engine
then stops on a dead child). Under ``DSV41_STRICT=1`` any other exception of the boot (an
``ImportError`` of a switch module, a bug) stops the engine the same way, instead of being logged
by ``load_plugins`` while the engine boots stock; without it, ``load_plugins`` logs it as it logs
any plugin's. That relies on ``load_plugins`` catching ``Exception`` and nothing wider:
:data:`PINNED` pins it; drift is a warning, and a boot failure under ``DSV41_STRICT=1``.
"""

from __future__ import annotations

import os

ENTRY_POINT = "dsv41"  # the name SGLANG_PLUGINS filters on
GROUP = "sglang.srt.plugins"
# What the strictness above relies on: the caller catches ``Exception`` only (pinned, not wrapped).
PINNED: tuple[str, ...] = ("sglang.srt.plugins:load_plugins",)


def _strict() -> bool:
    """``DSV41_STRICT`` as the registry parses it, read from the environment: the failure may come
    before the boot has parsed it. A value that does not parse counts as strict (fail closed)."""
    from adapter.core import env

    try:
        return env.flag()("DSV41_STRICT", os.environ.get("DSV41_STRICT", "0"))
    except env.ConfigError:
        return True


def load() -> None:
    """The entry point. Returns when installed (or nothing asked for); raises ``SystemExit`` when the
    engine must not start."""
    if not any(key.startswith("DSV41_") for key in os.environ):
        return  # like sitecustomize: nothing of the overlay is imported
    from adapter.core import boot, pins, receipts
    from adapter.core.errors import BootError

    try:
        state = boot.install()
        drift = [c.describe() for c in (pins.check(t) for t in PINNED) if not c.ok]
        if drift:
            message = "plugin: a bad value may not stop the boot: " + "; ".join(drift)
            if state.config.strict:
                raise BootError(f"{message} (DSV41_STRICT=1)")
            receipts.warn(message)
    except BootError as exc:
        raise SystemExit(f"{receipts.TAG} {exc}") from exc
    except Exception as exc:
        if not _strict():
            raise  # load_plugins logs it and the engine boots stock, as it does for any plugin
        raise SystemExit(f"{receipts.TAG} the plugin failed under DSV41_STRICT=1: {type(exc).__name__}: {exc}") from exc
    if state.config.errors:  # boot.install logged it; its import-time failure cannot fire here
        raise SystemExit(f"{receipts.TAG} configuration error: " + "; ".join(state.config.errors))
