"""What ``python -m adapter check`` predicts for decode yield: the engine mode it refuses on its
first scheduler pass (read from the launch line), which mode it runs in (a note), and a warning when
the open loop (``DSV41_DECODE_YIELD_MODE=model``) runs on default cost coefficients."""

from __future__ import annotations

from adapter.core import api
from adapter.switches.decode_yield.switch import unsupported_mode

MODE_KEY = "DSV41_DECODE_YIELD_MODE"
DEFAULTS_WARNING = ("decode_yield runs open-loop (DSV41_DECODE_YIELD_MODE=model) on its default cost coefficients "
                    "(no DSV41_DECODE_YIELD_* coefficient key): fit them on this machine with `python -m adapter "
                    "fit-cost-model` (docs/operating.md), or unset the mode (measured: no coefficients needed)")


def _mode_note(params: dict) -> str:
    how = ("windows from measured iteration times, closed on the measured share; rank 0 decides under TP"
           if params["mode"] == "measured" else f"open-loop integer cost model, coefficients {params['cost']}")
    return f"decode_yield: share {params['share']} % in {params['mode']} mode ({how})"


def predict(profile: api.Profile) -> api.Prediction:
    coefficients = [k for k in profile.environ if k.startswith("DSV41_DECODE_YIELD_") and k != MODE_KEY]
    open_loop = profile.values.get(MODE_KEY) == "model"
    warnings = (DEFAULTS_WARNING,) if open_loop and not coefficients else ()
    if profile.status != "installed":
        return api.Prediction(warnings=warnings)
    params = {k: profile.installed[k] for k in ("share", "mode", "cost") if k in profile.installed}
    receipt = None
    if profile.server_args is not None and (why := unsupported_mode(profile.server_args)):
        receipt = f"refused: {why}"
    return api.Prediction(receipt, params, warnings, notes=(_mode_note(params),) if "mode" in params else ())
