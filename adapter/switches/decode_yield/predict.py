"""What ``python -m adapter check`` predicts for decode yield: the engine mode it refuses on its
first scheduler pass (read from the launch line), and a warning when it runs on default
cost coefficients."""

from __future__ import annotations

from adapter.core import api
from adapter.switches.decode_yield.switch import unsupported_mode

DEFAULTS_WARNING = ("decode_yield runs on its default cost coefficients (no DSV41_DECODE_YIELD_* key): fit them on "
                    "this machine with `python -m adapter fit-cost-model` (docs/operating.md)")


def predict(profile: api.Profile) -> api.Prediction:
    warnings = () if any(k.startswith("DSV41_DECODE_YIELD_") for k in profile.environ) else (DEFAULTS_WARNING,)
    receipt = None
    if profile.status == "installed" and profile.server_args is not None:
        why = unsupported_mode(profile.server_args)
        receipt = f"refused: {why}" if why else None
    return api.Prediction(receipt, warnings=warnings)
