"""What ``python -m adapter check`` warns about native SWA decode: a launch line that lets a decode
call carry more than 64 rows (such calls take the stock copy path, by the switch's design)."""

from __future__ import annotations

from adapter.core import api

MAX_ROWS = 64  # decode-form calls of more rows take the stock copy path (the registry record's wraps)
DSV4_MAX_RUNNING = 256  # SGLang's DeepSeek-V4 default max_running_requests (arg_groups/deepseek_v4_hook.py)
DSV4_POOL = "DeepSeekV4TokenToKVPool"


def predict(profile: api.Profile) -> api.Prediction:
    args = profile.server_args
    rows = getattr(args, "max_running_requests", None)
    speculative = getattr(args, "speculative_algorithm", None)
    dsv4 = profile.model is not None and profile.model.pool == DSV4_POOL
    if rows is None and dsv4:
        rows = DSV4_MAX_RUNNING
    if speculative:
        return api.Prediction(warnings=(f"--speculative-algorithm {speculative}: a decode call carries the draft "
                                        f"tokens of every row, beyond {MAX_ROWS} rows such calls take the stock "
                                        "copy path",))
    if rows is not None and rows > MAX_ROWS:
        origin = ("--max-running-requests" if getattr(args, "max_running_requests", None) is not None
                  else "SGLang's DeepSeek-V4 default max_running_requests")
        return api.Prediction(warnings=(f"{origin} = {rows} > {MAX_ROWS}: decode calls of more than {MAX_ROWS} "
                                        f"rows take the stock copy path (set --max-running-requests {MAX_ROWS} "
                                        "to serve every decode call in place)",))
    return api.Prediction()
