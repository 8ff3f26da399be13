"""The soak's planted leak: the scheduler keeps ``SOAK_PLANTED_LEAK_KIB`` KiB, written, for every
generate request it receives (``Scheduler.handle_generate_request``)."""

import os

import wrapt

KIB = int(os.environ.get("SOAK_PLANTED_LEAK_KIB", "0") or 0)
KEPT: list[bytearray] = []


def _leak(wrapped, instance, args, kwargs):
    KEPT.append(bytearray(b"\x5a") * (KIB * 1024))  # written: every page counts in RSS
    return wrapped(*args, **kwargs)


def _plant(module):
    wrapt.wrap_function_wrapper(module, "Scheduler.handle_generate_request", _leak)


if KIB > 0:
    wrapt.register_post_import_hook(_plant, "sglang.srt.managers.scheduler")
