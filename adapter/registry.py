"""The switch registry: the one table that says which switch wraps which upstream function.

Each :class:`Switch` names its gate key (and option keys) with their parsers, the upstream
modules that must be imported before it installs, the pinned ``module:qualname`` functions it
wraps, its install function, whether its keys are volatile for the autotune fingerprint, and what
it requires or conflicts with. Nothing else in the overlay hard-codes a module name for a switch:
the import hook, ``check``, ``receipts`` and the docs all read this table.

Every switch is off unless its gate key is set. Rollback is config only: unset the gate key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from adapter import env


@dataclass(frozen=True)
class Key:
    name: str
    parser: env.Parser[Any]
    doc: str
    default: str | None = None  # raw default, parsed like a set value; None = no default
    test_only: bool = False  # never in a production profile


@dataclass(frozen=True)
class Switch:
    name: str  # as it appears in receipts: "[dsv41] <name> installed ..."
    gate: Key  # the switch is on when this key is set to a truthy value
    summary: str
    modules: tuple[str, ...]  # install runs once all of these are imported
    wraps: tuple[str, ...]  # pinned "module:qualname" functions it wraps
    install: str  # "adapter.<module>:<function>"
    volatile: bool  # True: changes no tuned shape or kernel (left out of the autotune fingerprint)
    options: tuple[Key, ...] = ()
    requires: tuple[str, ...] = ()  # switches turned on with this one
    conflicts: tuple[str, ...] = ()  # switches that cannot run beside this one
    module_file: str = ""  # the overlay file, for docs

    @property
    def keys(self) -> tuple[Key, ...]:
        return (self.gate, *self.options)


# Keys that belong to no switch.
STRICT = Key("DSV41_STRICT", env.flag(), "turn any refusal of a requested switch into a boot failure")
DEBUG_LOG = Key("DSV41_DEBUG_LOG", env.flag(), "log the overlay's DEBUG lines (per-window detail)")
GLOBAL_KEYS: tuple[Key, ...] = (STRICT, DEBUG_LOG)
# Environment keys outside DSV41_* that change nothing tuned (left out of the autotune fingerprint).
VOLATILE_EXTERNAL_KEYS = ("SGLANG_RUN_ID",)

_AUTOTUNE = "sglang.srt.model_executor.runner.flashinfer_autotune"

SWITCHES: tuple[Switch, ...] = (
    Switch(
        name="autotune_keep",
        gate=Key("DSV41_AUTOTUNE_KEEP", env.flag(), "keep the FlashInfer autotune cache across boots of the same launch"),
        summary="keep the FlashInfer autotune cache when this rank saved it under the same launch (sglang#40320)",
        modules=(_AUTOTUNE,),
        wraps=(f"{_AUTOTUNE}:_autotune_cache_digest", f"{_AUTOTUNE}:flashinfer_autotune_context"),
        install="adapter.autotune_keep:install",
        volatile=True,
        module_file="adapter/autotune_keep.py",
    ),
    # -- end of switches (add new Switch entries above this line, in install order) --
)


def by_name(name: str) -> Switch:
    for switch in SWITCHES:
        if switch.name == name:
            return switch
    raise KeyError(name)


def all_keys() -> dict[str, Key]:
    keys = {key.name: key for key in GLOBAL_KEYS}
    for switch in SWITCHES:
        keys.update({key.name: key for key in switch.keys})
    return keys


def volatile_keys() -> frozenset[str]:
    keys = {key.name for key in GLOBAL_KEYS} | set(VOLATILE_EXTERNAL_KEYS)
    for switch in SWITCHES:
        if switch.volatile:
            keys.update(key.name for key in switch.keys)
    return frozenset(keys)


@dataclass
class Config:
    """The parsed ``DSV41_*`` configuration of one process."""

    values: dict[str, Any] = field(default_factory=dict)  # key -> parsed value (set keys and defaults)
    requested: list[Switch] = field(default_factory=list)  # in registry order, requirements included
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def strict(self) -> bool:
        return bool(self.values.get(STRICT.name))

    def __getitem__(self, key: str) -> Any:
        return self.values[key]


def _is_on(value: Any) -> bool:
    return value is not False and value is not None


def resolve(environ: Mapping[str, str]) -> Config:
    """Parse every ``DSV41_*`` key of ``environ`` and decide which switches are requested."""
    config = Config()
    known = all_keys()
    for name, raw in sorted(env.dsv41_items(environ).items()):
        key = known.get(name)
        if key is None:
            hint = env.closest_key(name, sorted(known))
            config.warnings.append(
                f"unknown key {name} ignored" + (f"; did you mean {hint}?" if hint else "")
            )
            continue
        try:
            config.values[name] = key.parser(name, raw)
        except env.ConfigError as exc:
            config.errors.append(str(exc))

    wanted = {s.name for s in SWITCHES if _is_on(config.values.get(s.gate.name))}
    pending = list(wanted)
    while pending:  # requirements turn their switches on too
        for required in by_name(pending.pop()).requires:
            if required not in wanted:
                wanted.add(required)
                pending.append(required)
    config.requested = [s for s in SWITCHES if s.name in wanted]
    for switch in config.requested:
        for other in switch.conflicts:
            if other in wanted:
                config.errors.append(f"{switch.gate.name} and {by_name(other).gate.name} cannot both be set")
        for key in switch.options:
            if key.name not in config.values and key.default is not None:
                config.values[key.name] = key.parser(key.name, key.default)
    return config
