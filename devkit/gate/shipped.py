"""The shipped profile's switch keys on a kit: what the latency leg and ``bench chat-latency --sweep``
judge, read from the profile file (``.env.tp4.example``) with the project's env-file reader.

Kept: the keys of every switch the gate turns on on this engine (its registry ``gate_role`` acts),
as the file sets them. A key of such a switch that the gate's own profile sets beside its on-key
(registry ``gate_role.profile``, then the kit's overrides) is sized to the kit's model, and the kit's
value replaces the file's: the cone's depth is the model's bound (2048 on a 61-layer V4.1, 64 on
the Mellum kit, 768 on the DSV4 kit). ``--set-key`` values go on top (:func:`with_set_keys`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

PROFILE = Path(__file__).resolve().parents[2] / ".env.tp4.example"  # the shipped TP4 profile


def profile(kit_name: str, path: str | Path = PROFILE) -> dict[str, str]:
    """The shipped switch keys of ``path`` for the kit ``kit_name`` (see the module's docstring)."""
    from adapter.core import env
    from devkit.engine_kit import model_kits
    from devkit.gate.verdict import acting

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"the shipped profile {path} is missing: the latency leg runs its switch keys")
    values = env.read_env_file(str(path))
    switches = acting()
    keys = {key.name for s in switches for key in s.keys}
    shipped = {k: v for k, v in values.items() if k in keys}
    sized = {k: v for s in switches for k, v in s.gate_role.profile if k != s.on_key.name}
    sized.update(model_kits.kit(kit_name).profile_overrides())
    shipped.update({k: v for k, v in sized.items() if k in shipped})
    if "DSV41_DECODE_YIELD" not in shipped:
        raise ValueError(f"{path} sets no DSV41_DECODE_YIELD: the latency leg judges decode yield's bound")
    return shipped


def with_set_keys(base: dict[str, str], pairs: Sequence[str]) -> dict[str, str]:
    """``base`` with each ``KEY=VALUE`` of ``pairs`` set (``--set-key``): a registry key and a value
    its parser accepts, else a clear error naming the pair."""
    from adapter.core import env, registry

    known = registry.all_keys()
    out = dict(base)
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--set-key {pair!r} is invalid: expected KEY=VALUE")
        key = known.get(name)
        if key is None:
            hint = env.closest_key(name, sorted(known))
            raise ValueError(f"--set-key {pair!r} is invalid: {name} is no key of the registry"
                             + (f" (did you mean {hint}?)" if hint else ""))
        try:
            key.parser(name, value)
        except env.ConfigError as exc:
            raise ValueError(f"--set-key {pair!r} is invalid: {exc}") from exc
        out[name] = value
    return out
