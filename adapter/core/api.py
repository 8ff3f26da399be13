"""What a switch may use of the core: its context, and the two refusals it can raise.

A switch module imports this module and nothing else of ``adapter.core`` (an import-linter
contract in ``pyproject.toml``). Its ``install(ctx)`` gets a :class:`SwitchContext` built from its
registry record, so the switch restates none of what the record says: its name, keys, option
values and the targets it may wrap all come from ``ctx``.

* ``ctx.wrap(target, wrapper)`` wraps a target of the record's ``wraps``; a target the record
  does not list is refused (a switch cannot wrap what is not pinned and declared).
* ``ctx.event(...)`` logs a ``[dsv41] <name> <what> ...`` line; ``ctx.refuse_late(reason)`` refuses
  the switch after install (when the engine only decides later, e.g. at cache build).
* ``ctx.tally(what, ...)`` counts an event in the metrics without logging it (``adapter.core.metrics``);
  ``api.metrics_on()`` says whether this process exports them.
* ``ctx.decide_later()`` says that the install receipt waits for such a decision: the boot logs
  ``armed`` at import, then the switch logs ``installed`` (``ctx.confirm``) or ``refused``.

Why a :class:`SwitchHandle` beside the context: the two live at different times. A
``SwitchContext`` exists from ``install(ctx)`` on and holds what only the boot has (the parsed
configuration, the switch's patch: ``wrap``, ``set_attr``, ``option``). A switch module's code
also runs where no boot installed it (the cache-build and scheduler hooks after an uninstall,
unit tests calling its helpers, ``check``'s predictors), so it holds ``api.handle(__name__)`` from
import: its record, its log lines and metrics, and once ``install`` binds a context, strict mode
and the recorded outcome through it. One merged object would carry methods that fail before
install; the handle has none.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from adapter.core import metrics, receipts
from adapter.core.env import ConfigError
from adapter.core.errors import BootError, NotApplicable, Refusal

__all__ = [
    "BootError",
    "ConfigError",
    "ModelFacts",
    "NotApplicable",
    "Prediction",
    "Profile",
    "Refusal",
    "SwitchContext",
    "SwitchHandle",
    "handle",
    "metrics_on",
]


metrics_on = metrics.metrics_on
"""``api.metrics_on()``: this process exports the switches' Prometheus metrics (SGLang's
``--enable-metrics``). An event site whose line is skipped unless DEBUG (``if debug or
api.metrics_on()``) emits it anyway, since the metrics count the events; one attribute test once
the engine has published its configuration."""

if TYPE_CHECKING:
    from adapter.core import patching, registry


@dataclass(frozen=True)
class ModelFacts:
    """What a model's ``config.json`` says about the pools its cache will be built on (``check``)."""

    path: str
    architecture: str
    pool: str  # DeepSeekV4TokenToKVPool | SWAKVPool | none (no sliding-window layers)
    window: int | None = None  # the cache's sliding window (tokens), as SGLang derives it
    swa_layers: int | None = None
    layers: int | None = None
    compress_ratios: tuple[int, ...] = ()
    model_type: str = ""
    kv_sources: tuple[int, ...] = ()  # DeepSeek-V4.1's kv_source_layer_ids


@dataclass(frozen=True)
class Profile:
    """What ``python -m adapter check`` knows of a boot before it happens, handed to a switch's
    predictor (its registry record's ``predict``)."""

    environ: Mapping[str, str]  # the profile's environment (DSV41_* and engine variables)
    values: Mapping[str, Any]  # every parsed DSV41_* value, defaults filled in
    argv: tuple[str, ...]  # the launch line's words (``LAUNCH_ARGS``)
    server_args: Any  # SGLang's parsed ``ServerArgs`` namespace of the launch line; None without one
    model: ModelFacts | None  # None: no model folder to read
    status: str  # the switch's install outcome in check's process: installed | armed | refused | n/a
    installed: Mapping[str, Any] = field(default_factory=dict)  # its install receipt's key=value fields


@dataclass(frozen=True)
class Prediction:
    """A switch's predictor's answer: the receipt a boot would log when it is decided after
    install (None: the install outcome is the receipt), its facts, and warnings about a profile
    that works but not as its author likely meant."""

    receipt: str | None = None  # installed | refused: <reason> | not decided (<why>)
    params: Mapping[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # what an operator should know of the boot (e.g. which mode runs)


class SwitchContext:
    """One switch's view of its registry record, its configuration and its patch."""

    def __init__(self, switch: registry.Switch, config: registry.Config, patch: patching.Patch,
                 on_decision: Callable[[str, str, bool], None] = lambda status, reason, revert: None):
        self._switch = switch
        self._config = config
        self._patch = patch
        self._on_decision = on_decision  # (status, reason, revert): the boot records the outcome
        self.deferred = False

    # -- what the record says
    @property
    def name(self) -> str:
        return self._switch.name

    @property
    def value(self) -> Any:
        """The parsed value of the switch key (e.g. the decode-yield percent)."""
        return self._config.values[self._switch.on_key.name]

    @property
    def options(self) -> Mapping[str, Any]:
        """The parsed values of the switch's keys (the switch key and options; defaults filled in)."""
        return {k.name: self._config.values[k.name] for k in self._switch.keys if k.name in self._config.values}

    def option(self, key: str) -> Any:
        """The parsed value of one of the record's keys (None when unset and without default)."""
        if key not in {k.name for k in self._switch.keys}:
            raise KeyError(f"{key} is not a key of {self.name}'s registry record")
        return self._config.values.get(key)

    @property
    def values(self) -> Mapping[str, Any]:
        """Every parsed ``DSV41_*`` value of the process (read-only)."""
        return dict(self._config.values)

    @property
    def strict(self) -> bool:
        return self._config.strict

    @property
    def debug(self) -> bool:
        return receipts.logger().isEnabledFor(logging.DEBUG)

    def volatile_keys(self) -> frozenset[str]:
        """Keys every switch's record declares volatile (they change no tuned shape or kernel)."""
        from adapter.core import registry

        return registry.volatile_keys()

    def target(self, name: str) -> str:
        """The record's ``module:qualname`` for ``name`` (a full target, or its unique qualname tail)."""
        return self._switch.target(name)

    # -- what the switch does
    def wrap(self, target: str, wrapper: Callable[..., Any]) -> object:
        """Wrap one of the record's ``wraps`` with ``wrapper(wrapped, instance, args, kwargs)``."""
        try:
            full = self._switch.target(target)
        except KeyError:
            raise Refusal(f"{target} is not in {self.name}'s registry record (wraps)") from None
        if full not in self._switch.wraps:
            raise Refusal(f"{full} is pinned as relied on, not wrapped, in {self.name}'s registry record")
        return self._patch.wrap(full, wrapper)

    def set_attr(self, owner: object, attr: str, value: object) -> None:
        """Set a plain attribute the switch needs (a class default, an environment variable), revertibly."""
        self._patch.set_attr(owner, attr, value)

    def event(self, what: str, *, level: int = logging.INFO, **params: object) -> None:
        receipts.event(self.name, what, level=level, **params)

    def warn(self, message: str) -> None:
        receipts.warn(f"{self.name} {message}")

    def tally(self, what: str, **params: object) -> None:
        """Count one more ``what`` event in the metrics without a log line (a line logged only the
        first time); a no-op unless metrics are on."""
        metrics.tally(self.name, what, **params)

    def decide_later(self) -> None:
        """The receipt waits for the engine: log ``armed`` now, ``installed`` or ``refused`` later."""
        self.deferred = True

    def confirm(self, **params: object) -> None:
        """The engine's decision was to act: log the ``installed`` receipt (once per process)."""
        self._on_decision("installed", "", False)
        receipts.installed(self.name, **params)

    def refuse_late(self, reason: str, *, revert: bool = False) -> None:
        """Refuse after install: one ``refused`` line, the outcome recorded (and with ``revert`` every
        wrapper of the switch removed, back to stock); a boot failure under strict."""
        receipts.refused(self.name, reason)
        self._on_decision("refused", reason, revert)
        if self.strict:
            raise BootError(f"{self.name} refused under DSV41_STRICT=1: {reason}")


def _segment(module: str) -> str:
    """``adapter.switches.<segment>[.<rest>]`` -> ``<segment>`` (a switch's module or package)."""
    prefix = "adapter.switches."
    if not module.startswith(prefix):
        raise ValueError(f"{module} is not a switch module (expected {prefix}<switch>...)")
    return module[len(prefix):].split(".", 1)[0]


class SwitchHandle:
    """A switch module's handle on its own registry record, usable before and after install.

    ``handle(__name__)`` at module level: the record is the one whose install function lives in
    the same ``adapter.switches.<segment>`` module or package, so the module never restates its
    name. After install the handle forwards to the live :class:`SwitchContext` (strict mode, the
    recorded outcome); before it (unit tests call a switch's helpers directly) it still logs.
    """

    def __init__(self, module: str):
        self._segment = _segment(module)
        self._ctx: SwitchContext | None = None
        self._record: registry.Switch | None = None

    @property
    def record(self) -> registry.Switch:
        if self._record is None:
            from adapter.core import registry

            found = [s for s in registry.SWITCHES if _segment(s.install.partition(":")[0]) == self._segment]
            if len(found) != 1:
                raise LookupError(f"adapter.switches.{self._segment} is the install module of {len(found)} records")
            self._record = found[0]
        return self._record

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def ctx(self) -> SwitchContext | None:
        return self._ctx

    def bind(self, ctx: SwitchContext) -> SwitchContext:
        """Called by ``install(ctx)``: later events and refusals go through the live context."""
        self._ctx = ctx
        return ctx

    @property
    def debug(self) -> bool:
        return receipts.logger().isEnabledFor(logging.DEBUG)

    def target(self, name: str) -> str:
        return self.record.target(name)

    def module_of(self, name: str) -> str:
        """The upstream module of the pinned target ``name``."""
        return self.record.target(name).partition(":")[0]

    def volatile_keys(self) -> frozenset[str]:
        from adapter.core import registry

        return registry.volatile_keys()

    def event(self, what: str, *, level: int = logging.INFO, **params: object) -> None:
        receipts.event(self.name, what, level=level, **params)

    def warn(self, message: str) -> None:
        receipts.warn(f"{self.name} {message}")

    def tally(self, what: str, **params: object) -> None:
        metrics.tally(self.name, what, **params)

    def confirm(self, **params: object) -> None:
        if self._ctx is not None:
            self._ctx.confirm(**params)
        else:
            receipts.installed(self.name, **params)

    def refuse_late(self, reason: str, *, revert: bool = False) -> None:
        if self._ctx is not None:
            self._ctx.refuse_late(reason, revert=revert)
        else:
            receipts.refused(self.name, reason)


_HANDLES: dict[str, SwitchHandle] = {}


def handle(module: str) -> SwitchHandle:
    """The handle of the switch that ``module`` (a module of ``adapter.switches``) belongs to; one
    per switch, shared by every module of a switch package."""
    return _HANDLES.setdefault(_segment(module), SwitchHandle(module))


def unbind_all() -> None:
    """Forget the live contexts (the boot's uninstall: tests and ``check``)."""
    for switch_handle in _HANDLES.values():
        switch_handle._ctx = None
