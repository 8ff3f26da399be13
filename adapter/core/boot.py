"""The import hook: after a target upstream module is imported, install the switches that wait on it.

``install_from_environment`` (called by ``sitecustomize.py`` only when a ``DSV41_*`` key is set)
parses the configuration and puts one meta-path finder in front of ``sys.meta_path``. The finder
claims nothing but the target modules named in the registry; for those it wraps the real loader so
that, once the module has executed, each switch whose target modules are all imported is installed
in registry order. Modules imported before the finder existed are handled at once.

Failure rules:
* A bad value is a boot failure. An exception inside ``sitecustomize`` does not stop Python, so
  the error is printed at once and the finder makes the engine's first ``sglang`` import raise
  :class:`BootError`: the engine cannot start on a configuration it cannot honour.
* A switch that cannot install (pin drift, unsupported mode) is refused with one line and the
  engine keeps its stock functions; with ``DSV41_STRICT=1`` the refusal raises :class:`BootError`
  from the import that triggered it.

Ranks: switches installed at import log ``rank=pid<PID>`` (a scheduler imports them before SGLang
publishes its rank). The finder also waits on the scheduler module (``registry.RANK_MODULE``) and
wraps ``configure_scheduler_process`` (``registry.RANK_HOOK``, pinned; SGLang calls it right after
``publish``): when it returns, :func:`announce_rank` logs each switch's decision so far once more
under the scheduler's ``tp<N>`` rank, which is what ``receipts --ranks N`` and the release gate count.
Drift of its pins leaves the hook off with one warning (``receipts`` then fails: no ``tp`` lines);
under ``DSV41_STRICT=1`` it is a boot failure.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from adapter.core import receipts, registry
from adapter.core.api import BootError, NotApplicable, Refusal, SwitchContext, unbind_all

__all__ = ["STATE", "BootError", "NotApplicable", "Outcome", "Refusal", "State", "announce_rank", "install",
           "install_rank_hook", "install_switch", "record_decision", "uninstall"]

if TYPE_CHECKING:  # imported lazily: a process that installs nothing never loads wrapt or inspect
    from adapter.core import patching, pins

ENGINE_PACKAGE = "sglang"


@dataclass
class Outcome:
    switch: str
    status: str = "pending"  # pending | armed | installed | refused | n/a (refused: not applicable here)
    reason: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    pins: list[pins.PinCheck] = field(default_factory=list)


@dataclass
class State:
    config: registry.Config
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    patches: dict[str, patching.Patch] = field(default_factory=dict)
    rank_hook: str = ""  # "" until the scheduler module is imported, then "installed" or "off: <why>"


STATE: State | None = None


class _LoaderProxy:
    """Delegates to the real loader; runs the hook after the module has executed."""

    def __init__(self, loader: Any, finder: SwitchFinder):
        self._loader = loader
        self._finder = finder

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._finder.on_imported(module.__name__)

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, is_package, ...
        return getattr(self._loader, name)


class SwitchFinder:
    def __init__(self, state: State, targets: set[str], fail_with: str | None = None):
        self.state = state
        self.targets = targets
        self.fail_with = fail_with

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if self.fail_with is not None and fullname.partition(".")[0] == ENGINE_PACKAGE:
            raise BootError(self.fail_with)
        if fullname not in self.targets:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _LoaderProxy(spec.loader, self)
                return spec
        return None

    def on_imported(self, module_name: str) -> None:
        for switch in self.state.config.requested:
            outcome = self.state.outcomes[switch.name]
            if outcome.status == "pending" and all(_executed(m, module_name) for m in switch.modules):
                install_switch(self.state, switch)
        if not self.state.rank_hook and _executed(registry.RANK_MODULE, module_name):
            install_rank_hook(self.state)


def _executed(name: str, just_executed: str) -> bool:
    """``name`` is imported and its body has run. A module mid-import is already in ``sys.modules``
    (``__spec__._initializing``) when it imports another target: installing then would find its
    classes missing. ``just_executed`` is the module whose body just finished (still flagged)."""
    module = sys.modules.get(name)
    if module is None:
        return False
    return name == just_executed or not getattr(getattr(module, "__spec__", None), "_initializing", False)


def record_decision(state: State | None, switch: str, status: str, reason: str = "", revert: bool = False) -> None:
    """Record what a switch decided after install (``installed`` or ``refused``; its context logs
    the receipt and applies strict). With ``revert`` the switch's wrappers come off, so the engine
    runs stock from here on. A refusal is final: a later ``installed`` does not undo it."""
    if state is None:
        return
    if revert and switch in state.patches:
        state.patches.pop(switch).revert()
    outcome = state.outcomes.get(switch)
    if outcome is not None and outcome.status != "refused":
        outcome.status, outcome.reason = status, reason


def install_switch(state: State, switch: registry.Switch) -> Outcome:
    """Check pins, then install; on any failure revert and refuse (raise under strict)."""
    from adapter.core import patching, pins

    outcome = state.outcomes.setdefault(switch.name, Outcome(switch.name))
    outcome.pins = [pins.check(target) for target in switch.pinned]
    drift = [p for p in outcome.pins if not p.ok]
    patch = patching.Patch(switch.name, allowed=switch.wraps)
    ctx = SwitchContext(switch, state.config, patch, lambda status, reason, revert: record_decision(STATE, switch.name, status, reason, revert))
    try:
        if drift:
            raise Refusal("; ".join(p.describe() for p in drift))
        module_name, _, function = switch.install.partition(":")
        install = getattr(importlib.import_module(module_name), function)
        outcome.params = dict(install(ctx) or {})
    except Exception as exc:  # a refusal, or a bug in an install: never half-installed
        patch.revert()
        outcome.status = "n/a" if isinstance(exc, NotApplicable) else "refused"
        outcome.reason = str(exc) if isinstance(exc, Refusal) else f"install failed: {type(exc).__name__}: {exc}"
        if isinstance(exc, NotApplicable):
            outcome.reason = f"not applicable here: {outcome.reason}"
        receipts.refused(switch.name, outcome.reason)
        if state.config.strict:
            raise BootError(f"{switch.name} refused under DSV41_STRICT=1: {outcome.reason}") from exc
        return outcome
    state.patches[switch.name] = patch
    if ctx.deferred:  # the engine decides later (e.g. at cache build): installed or refused then
        if outcome.status == "pending":
            outcome.status = "armed"
        receipts.event(switch.name, "armed", **outcome.params)
        return outcome
    outcome.status = "installed"
    receipts.installed(switch.name, **outcome.params)
    return outcome


RANK_PATCH = "(boot rank hook)"  # its key in State.patches: no switch has this name


def install_rank_hook(state: State) -> None:
    """Wrap ``registry.RANK_HOOK`` so that each scheduler announces its rank (see the module doc)."""
    from adapter.core import patching, pins

    drift = [c for c in (pins.check(t) for t in registry.BOOT_PINNED) if not c.ok]
    if drift:
        state.rank_hook = "off: " + "; ".join(c.describe() for c in drift)
        receipts.warn("rank hook off, receipts of switches installed at import name only the process id: "
                      + state.rank_hook[5:])
        if state.config.strict:
            raise BootError(f"the boot's rank hook is off under DSV41_STRICT=1: {state.rank_hook[5:]}")
        return
    patch = patching.Patch(RANK_PATCH, allowed=(registry.RANK_HOOK,))
    patch.wrap(registry.RANK_HOOK, _after_rank_published)
    state.patches[RANK_PATCH] = patch
    state.rank_hook = "installed"


def _after_rank_published(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    try:
        announce_rank(STATE)
    except Exception as exc:  # pragma: no cover - defensive: a receipt never stops a scheduler
        receipts.warn(f"rank announcement failed: {type(exc).__name__}: {exc}")
    return result


def announce_rank(state: State | None) -> None:
    """Once the engine has published this process's rank: log every switch decided so far (installed,
    refused or armed, in registry order) once more under that rank. Pending switches log their own
    receipt later, under the rank. Nothing when no rank is published (not a scheduler)."""
    if state is None or not receipts.is_engine_rank(receipts.current_rank()):
        return
    for switch in state.config.requested:
        outcome = state.outcomes.get(switch.name)
        if outcome is None:
            continue
        if outcome.status == "installed":
            receipts.installed(switch.name, **outcome.params)
        elif outcome.status in ("refused", "n/a"):
            receipts.refused(switch.name, outcome.reason)
        elif outcome.status == "armed":
            receipts.event(switch.name, "armed", **outcome.params)


def install(environ: Mapping[str, str] | None = None) -> State:
    """Parse ``environ`` (default ``os.environ``) and install the finder. Idempotent per process."""
    global STATE
    if STATE is not None:
        return STATE
    config = registry.resolve(os.environ if environ is None else environ)
    STATE = state = State(config)
    for warning in config.warnings:
        receipts.warn(warning)
    if config.errors:
        message = "configuration error: " + "; ".join(config.errors)
        receipts.logger().error("%s %s", receipts.TAG, message)
        sys.meta_path.insert(0, SwitchFinder(state, set(), fail_with=message))
        return state
    for switch in config.requested:
        state.outcomes[switch.name] = Outcome(switch.name)
    targets = {m for s in config.requested for m in s.modules}
    if config.requested:
        targets.add(registry.RANK_MODULE)  # the rank hook (install_rank_hook)
    finder = SwitchFinder(state, targets)
    sys.meta_path.insert(0, finder)
    if any(m in sys.modules for m in targets):  # imported before us (rare): handle now
        finder.on_imported("")
    return state


def install_from_environment() -> None:
    """The ``sitecustomize`` entry: never lets an overlay bug stop a process that is not the engine."""
    try:
        install()
    except BootError:
        raise
    except Exception as exc:  # pragma: no cover - defensive: report, stay stock
        receipts.warn(f"overlay boot failed, engine stays stock: {type(exc).__name__}: {exc}")


def uninstall() -> None:
    """Remove the finder and revert every installed switch (tests and ``check``)."""
    global STATE
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, SwitchFinder)]
    if STATE is not None:
        for patch in reversed(list(STATE.patches.values())):  # last installed is outermost
            patch.revert()
    STATE = None
    unbind_all()
    receipts.reset_for_tests()
